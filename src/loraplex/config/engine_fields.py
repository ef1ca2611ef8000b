"""The engine's settings as declared fields, in ``--help`` order: each field's flag, value
parser, bounds and help (:func:`loraplex.config.fields.setting`). ``EngineConfig``
(:mod:`loraplex.config.engine`) is this table plus the rules between fields and the values
derived from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.config.fields import human_int, seconds, setting, stripped
from loraplex.config.speculative import speculative_config_text
from loraplex.config.values import (
    ADAPTER_EVICTION_POLICIES,
    DTYPES,
    QUANTIZATION_METHODS,
    QUANTIZED_CHECKPOINT_FORMATS,
    WHITESPACE_MODES,
    dtype_spellings,
    parse_byte_size,
    parse_device,
    parse_dtype,
    parse_eviction_policy,
    parse_generation_config,
    parse_json_object,
    parse_rank_budgets,
    parse_scheduling_policy,
    parse_slo_classes,
    parse_store_url,
    parse_tenant_classes,
)

DEFAULT_MAX_CPU_LORAS = 32  # host copies when --max-cpu-loras is not given (and max_loras less)


@dataclass(frozen=True)
class EngineFields:
    """The declared settings of one engine; names follow vLLM's so users recognise them
    (``EngineConfig`` is the class to build)."""

    model: str = field(
        metadata=setting(
            "--model", metavar="MODEL_DIR", help="same as MODEL_DIR (vLLM's older form)"
        )
    )
    tokenizer: str | None = field(  # None: the model's own
        default=None,
        metadata=setting(
            "--tokenizer",
            parse=stripped,
            metavar="DIR",
            help="tokenizer directory or hub id (default: the model's)",
        ),
    )
    revision: str | None = field(  # of a hub model (a branch, tag or commit)
        default=None,
        metadata=setting(
            "--revision", parse=stripped, help="hub revision of the model (default: main)"
        ),
    )
    tokenizer_revision: str | None = field(
        default=None,
        metadata=setting(
            "--tokenizer-revision",
            parse=stripped,
            help="hub revision of --tokenizer (default: main)",
        ),
    )
    trust_remote_code: bool = field(
        default=False,
        metadata=setting(
            "--trust-remote-code",
            help="let the tokenizer run code from its directory (loraplex runs no model code "
            "but its own; default: {default})",
        ),
    )
    download_dir: str | None = field(  # the hub cache for hub ids (default: huggingface_hub's)
        default=None,
        metadata=setting(
            "--download-dir",
            parse=stripped,
            metavar="DIR",
            help="hub cache directory for hub ids (default: $HF_HUB_CACHE, $HF_HOME/hub or "
            "~/.cache/huggingface/hub)",
        ),
    )
    generation_config: str = field(
        default="auto",
        metadata=setting(
            "--generation-config",
            parse=parse_generation_config,
            metavar="{auto,vllm,DIR}",
            help="default sampling parameters: auto (the model's generation_config.json), "
            "vllm (none) or a directory (default: {default})",
        ),
    )
    override_generation_config: str | None = field(  # a JSON object, applied over the above
        default=None,
        metadata=setting(
            "--override-generation-config",
            parse=parse_json_object,
            metavar="JSON",
            help="JSON object of default sampling parameters over --generation-config, e.g. "
            "'{\"temperature\": 0.5}'",
        ),
    )
    dtype: str = field(
        default="auto",
        metadata=setting(
            "--dtype",
            parse=parse_dtype,
            choices=DTYPES,
            metavar="{" + ",".join(dtype_spellings()) + "}",
            help="weight/activation dtype (default: {default})",
        ),
    )
    quantization: str | None = field(
        default=None,
        metadata=setting(
            "--quantization",
            "-q",
            choices=QUANTIZATION_METHODS,
            help="the base's weight quantization: a checkpoint format to require "
            f"({', '.join(QUANTIZED_CHECKPOINT_FORMATS)}; default: read from config.json's "
            "quantization_config) or int8 (per channel) / int4 (grouped) to quantize a float "
            "checkpoint at load",
        ),
    )
    quantization_group_size: int | None = field(
        default=None,
        metadata=setting(
            "--quantization-group-size",
            ge=32,
            help="columns per int4 scale for --quantization int4 (a multiple of 32; default 128)",
        ),
    )
    device: str = field(
        default="auto",
        metadata=setting(
            "--device", parse=parse_device, help="auto, cpu, cuda or cuda:N (default: {default})"
        ),
    )
    seed: int = field(
        default=0, metadata=setting("--seed", help="random seed (default: {default})")
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata=setting(
            "--tensor-parallel-size",
            "-tp",
            ge=1,
            help="ranks the model is sharded over (Megatron-style, one process each, on CPU "
            "over gloo; the cores shared out unless --num-threads) (default: {default})",
        ),
    )
    fully_sharded_loras: bool = field(
        default=False,
        metadata=setting(
            "--fully-sharded-loras",
            help="with --tensor-parallel-size > 1, cut LoRA's A and B both over the ranks "
            "(1/N of each per rank, one small all-reduce per projection group) instead of "
            "replicating one of them, as vLLM's flag (default: {default})",
        ),
    )
    nnodes: int = field(
        default=1,
        metadata=setting(
            "--nnodes",
            "-n",
            ge=1,
            help="nodes the tensor-parallel ranks run on, as torchrun's flag; each runs "
            "tensor_parallel_size / nnodes of them (default: {default})",
        ),
    )
    node_rank: int = field(
        default=0,
        metadata=setting(
            "--node-rank",
            "-r",
            ge=0,
            help="this node's index among --nnodes; every node but 0 runs its ranks headless "
            "(default: {default})",
        ),
    )
    master_addr: str = field(
        default="127.0.0.1",
        metadata=setting(
            "--master-addr",
            help="node 0's address the ranks rendezvous at (torch.distributed's TCP store) "
            "(default: {default})",
        ),
    )
    master_port: int = field(
        default=0,
        metadata=setting(
            "--master-port",
            ge=0,
            le=65535,
            help="the rendezvous port (0: a free one; one node only) (default: {default})",
        ),
    )
    # LoRA
    enable_lora: bool = field(
        default=True,
        metadata=setting(
            "--enable-lora",
            cli_default=False,  # vLLM semantics: `serve` has LoRA off unless --enable-lora
            help="serve LoRA adapters (default: {default})",
        ),
    )
    max_loras: int = field(
        default=8,
        metadata=setting(
            "--max-loras", ge=1, help="adapters resident on the device at once (default: {default})"
        ),
    )
    max_cpu_loras: int | None = field(  # None: see __post_init__ (always an int afterwards)
        default=None,
        metadata=setting(
            "--max-cpu-loras",
            ge=1,
            help="adapters kept in host memory, at least --max-loras (default: the larger of "
            f"--max-loras and {DEFAULT_MAX_CPU_LORAS})",
        ),
    )
    max_lora_rank: int = field(
        default=64,
        metadata=setting(
            "--max-lora-rank", ge=1, help="largest adapter rank accepted (default: {default})"
        ),
    )
    lora_merge_after_steps: int = field(
        default=0,
        metadata=setting(
            "--lora-merge-after-steps",
            ge=0,
            help="merge the only running adapter into the base weights after this many "
            "consecutive steps with no other adapter and no base request; 0: never "
            "(default: {default})",
        ),
    )
    max_lora_device_fraction: float | None = field(
        default=None,
        metadata=setting(
            "--max-lora-device-fraction",
            gt=0,
            le=1,
            metavar="FRACTION",
            help="cap the device slot bank's bytes at this fraction of the memory left after "
            "the weights (fewer slots than --max-loras when high ranks would not fit), so "
            "adapters cannot crowd out the KV cache (default: no byte cap)",
        ),
    )
    lora_rank_slot_budgets: str | None = field(
        default=None,
        metadata=setting(
            "--lora-rank-slot-budgets",
            parse=parse_rank_budgets,
            metavar="RANK:SLOTS,...",
            help="device slots running requests may hold per rank bucket, e.g. 8:12,64:4 "
            "(rank <= 8: 12 slots, rank 9-64: 4); the largest bucket must reach "
            "--max-lora-rank (default: no budgets)",
        ),
    )
    # adapter cache tiers (see loraplex.cache.adapters)
    max_cpu_lora_bytes: int | None = field(  # L1 byte budget (with the max_cpu_loras count)
        default=None,
        metadata=setting(
            "--max-cpu-lora-bytes",
            parse=parse_byte_size,
            ge=1,
            metavar="BYTES",
            help="host-memory budget of adapter weights, e.g. 4GiB, 512MiB, 1G (default: no "
            "byte limit, only --max-cpu-loras)",
        ),
    )
    adapter_eviction_policy: str = field(
        default="hybrid",
        metadata=setting(
            "--adapter-eviction-policy",
            parse=parse_eviction_policy,
            metavar="{" + ",".join(ADAPTER_EVICTION_POLICIES) + "}",
            help="adapter eviction policy (default: {default})",
        ),
    )
    disk_cache_dir: str | None = field(  # L2 directory (object-store adapters); None: no L2
        default=None,
        metadata=setting(
            "--disk-cache-dir",
            metavar="DIR",
            help="local directory caching object-store adapters (L2; needs --disk-cache-bytes)",
        ),
    )
    disk_cache_bytes: int | None = field(  # L2 byte budget (required with disk_cache_dir)
        default=None,
        metadata=setting(
            "--disk-cache-bytes",
            parse=parse_byte_size,
            ge=1,
            metavar="BYTES",
            help="byte budget of --disk-cache-dir, e.g. 20GiB",
        ),
    )
    adapter_min_residency_s: float = field(
        default=0.0,
        metadata=setting(
            "--adapter-min-residency",
            parse=seconds,
            ge=0,
            metavar="SECONDS",
            help="seconds a newly loaded adapter is protected from eviction (default: {default})",
        ),
    )
    adapter_load_timeout_s: float = field(
        default=10.0,
        metadata=setting(
            "--adapter-load-timeout",
            parse=seconds,
            gt=0,
            metavar="SECONDS",
            help="seconds a request waits for room in host memory before a 503 "
            "(default: {default})",
        ),
    )
    adapter_store_url: str | None = field(  # L3
        default=None,
        metadata=setting(
            "--adapter-store-url",
            parse=parse_store_url,
            metavar="URL",
            help="object store of adapters: s3://bucket/prefix (endpoint from $AWS_ENDPOINT_URL, "
            "credentials from the AWS variables), file:///dir or a directory",
        ),
    )
    # KV cache and scheduling
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata=setting(
            "--gpu-memory-utilization",
            "--device-memory-utilization",
            gt=0,
            le=1,
            metavar="FRACTION",
            help="on CUDA, the fraction of the device's memory this server may use in all "
            "(weights, activations, KV cache): the KV cache gets what is left (default: "
            "{default}; --kv-cache-memory overrides it)",
        ),
    )
    block_size: int = field(
        default=16,
        metadata=setting("--block-size", ge=1, help="tokens per KV block (default: {default})"),
    )
    kv_cache_memory_bytes: int | None = field(
        default=None,
        metadata=setting(
            "--kv-cache-memory",
            "--kv-cache-memory-bytes",
            parse=parse_byte_size,
            ge=1,
            metavar="BYTES",
            help="KV cache size in bytes: 2GiB, 512MiB (powers of 1024), 1G, 1GB (powers of "
            "1000) or a number (default: sized from device memory)",
        ),
    )
    num_kv_blocks: int | None = field(  # explicit override of the block count
        default=None,
        metadata=setting(
            "--num-gpu-blocks-override",
            ge=1,
            help="number of KV blocks, whatever the memory (default: sized from memory)",
        ),
    )
    max_model_len: int | None = field(
        default=None,
        metadata=setting(
            "--max-model-len",
            parse=human_int,
            ge=1,
            help="context length, e.g. 4096, 32k, 32K (default: from the model config)",
        ),
    )
    max_num_seqs: int = field(
        default=64,
        metadata=setting("--max-num-seqs", ge=1, help="sequences per step (default: {default})"),
    )
    max_num_batched_tokens: int = field(
        default=2048,
        metadata=setting(
            "--max-num-batched-tokens",
            "--max-num-batched-token",  # KubeAI's model catalog spelling (an argparse prefix)
            parse=human_int,
            ge=1,
            help="tokens per step (default: {default})",
        ),
    )
    kv_cache_layer_groups: int = field(
        default=1,
        metadata=setting(
            "--kv-cache-layer-groups",
            ge=1,
            help="cut the KV cache's block tables into this many groups of consecutive layers, "
            "so an adapter that leaves the first layers alone shares their KV blocks with the "
            "base model (default: {default}: one group, or one per window kind)",
        ),
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata=setting(
            "--enable-prefix-caching",
            help="reuse KV blocks of shared prefixes (default: {default})",
        ),
    )
    scheduling_policy: str = field(
        default="fcfs",
        metadata=setting(
            "--scheduling-policy",
            parse=parse_scheduling_policy,
            help="fcfs (arrival order), priority (vLLM's: lower 'priority' first, preempting "
            "higher values) or fair (SLO classes with weighted token shares, tenants balanced "
            "by a virtual token counter within a class) (default: {default})",
        ),
    )
    slo_classes: str = field(
        default="gold=8,standard=4,batch=1",
        metadata=setting(
            "--slo-classes",
            parse=parse_slo_classes,
            metavar="NAME=WEIGHT,...",
            help="SLO classes, most important first, with their token-share weights under "
            "--scheduling-policy fair; a request's priority p moves it p classes from "
            "--default-slo-class (default: {default})",
        ),
    )
    default_slo_class: str = field(
        default="standard",
        metadata=setting(
            "--default-slo-class",
            parse=stripped,
            metavar="NAME",
            help="class of requests whose adapter manifest and tenant name none (default: "
            "{default})",
        ),
    )
    tenant_slo_classes: str | None = field(
        default=None,
        metadata=setting(
            "--tenant-slo-classes",
            parse=parse_tenant_classes,
            metavar="TENANT=CLASS,...",
            help="the class of each named tenant's requests when their adapter's manifest "
            "sets no slo_class (default: none)",
        ),
    )
    structured_outputs_whitespace: str = field(
        default="compact",
        metadata=setting(
            "--structured-outputs-whitespace",
            choices=WHITESPACE_MODES,
            metavar="{" + ",".join(WHITESPACE_MODES) + "}",
            help="whitespace between the tokens of JSON structured outputs (json_schema, "
            "json_object, guided_json, tool calls): compact (one line, ', ' and ': ' "
            "separators, as vLLM's disable_any_whitespace: a model that favours whitespace "
            "still writes parseable JSON of the compact length), bounded (any layout, at most "
            "16 characters per gap: pretty JSON stays legal; a request gets it with "
            "structured_outputs.disable_any_whitespace false) or any (unbounded, xgrammar's and "
            "vLLM's default) (default: {default})",
        ),
    )
    skip_tokenizer_init: bool = field(
        default=False,
        metadata=setting(
            "--skip-tokenizer-init",
            help="no tokenizer: prompts and outputs are token ids only (default: {default})",
        ),
    )
    num_threads: int | None = field(
        default=None,
        metadata=setting(
            "--num-threads",
            ge=1,
            help="CPU intra-op threads (default: torch's; serve on CPU: one fewer, for HTTP)",
        ),
    )
    speculative_config: str | None = field(  # a JSON object: loraplex.config.speculative
        default=None,
        metadata=setting(
            "--speculative-config",
            "-sc",
            parse=speculative_config_text,
            metavar="JSON",
            help="speculative decoding, vLLM's JSON object: method ngram (prompt lookup), "
            "suffix (the request's context and past outputs per tenant and adapter) or "
            "draft_model (a small model sharing the tokenizer), num_speculative_tokens, ... "
            'e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' (see '
            "docs/speculative.md)",
        ),
    )
