"""The ``vllm serve`` flags loraplex has no setting of its own for: each is either accepted
because its value is what loraplex does anyway (``--pipeline-parallel-size 1``,
``--kv-cache-dtype auto``, ``--enforce-eager``), or refused with one clear line,
``not supported: --quantization awq (loraplex serves unquantized weights ...)``, instead of
argparse's generic "unrecognized arguments".

The table lists vLLM's flags by name only (from ``vllm serve --help`` of vLLM 0.32 plus the
older spellings still found in scripts); where loraplex has a setting of the same name
(:mod:`loraplex.config`), that setting is the flag. The same rules apply to a ``--config``
file's keys (:func:`file_key`). vLLM's underscore spellings (``--max_model_len``) become dashes before parsing
(:func:`normalize_argv`), as vLLM's own parser does. Torch-free.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["VllmFlag", "add_vllm_compat_arguments", "file_key", "normalize_argv", "vllm_flags"]

ANY = ("*",)  # every value is loraplex's behaviour


@dataclass(frozen=True)
class VllmFlag:
    """One vLLM flag: its spellings, what it takes (``bool``: ``--x``/``--no-x``; ``true``: no
    value; ``one``/``many`` values), the values accepted as loraplex's behaviour (lowercase;
    for bools ``true``/``false``; empty: always refused) and why it is refused otherwise."""

    flags: tuple[str, ...]
    takes: str
    accepts: tuple[str, ...] = ()
    why: str = ""
    sets: tuple[tuple[str, str, Any], ...] = ()  # (value, namespace attr, what it sets)


_ONE_DEVICE = "loraplex runs one model copy on one device; run replicas behind `loraplex route`"
_NOT_LLAMA = "loraplex serves Llama-family text decoders only"
_TEXT_ONLY = "loraplex serves text-only models"
_ONE_DEVICE_EXPERTS = (
    "loraplex runs every expert of a MoE model on one device, grouped with its LoRA "
    "(expert parallelism is not supported)"
)
_NO_GRAPHS = "loraplex runs eagerly (no CUDA graphs or compilation)"
_NO_OFFLOAD = "loraplex keeps weights and KV on the device (no offloading or KV transfer)"
_SPEC_JSON = "set speculative decoding with --speculative-config (vLLM's JSON object)"
_QUANT_CONFIG = "loraplex reads quantization from the checkpoint's config.json (--quantization)"

# (spellings, takes, accepted values, why) -- groups share their reason
_TABLE: list[tuple[str, str, tuple[str, ...], str]] = [
    # parallelism: one device
    ("--pipeline-parallel-size -pp", "one", ("1",), _ONE_DEVICE),
    ("--data-parallel-size -dp", "one", ("1",), _ONE_DEVICE),
    ("--decode-context-parallel-size -dcp", "one", ("1",), _ONE_DEVICE),
    ("--prefill-context-parallel-size -pcp", "one", ("1",), _ONE_DEVICE),
    ("--api-server-count -asc", "one", ("1",), "loraplex runs one API server process"),
    ("--distributed-executor-backend", "one", ("uni", "mp"), _ONE_DEVICE),
    ("--disable-custom-all-reduce", "bool", ANY, _ONE_DEVICE),
    ("--max-parallel-loading-workers", "one", ANY, ""),  # shards are read one at a time
    ("--worker-cls", "one", ("auto",), _ONE_DEVICE),
    ("--worker-use-ray", "true", (), _ONE_DEVICE),
    ("--enable-expert-parallel -ep", "bool", ("false",), _ONE_DEVICE_EXPERTS),
    # what loraplex does anyway
    ("--enforce-eager", "bool", ANY, _NO_GRAPHS),
    ("--max-seq-len-to-capture", "one", ANY, _NO_GRAPHS),
    ("--max-context-len-to-capture", "one", ANY, _NO_GRAPHS),
    ("--kv-cache-dtype", "one", ("auto",), "the KV cache has the model's dtype (--dtype)"),
    ("--load-format", "one", ("auto", "safetensors"), "loraplex reads safetensors only"),
    ("--tokenizer-mode", "one", ("auto", "hf"), "loraplex uses the Hugging Face tokenizer"),
    ("--config-format", "one", ("auto", "hf"), "loraplex reads Hugging Face config.json"),
    ("--model-impl", "one", ("auto",), "loraplex has its own Llama-family implementation"),
    ("--runner", "one", ("auto", "generate"), "loraplex serves text generation only"),
    ("--convert", "one", ("auto", "none"), "loraplex serves text generation only"),
    ("--task", "one", ("auto", "generate"), "loraplex serves text generation only"),
    ("--enable-chunked-prefill", "bool", ("true",), "loraplex always chunks long prompts"),
    ("--lora-dtype", "one", ("auto",), "adapters take the model's dtype"),
    ("--max-logprobs", "one", ("20",), "loraplex returns at most 20 logprobs per token"),
    ("--response-role", "one", ("assistant",), "loraplex answers as 'assistant'"),
    ("--chat-template-content-format", "one", ("auto",), "content format is detected"),
    ("--use-tqdm-on-load", "bool", ANY, ""),  # loading progress is logged either way
    ("--disable-frontend-multiprocessing", "true", ANY, ""),  # one process already
    ("--use-v2-block-manager", "true", ANY, ""),  # a no-op in vLLM too
    ("--disable-async-output-proc", "true", ANY, ""),
    ("--swap-space", "one", ANY, ""),  # vLLM's V1 engine ignores it as well: preemption recomputes
    ("--preemption-mode", "one", ("recompute",), "preempted sequences are recomputed"),
    ("--num-scheduler-steps", "one", ("1",), "loraplex schedules every step"),
    ("--num-lookahead-slots", "one", ("0",), _SPEC_JSON),
    ("--tokenizer-pool-size", "one", ("0",), "tokenization runs in the --prepare-workers pool"),
    ("--code-revision", "one", ANY, ""),  # loraplex runs no model code from the hub
    ("--stream-interval", "one", ("1",), "loraplex streams one chunk per token"),
    ("--disable-sliding-window", "bool", ("false",), "sliding windows come from config.json"),
    ("--aggregate-engine-logging", "true", ANY, ""),  # one engine
    ("--fail-on-environ-validation", "bool", ("false",), ""),
    ("--kv-cache-metrics", "bool", ("false",), "no per-block KV metrics"),
    ("--async-scheduling", "bool", ("false",), "loraplex schedules synchronously"),
    ("--trust-request-chat-template", "bool", ("false",), ""),
    ("--enable-prompt-tokens-details", "bool", ("false",), ""),
    ("--enable-force-include-usage", "bool", ("false",), ""),
    ("--return-tokens-as-token-ids", "bool", ("false",), ""),
    ("--enable-request-id-headers", "bool", ("false",), ""),
    ("--enable-server-load-tracking", "bool", ("false",), ""),
    ("--enable-tokenizer-info-endpoint", "bool", ("false",), ""),
    ("--enable-log-outputs", "bool", ("false",), ""),
    ("--enable-log-deltas", "bool", ANY, ""),  # only meaningful with --enable-log-outputs
    # vLLM PR #52757 (open): per-request lora_scale off unless asked; loraplex always takes it
    ("--enable-per-request-lora-scale", "bool", ANY, ""),
    ("--log-error-stack", "bool", ("false",), ""),
    ("--exclude-tools-when-tool-choice-none", "bool", ("false",), ""),
    ("--sse-keep-alive-interval", "one", ("0",), ""),
    ("--reasoning-parser", "one", ("",), "no reasoning parsers"),
    ("--enable-reasoning", "true", (), "no reasoning parsers"),
    # quantization
    ("--quantization-config --quantization-param-path", "one", (), _QUANT_CONFIG),
    ("--allow-deprecated-quantization", "bool", ("false",), ""),
    ("--qlora-adapter-name-or-path", "one", (), "serve the QLoRA adapter with --lora-modules"),
    # speculative decoding
    ("--spec-method --spec-model --spec-tokens", "one", (), _SPEC_JSON),
    ("--speculative-model --num-speculative-tokens", "one", (), _SPEC_JSON),
    # compilation and kernels
    ("--compilation-config -cc --cudagraph-capture-sizes", "many", (), _NO_GRAPHS),
    ("--max-cudagraph-capture-size --optimization-level --performance-mode", "one", (), _NO_GRAPHS),
    ("--attention-backend --attention-config -ac --kernel-config --ir-op-priority", "one", (), ""),
    ("--moe-backend --linear-backend --all2all-backend --expert-placement-strategy", "one", (), ""),
    ("--enable-flashinfer-autotune --enable-dbo --enable-eplb", "bool", ("false",), ""),
    # offloading, KV transfer, sleep mode
    ("--cpu-offload-gb --kv-offloading-size --offload-group-size", "one", ("0",), _NO_OFFLOAD),
    ("--kv-offloading-backend --offload-backend", "one", (), _NO_OFFLOAD),
    ("--kv-transfer-config --kv-events-config --ec-transfer-config", "one", (), _NO_OFFLOAD),
    ("--enable-sleep-mode --enable-cumem-allocator", "bool", ("false",), _NO_OFFLOAD),
    # model variants loraplex does not run
    (
        "--hf-config-path --hf-overrides --model-class-overrides --pooler-config",
        "one",
        (),
        _NOT_LLAMA,
    ),
    ("--rope-scaling --rope-theta --override-neuron-config", "one", (), "set them in config.json"),
    (
        "--mamba-cache-dtype --mamba-ssm-cache-dtype --mamba-block-size --mamba-backend",
        "one",
        (),
        _NOT_LLAMA,
    ),
    ("--limit-mm-per-prompt --mm-processor-kwargs --media-io-kwargs", "one", (), _TEXT_ONLY),
    (
        "--mm-processor-cache-gb --mm-encoder-tp-mode --allowed-local-media-path",
        "one",
        (),
        _TEXT_ONLY,
    ),
    ("--allowed-media-domains", "many", (), _TEXT_ONLY),
    (
        "--enable-prompt-embeds --enable-mm-embeds --language-model-only",
        "bool",
        ("false",),
        _TEXT_ONLY,
    ),
    ("--logits-processors", "many", (), "no custom logits processors"),
    ("--logits-processor-pattern --io-processor-plugin", "one", (), "no plugins"),
    ("--tool-parser-plugin --tool-server", "one", (), "tool parsers: --tool-call-parser"),
    ("--default-chat-template-kwargs", "one", (), "give chat_template_kwargs per request"),
    ("--guided-decoding-backend --structured-outputs-config", "one", (), "one grammar engine"),
    ("--enable-lora-bias", "true", (), "adapters with bias terms are not supported"),
    ("--lora-extra-vocab-size --long-lora-scaling-factors", "one", (), "no extra LoRA vocab"),
    ("--lora-target-modules", "many", (), "every supported projection is adaptable"),
    ("--default-mm-loras --max-lora-cls-labels", "one", (), _TEXT_ONLY),
    # scheduler knobs loraplex does not have
    ("--max-num-partial-prefills --max-long-partial-prefills", "one", ("1",), ""),
    ("--long-prefill-token-threshold", "one", ("0",), ""),
    ("--max-num-scheduled-tokens --max-num-active-seqs --max-num-queued-tokens", "one", (), ""),
    ("--scheduler-cls", "one", (), "one scheduler"),
    ("--prefix-caching-hash-algo --prefix-cache-retention-interval", "one", (), ""),
    ("--num-gpu-blocks", "one", (), "use --num-gpu-blocks-override"),
    # serving front end
    ("--headless", "bool", ANY, "every node but --node-rank 0 runs its ranks headless"),
    ("--grpc", "true", (), _ONE_DEVICE),
    ("--grpc-port --uds --middleware --ssl-ciphers --h11-max-incomplete-event-size", "one", (), ""),
    ("--h11-max-header-count", "one", (), ""),
    ("--ssl-cert-reqs", "one", ("0",), "client certificates are not checked"),
    ("--enable-offline-docs", "bool", ("false",), ""),
    ("--logging-config --log-config-file", "one", (), "use --log-level and --log-format"),
    ("--otlp-traces-endpoint --show-hidden-metrics-for-version", "one", (), "no tracing"),
    ("--collect-detailed-traces", "many", (), "no tracing"),
    ("--seed-per-request", "true", (), ""),
    (
        "--enable-log-requests",
        "bool",
        ANY,
        "",
    ),  # loraplex logs requests by default; --no-enable-log-requests = --disable-log-requests
]

# the rest of vLLM 0.32's flags: refused (no loraplex equivalent)
_REST: dict[str, str] = {
    "bool": (
        "--trust-request-mm-kwargs --enable-per-request-metrics --cohere-is-reasoning-model "
        "--tokens-only --enable-scale-out --enable-flash-late-interaction "
        "--enable-return-routed-experts --return-sampling-mask --use-fp64-gumbel "
        "--enable-trace-replay --disable-cascade-attn --sleep-mode-offload-cudagraph "
        "--enable-nccl-comm-suspend --enable-mamba-cache-stochastic-rounding --numa-bind "
        "--dcp-q-replicate --data-parallel-hybrid-lb -dph --data-parallel-external-lb -dpe "
        "--enable-hc-sp --enable-batch-sharded-sampling --enable-ep-weight-filter "
        "--enable-shm-tensor-arena --enable-elastic-ep --disable-nccl-for-dp-synchronization "
        "--ray-workers-use-nsight --enable-fault-tolerance --kv-sharing-fast-prefill "
        "--swa-bounded-replay --enable-mamba-shared-prefix-checkpoint --use-replayssm "
        "--mm-encoder-only --interleave-mm-strings --skip-mm-profiling --mm-device-do-normalize "
        "--enable-tower-connector-lora --specialize-active-lora --enable-mixed-moe-lora-format "
        "--enable-moe-shared-loras --cudagraph-metrics --enable-layerwise-nvtx-tracing "
        "--enable-mfu-metrics --enable-logging-iteration-details --jit-monitor-verbose "
        "--long-prefill-token-threshold-adaptive --disable-chunked-mm-input "
        "--scheduler-reserve-full-isl --disable-hybrid-kv-cache-manager "
    ),
    "true": ("--data-parallel-multi-port-external-lb -dpm "),
    "one": (
        "--tool-strict-level --cohere-format --anthropic-disabled-thinking-effort "
        "--fingerprint-mode --fingerprint-value --data-parallel-supervisor-port "
        "--dp-supervisor-probe-interval-s --dp-supervisor-probe-timeout-s "
        "--dp-supervisor-probe-failure-threshold --logprobs-mode --renderer-num-workers "
        "--safetensors-load-strategy --safetensors-prefetch-num-threads "
        "--safetensors-prefetch-block-size --model-loader-extra-config --pt-load-map-location "
        "--mamba-ssu-algorithm --mamba-cache-philox-rounds --reasoning-parser-plugin "
        "--distributed-timeout-seconds "
        "--cpu-distributed-timeout-seconds --device-ids --dcp-comm-backend "
        "--dcp-kv-cache-interleave-size --cp-kv-cache-interleave-size --data-parallel-rank -dpn "
        "--data-parallel-start-rank -dpr --data-parallel-size-local -dpl --data-parallel-address "
        "-dpa --data-parallel-rpc-port -dpp --data-parallel-backend -dpb --ubatch-size "
        "--elastic-ep-max-dp-size --dbo-decode-token-threshold --dp-sync-interval "
        "--dbo-prefill-token-threshold --eplb-config --worker-extension-cls "
        "--fault-tolerance-config --prefix-match-unit --mamba-cache-mode --replayssm-buffer-len "
        "--offload-num-in-group --offload-prefetch-step --mm-processor-cache-type "
        "--mm-hasher-algorithm --mm-shm-cache-max-object-size-mb --mm-encoder-attn-backend "
        "--mm-encoder-attn-dtype --mm-encoder-fp8-scale-path --mm-encoder-fp8-scale-save-path "
        "--mm-encoder-fp8-scale-save-margin --video-pruning-rate --video-pruning-method "
        "--mm-tensor-ipc --mm-processor-device --mm-ipc-gpu-memory-gb "
        "--per-request-spec-decode-metrics --kv-cache-metrics-sample --custom-histogram-buckets "
        "--jit-monitor-mode --watermark --prefill-schedule-interval --sparse-indexer-topk-backend "
        "--watermark-config --diffusion-config -dc --ec-manager-config --engram-config "
        "--reasoning-config --additional-config --aux-output-config --profiler-config "
        "--weight-transfer-config --gdn-prefill-backend --kda-prefill-backend "
        "--kda-decode-backend "
    ),
    "many": (
        "--sleep-preserve-parameter-names --ignore-patterns --numa-bind-nodes --numa-bind-cpus "
        "--kv-cache-dtype-skip-layers --cpu-offload-params --offload-params "
    ),
}

_SETS: dict[str, tuple[tuple[str, str, Any], ...]] = {
    "--enable-log-requests": (("false", "disable_log_requests", True),),
}


def _groups(names: list[str]) -> list[list[str]]:
    """Separate flags of one line: each long name, with the short aliases that follow it."""
    groups: list[list[str]] = []
    for n in names:
        if n.startswith("--") or not groups:
            groups.append([n])
        else:
            groups[-1].append(n)
    return groups


def vllm_flags() -> list[VllmFlag]:
    """Every listed vLLM flag, one entry per group of spellings that share a meaning."""
    out = []
    for spellings, takes, accepts, why in _TABLE:
        for g in _groups(spellings.split()):
            out.append(VllmFlag(tuple(g), takes, accepts, why, _SETS.get(g[0], ())))
    for takes, names_text in _REST.items():
        for spellings in _groups(names_text.split()):
            out.append(VllmFlag(tuple(spellings), takes, (), "no loraplex equivalent"))
    return out


def _judge(f: VllmFlag, value: str, shown: str) -> dict[str, Any]:
    """The settings an accepted ``value`` of ``f`` stands for; ValueError if it is refused."""
    if f.accepts == ANY or value in f.accepts:
        return {attr: what for when, attr, what in f.sets if value == when}
    why = f" ({f.why})" if f.why else ""
    if f.accepts and f.takes in ("one", "many"):
        only = " or ".join(repr(a) for a in f.accepts)
        why = f" (only {only}: {f.why})" if f.why else f" (only {only})"
    raise ValueError(f"not supported: {shown}{why}")


def file_key(key: str, value: object) -> dict[str, Any] | None:
    """A config-file key that names a listed vLLM flag (``tensor-parallel-size: 1``): the
    settings it stands for, ValueError when its value is refused, None for other keys."""
    flags = {n.lstrip("-"): f for f in vllm_flags() for n in f.flags if n.startswith("--")}
    f = flags.get(key)
    if f is None:
        return None
    if f.takes in ("bool", "true"):
        text = (
            "true" if value is True or str(value).lower() in ("true", "yes", "on", "1") else "false"
        )
        shown = f"{key}: {text}"
    else:
        items = value if isinstance(value, list) else [value]
        text = " ".join(str(v) for v in items).strip().lower()
        shown = f"{key}: {value}"
    return _judge(f, text, shown)


class _CompatAction(argparse.Action):
    """Accept a vLLM flag whose value is loraplex's behaviour; refuse any other clearly."""

    def __init__(self, option_strings: Sequence[str], dest: str, flag: VllmFlag, **kw: Any):
        self.flag = flag
        super().__init__(option_strings, dest, **kw)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        f = self.flag
        used = option_string or f.flags[0]
        if f.takes == "bool":
            value = "false" if used.startswith("--no-") else "true"
            shown = used
        elif f.takes == "true":
            value, shown = "true", used
        else:
            items = values if isinstance(values, list) else [values]
            value = " ".join(str(v) for v in items).strip().lower()
            shown = f"{used} {' '.join(map(str, items))}"
        try:
            sets = _judge(f, value, shown)
        except ValueError as e:
            parser.error(str(e))
        for attr, what in sets.items():
            setattr(namespace, attr, what)


def add_vllm_compat_arguments(parser: argparse.ArgumentParser) -> None:
    """Register every listed vLLM flag that ``parser`` does not already have."""
    have = set(parser._option_string_actions)
    for f in vllm_flags():
        names = [n for n in f.flags if n not in have]
        if f.takes == "bool":
            names += [f"--no-{n[2:]}" for n in names if n.startswith("--")]
            names = [n for n in names if n not in have]
        if not names:
            continue
        have.update(names)
        nargs: Any = {"bool": 0, "true": 0, "one": None, "many": "+"}[f.takes]
        parser.add_argument(
            *names,
            action=_CompatAction,
            flag=f,
            nargs=nargs,
            dest="vllm_compat_" + names[0].lstrip("-").replace("-", "_"),
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """vLLM's spellings: ``--max_model_len=8`` -> ``--max-model-len=8`` (flag names only; the
    values and everything after ``--`` stay as typed)."""
    out = []
    rest = False
    for a in argv:
        if rest or not a.startswith("--") or a == "--":
            rest = rest or a == "--"
            out.append(a)
            continue
        name, sep, value = a.partition("=")
        out.append(name.replace("_", "-") + sep + value)
    return out
