"""Typed engine and server configuration, passed explicitly (no module-level singletons).

Each field that ``loraplex serve`` can set declares it once in its metadata
(:func:`loraplex.settings.setting`): flags, value parser, bounds and help. The serve command's
flags, config-file keys and constructor call come from there (``loraplex.server.args``), and
``validate()`` checks the same declared bounds plus the cross-field rules written below.

The config objects are frozen (``dataclasses.replace`` derives a changed one). Every environment
variable of loraplex's own is declared here (``ENVIRONMENT``) and read through ``env_value``;
an adapter's ``warm`` syntax is ``loraplex.warm``'s.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from decimal import Decimal

from loraplex.settings import FieldError, check_fields, human_int, seconds, setting, stripped
from loraplex.warm import WarmPolicy, WarmSchedule, parse_warm

ADAPTER_EVICTION_POLICIES = ("hybrid", "hybrid-forecast", "lru", "lfu", "fifo")
"""Names of ``loraplex.cache.policy.POLICIES`` (checked by a test; config imports nothing)."""
DTYPES = ("auto", "float32", "bfloat16", "float16")
"""``--dtype``: ``auto`` (chosen from the model and the device) or the name of a torch dtype
(the engine maps each to ``getattr(torch, name)``; config stays torch-free)."""
DTYPE_ALIASES = {"float": "float32", "half": "float16"}  # vLLM's spellings
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
LOG_FORMATS = ("text", "json")
TOOL_CALL_PARSERS = ("hermes", "llama3_json")
"""Names of ``loraplex.server.tools.PARSERS`` (checked by a test; config imports nothing)."""
DEFAULT_MAX_CPU_LORAS = 32  # host copies when --max-cpu-loras is not given (and max_loras less)

SCHEDULING_POLICIES = ("fcfs", "priority", "fair")
"""Names of ``loraplex.engine.scheduling.POLICIES`` (checked by a test; config imports nothing of the engine)."""
_CLASS_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")

# --------------------------------------------------------------------------- environment
# Every environment variable of loraplex's own. One that stands in for a flag is named by that
# setting's ``env=`` (the command reads it, below the flag and the config file); the others
# are not flags, and code reads them through :func:`env_value`, never ``os.environ``.
ENV_API_KEYS = ("LORAPLEX_API_KEY", "VLLM_API_KEY")  # --api-key (the first one set wins)
ENV_ADMIN_API_KEY = "LORAPLEX_ADMIN_API_KEY"  # --admin-api-key
ENV_METRICS_API_KEY = "LORAPLEX_METRICS_API_KEY"  # --metrics-api-key
ENV_REGISTRY_URL = "LORAPLEX_REGISTRY_URL"  # --registry-url; the registry commands' default
ENV_HOME = "LORAPLEX_HOME"  # the registry's SQLite file, the base-model digest memo
ENV_CACHE_DIR = "LORAPLEX_CACHE_DIR"  # the demo model, built CPU kernels
ENV_LORA_CPU_KERNEL = "LORAPLEX_LORA_CPU_KERNEL"  # "0": never the native CPU LoRA kernel
ENV_LAYER_CPU_KERNEL = "LORAPLEX_LAYER_CPU_KERNEL"  # "0": never the C layer ops (norms, attention)
ENV_TP_SHM = "LORAPLEX_TP_SHM"  # "0": one host's tensor-parallel step traffic via gloo, not shm
# vLLM's own switch of /v1/load_lora_adapter and /v1/unload_lora_adapter (KubeAI sets it):
# --allow-runtime-lora-updating
ENV_ALLOW_RUNTIME_LORA_UPDATING = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
ENVIRONMENT = (
    *ENV_API_KEYS,
    ENV_ADMIN_API_KEY,
    ENV_METRICS_API_KEY,
    ENV_REGISTRY_URL,
    ENV_HOME,
    ENV_CACHE_DIR,
    ENV_LORA_CPU_KERNEL,
    ENV_LAYER_CPU_KERNEL,
    ENV_TP_SHM,
    ENV_ALLOW_RUNTIME_LORA_UPDATING,
)
"""The environment variables above (``loraplex route``'s status key is its setting's ``env=``,
in ``loraplex.router.config``)."""


def env_value(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """Environment variable ``name`` (one of :data:`ENVIRONMENT`) without surrounding
    whitespace; None when it is unset or blank. ``environ`` defaults to ``os.environ``."""
    if name not in ENVIRONMENT:
        raise KeyError(f"{name} is not declared in loraplex.config.ENVIRONMENT")
    value = (os.environ if environ is None else environ).get(name, "").strip()
    return value or None


def lora_cpu_kernel_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the native CPU LoRA kernel may be used: ``$LORAPLEX_LORA_CPU_KERNEL=0`` turns
    it off (any other value, or none, leaves it on)."""
    return env_value(ENV_LORA_CPU_KERNEL, environ) != "0"


def layer_cpu_kernel_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the C layer ops may run on CPU (``loraplex.model.layer_ops``):
    ``$LORAPLEX_LAYER_CPU_KERNEL=0`` keeps the torch ops."""
    return env_value(ENV_LAYER_CPU_KERNEL, environ) != "0"


# --------------------------------------------------------------------------- value parsers
# text -> value, or ValueError with a message that does not repeat the flag name

_BYTE_SIZE = re.compile(
    r"\s*((?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)\s*(?:([kmgtp])(i)?)?b?\s*", re.IGNORECASE
)


def parse_byte_size(text: str) -> int:
    """Bytes from '4096', '1e9', '512MiB', '2GiB', '1.5Gi' (powers of 1024) or '1G', '1GB',
    '500M' (powers of 1000); case-insensitive; a trailing 'B' is optional. The one byte-size
    syntax of every flag, config file and workload spec; ``ValueError`` names the problem."""
    m = _BYTE_SIZE.fullmatch(text)
    if m is None:
        raise ValueError(
            f"expected a byte size such as 2GiB, 512MiB, 1G or 1073741824, got {text!r}"
        )
    power = "kmgtp".index(m.group(2).lower()) + 1 if m.group(2) else 0
    return int(Decimal(m.group(1)) * (1024 if m.group(3) else 1000) ** power)


QUANTIZATION_METHODS = ("gptq", "awq", "compressed-tensors", "fp8", "int8", "int4")
"""``--quantization``: checkpoint formats (model/quant/formats.py), then the on-the-fly ones."""


def _dtype_spellings() -> list[str]:
    """Every ``--dtype`` spelling, each alias after the name it stands for."""
    return [s for d in DTYPES for s in (d, *(a for a, t in DTYPE_ALIASES.items() if t == d))]


def parse_dtype(text: str) -> str:
    """One of :data:`DTYPES`, or one of vLLM's :data:`DTYPE_ALIASES` (half, float)."""
    value = text.strip().lower()
    value = DTYPE_ALIASES.get(value, value)
    if value not in DTYPES:
        raise ValueError(f"invalid dtype {text!r} (choose from {', '.join(_dtype_spellings())})")
    return value


def parse_device(text: str) -> str:
    value = text.strip().lower()
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
        raise ValueError(f"invalid device {text!r} (choose from auto, cpu, cuda, cuda:N)")
    return value


def parse_eviction_policy(text: str) -> str:
    value = text.strip().lower()
    if value not in ADAPTER_EVICTION_POLICIES:
        choices = ", ".join(ADAPTER_EVICTION_POLICIES)
        raise ValueError(f"invalid eviction policy {text!r} (choose from {choices})")
    return value


def parse_store_url(text: str) -> str:
    """s3://bucket/prefix, file:///dir or a directory."""
    value = text.strip()
    scheme, sep, rest = value.partition("://")
    if sep and scheme.lower() not in ("s3", "file"):
        raise ValueError(f"unsupported object store {text!r} (use s3://bucket/prefix or a dir)")
    if sep and scheme.lower() == "s3" and not rest.split("/", 1)[0]:
        raise ValueError(f"{text!r} has no bucket (expected s3://bucket/prefix)")
    if not value:
        raise ValueError("must not be empty")
    return value


def parse_scheduling_policy(text: str) -> str:
    value = text.strip().lower()
    if value not in SCHEDULING_POLICIES:
        choices = ", ".join(SCHEDULING_POLICIES)
        raise ValueError(f"invalid scheduling policy {text!r} (choose from {choices})")
    return value


def _pairs(text: str, sep: str, what: str) -> list[tuple[str, str]]:
    """'a=1,b=2' -> [('a', '1'), ('b', '2')]; ValueError naming ``what`` for a bad item."""
    out = []
    for item in text.split(","):
        key, got, value = item.strip().partition(sep)
        if not got or not key.strip() or not value.strip():
            raise ValueError(f"expected {what}, got {item.strip()!r} in {text!r}")
        out.append((key.strip(), value.strip()))
    if len({k for k, _ in out}) != len(out):
        raise ValueError(f"a name appears twice in {text!r}")
    return out


def slo_class_table(text: str) -> tuple[tuple[str, float], ...]:
    """'gold=8,standard=4,batch=1' -> ((name, weight), ...), most important first; weights
    are the classes' shares of served tokens under the fair policy."""
    table = []
    for name, weight in _pairs(text, "=", "NAME=WEIGHT such as gold=8"):
        if not _CLASS_NAME.fullmatch(name):
            raise ValueError(f"invalid class name {name!r} (letters, digits, '_', '.', '-')")
        try:
            w = float(weight)
        except ValueError:
            raise ValueError(f"class {name!r}: weight {weight!r} is not a number") from None
        if not w > 0 or w == float("inf"):
            raise ValueError(f"class {name!r}: weight must be a positive number, got {weight!r}")
        table.append((name, w))
    return tuple(table)


def parse_slo_classes(text: str) -> str:
    slo_class_table(text)
    return text.strip()


def tenant_class_map(text: str) -> dict[str, str]:
    """'acme=gold,sweep=batch' -> {tenant: class name}."""
    return dict(_pairs(text, "=", "TENANT=CLASS such as acme=gold"))


def parse_tenant_classes(text: str) -> str:
    tenant_class_map(text)
    return text.strip()


def rank_budget_map(text: str) -> dict[int, int]:
    """'8:12,64:4' -> {8: 12, 64: 4}: adapters of rank <= 8 hold at most 12 device slots,
    those of rank 9..64 at most 4."""
    out: dict[int, int] = {}
    for rank, slots in _pairs(text, ":", "RANK:SLOTS such as 8:12"):
        if not rank.isdigit() or int(rank) < 1:
            raise ValueError(f"rank {rank!r} is not a positive integer")
        if not slots.isdigit() or int(slots) < 1:
            raise ValueError(f"rank {rank}: slots {slots!r} is not a positive integer")
        out[int(rank)] = int(slots)
    return dict(sorted(out.items()))


def parse_rank_budgets(text: str) -> str:
    rank_budget_map(text)
    return text.strip()


def parse_log_level(text: str) -> str:
    value = text.strip().lower()
    if value not in LOG_LEVELS:
        raise ValueError(f"invalid log level {text!r} (choose from {', '.join(LOG_LEVELS)})")
    return value


def parse_generation_config(text: str) -> str:
    """vLLM's ``--generation-config``: ``auto`` (the model directory's generation_config.json),
    ``vllm`` (none: loraplex's own defaults) or a directory holding a generation_config.json."""
    value = text.strip()
    if not value:
        raise ValueError("expected auto, vllm or a directory")
    return value.lower() if value.lower() in ("auto", "vllm") else value


def parse_json_object(text: str) -> str:
    """A JSON object given as text (kept as text: config objects hold plain values)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON {text!r}: {e.msg}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return text


def parse_json_list(text: str) -> str:
    """A JSON list of strings given as text (vLLM's CORS flags: '["*"]')."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON {text!r}: {e.msg}") from None
    if not isinstance(obj, list) or not all(isinstance(x, str) for x in obj):
        raise ValueError(f"expected a JSON list of strings such as '[\"*\"]', got {text!r}")
    return text


def parse_vllm_env_flag(text: str) -> bool:
    """A vLLM boolean environment variable: on for '1' or 'true' (any case, spaces around),
    off for anything else, as ``vllm.envs`` reads ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``."""
    return text.strip().lower() in ("1", "true")


def parse_endpoint_list(text: str) -> str:
    """vLLM's ``--disable-access-log-for-endpoints``: comma-separated paths ('/health,/metrics'),
    kept as given; each path must start with '/'."""
    paths = endpoint_paths(text)
    if not paths:
        raise ValueError(f"expected comma-separated paths such as /health,/metrics, got {text!r}")
    bad = [p for p in paths if not p.startswith("/")]
    if bad:
        raise ValueError(f"{bad[0]!r} is not a path (paths start with '/')")
    return text.strip()


def endpoint_paths(text: str | None) -> list[str]:
    """The paths of a ``--disable-access-log-for-endpoints`` value (blanks dropped)."""
    return [p.strip() for p in (text or "").split(",") if p.strip()]


def parse_log_format(text: str) -> str:
    value = text.strip().lower()
    if value not in LOG_FORMATS:
        raise ValueError(f"invalid log format {text!r} (choose from {', '.join(LOG_FORMATS)})")
    return value


def _lora_from_mapping(obj: object) -> LoRAModule:
    """{"name": ..., "path": ..., "base_model_name": ...} (vLLM's JSON form) -> LoRAModule."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected an object with name and path, got {obj!r}")
    allowed = ("name", "path", "base_model_name", "warm")
    unknown = [k for k in obj if k not in allowed]
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r} in {obj!r} (allowed: {', '.join(allowed)})")
    name, path, base = obj.get("name"), obj.get("path"), obj.get("base_model_name")
    for field_name, value in (("name", name), ("path", path)):
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{field_name!r} must be a non-empty string in {obj!r}")
    if base is not None and (not isinstance(base, str) or not base.strip()):
        raise ValueError(f"'base_model_name' must be a non-empty string in {obj!r}")
    warm = parse_warm(obj.get("warm", "on-demand"))
    assert isinstance(name, str) and isinstance(path, str)
    return LoRAModule(name=name.strip(), path=path.strip(), base_model_name=base, warm=warm)


def parse_lora_module(text: str) -> LoRAModule:
    """'name=path' or vLLM's JSON '{"name": ..., "path": ..., "base_model_name": ...}'."""
    spec = text.strip()
    if spec.startswith("{"):
        try:
            obj = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid JSON {text!r}: {e.msg}") from None
        return _lora_from_mapping(obj)
    name, sep, path = spec.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(
            f"expected NAME=PATH or JSON like "
            f'{{"name": "sql", "path": "/adapters/sql"}}, got {text!r}'
        )
    return LoRAModule(name=name.strip(), path=path.strip())


def lora_modules_from_value(value: object) -> list[LoRAModule]:
    """A config-file value: list of 'name=path' strings or dicts, or a mapping name -> path."""
    if isinstance(value, str):
        return [parse_lora_module(value)]
    if isinstance(value, list):
        out = []
        for item in value:
            if isinstance(item, str):
                out.append(parse_lora_module(item))
            elif isinstance(item, dict):
                out.append(_lora_from_mapping(item))
            else:
                raise ValueError(f"each item must be 'name=path' or a mapping, got {item!r}")
        return out
    if isinstance(value, dict):
        if isinstance(value.get("name"), str) and isinstance(value.get("path"), str):
            return [_lora_from_mapping(value)]  # one module written as a single mapping
        out = []
        for name, spec in value.items():
            if not isinstance(name, str) or not name.strip():
                raise ValueError(f"adapter names must be non-empty strings, got {name!r}")
            if isinstance(spec, str):
                out.append(_lora_from_mapping({"name": name, "path": spec}))
            elif isinstance(spec, dict):
                if spec.get("name", name) != name:
                    raise ValueError(f"adapter {name!r} has a different name {spec['name']!r}")
                out.append(_lora_from_mapping({**spec, "name": name}))
            else:
                raise ValueError(f"adapter {name!r}: expected a path, got {spec!r}")
        return out
    raise ValueError(f"expected a list or a mapping of name to path, got {value!r}")


# --------------------------------------------------------------------------- config objects


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet (torch.distributed's TCP store) and which ranks this node runs."""

    size: int
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port, picked by rank 0 (one node only)
    first_rank: int = 0  # this node's first rank (0 on the node that serves)
    local_ranks: int = 0  # ranks on this node (0: all of ``size``)

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"

    def with_port(self) -> Rendezvous:
        """A copy with a concrete port (a free one on loopback when none was given)."""
        if self.master_port:
            return self
        with socket.socket() as s:
            s.bind((self.master_addr, 0))
            return replace(self, master_port=s.getsockname()[1])


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine; names follow vLLM's so users recognise them. Frozen: derive a
    changed one with ``dataclasses.replace``."""

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
            metavar="{" + ",".join(_dtype_spellings()) + "}",
            help="weight/activation dtype (default: {default})",
        ),
    )
    quantization: str | None = field(
        default=None,
        metadata=setting(
            "--quantization",
            "-q",
            choices=QUANTIZATION_METHODS,
            help="the base's weight quantization: a checkpoint format to require (gptq, awq, "
            "compressed-tensors, fp8; default: read from config.json's quantization_config) or "
            "int8 (per channel) / int4 (grouped) to quantize a float checkpoint at load",
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
            choices=("bounded", "any", "compact"),
            metavar="{compact,bounded,any}",
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

    def __post_init__(self) -> None:
        """The one default that depends on another field: ``max_cpu_loras`` not given is
        ``max(max_loras, DEFAULT_MAX_CPU_LORAS)`` (a value given below ``max_loras`` is
        :meth:`validate`'s error)."""
        if self.max_cpu_loras is None and isinstance(self.max_loras, int):
            object.__setattr__(self, "max_cpu_loras", max(self.max_loras, DEFAULT_MAX_CPU_LORAS))

    @property
    def generation_overrides(self) -> dict[str, object]:
        """``override_generation_config`` as a mapping (empty when not set)."""
        if self.override_generation_config is None:
            return {}
        value = json.loads(self.override_generation_config)
        return dict(value) if isinstance(value, dict) else {}

    def slo_class_weights(self) -> tuple[tuple[str, float], ...]:
        """``slo_classes`` as ((name, weight), ...), most important first."""
        return slo_class_table(self.slo_classes)

    def tenant_classes(self) -> dict[str, str]:
        """``tenant_slo_classes`` as {tenant: class name} (empty when not set)."""
        return tenant_class_map(self.tenant_slo_classes) if self.tenant_slo_classes else {}

    def rank_slot_budgets(self) -> dict[int, int]:
        """``lora_rank_slot_budgets`` as {bucket's largest rank: slots} (empty when not set)."""
        return rank_budget_map(self.lora_rank_slot_budgets) if self.lora_rank_slot_budgets else {}

    def lora_slot_count(self, bytes_per_slot: int, available_bytes: int) -> int:
        """Device slots the bank gets: ``max_loras``, fewer when ``max_lora_device_fraction``
        of ``available_bytes`` (the memory left after the weights) cannot hold that many slots
        of ``bytes_per_slot`` (a slot is sized for ``max_lora_rank``). Raises ValueError naming
        the flag when not even one fits."""
        if self.max_lora_device_fraction is None:
            return self.max_loras
        cap = int(available_bytes * self.max_lora_device_fraction)
        fits = cap // bytes_per_slot
        if fits < 1:
            raise ValueError(
                f"--max-lora-device-fraction {self.max_lora_device_fraction:g} of "
                f"{available_bytes} bytes ({cap}) cannot hold one adapter slot of rank "
                f"{self.max_lora_rank} ({bytes_per_slot} bytes): raise it or lower "
                "--max-lora-rank"
            )
        return min(self.max_loras, fits)

    def device_kv_budget(self, free_bytes: int, total_bytes: int) -> int:
        """KV-cache bytes on a CUDA device, by vLLM's ``--gpu-memory-utilization``: this server
        may use ``total x utilization`` in all, and what the device already holds (the weights
        just loaded, other processes) comes out of it; activations use the rest of the device.
        Raises ValueError naming the flag when nothing is left."""
        used = total_bytes - free_bytes
        budget = int(total_bytes * self.gpu_memory_utilization) - used
        if budget <= 0:
            gib = 1 << 30
            raise ValueError(
                f"--gpu-memory-utilization {self.gpu_memory_utilization:g} leaves no memory for "
                f"the KV cache: {used / gib:.1f} GiB of the device's {total_bytes / gib:.1f} GiB "
                "are in use already (raise it, or set --kv-cache-memory)"
            )
        return budget

    def rendezvous(self) -> Rendezvous:
        """Where this node's tensor-parallel ranks meet the others, and which are its own."""
        local = self.tensor_parallel_size // self.nnodes
        return Rendezvous(
            self.tensor_parallel_size,
            self.master_addr,
            self.master_port,
            self.node_rank * local,
            local,
        )

    def validate(self) -> None:
        """Raise FieldError (a ValueError) naming the first invalid field."""
        check_fields(self)  # the declared syntax, choices and bounds of every field
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise FieldError(
                self,
                "max_cpu_loras",
                lambda n: (
                    f"must be >= {n('max_loras')} ({self.max_loras}), got {self.max_cpu_loras}"
                ),
            )
        names = [n for n, _ in self.slo_class_weights()]
        if self.default_slo_class not in names:
            raise FieldError(
                self,
                "default_slo_class",
                lambda n: (
                    f"{self.default_slo_class!r} is not one of {n('slo_classes')} "
                    f"({', '.join(names)})"
                ),
            )
        unknown = sorted(set(self.tenant_classes().values()) - set(names))
        if unknown:
            raise FieldError(
                self,
                "tenant_slo_classes",
                lambda n: (
                    f"class {unknown[0]!r} is not one of {n('slo_classes')} ({', '.join(names)})"
                ),
            )
        budgets = self.rank_slot_budgets()
        if budgets and max(budgets) < self.max_lora_rank:
            raise FieldError(
                self,
                "lora_rank_slot_budgets",
                lambda n: (
                    f"the largest bucket (rank {max(budgets)}) must be >= "
                    f"{n('max_lora_rank')} ({self.max_lora_rank}) so every adapter has a bucket"
                ),
            )
        over = next((r for r, k in budgets.items() if k > self.max_loras), None)
        if over is not None:
            raise FieldError(
                self,
                "lora_rank_slot_budgets",
                lambda n: (
                    f"rank {over}: {budgets[over]} slots exceed {n('max_loras')} ({self.max_loras})"
                ),
            )
        if self.disk_cache_dir is not None and self.disk_cache_bytes is None:
            raise FieldError(
                self,
                "disk_cache_dir",
                lambda n: f"needs {n('disk_cache_bytes')} (the disk tier's byte budget)",
            )
        if self.disk_cache_bytes is not None and self.disk_cache_dir is None:
            raise FieldError(self, "disk_cache_bytes", lambda n: f"needs {n('disk_cache_dir')}")
        tp = self.tensor_parallel_size
        if tp % self.nnodes:
            raise FieldError(
                self,
                "tensor_parallel_size",
                lambda n: f"{tp} ranks do not split evenly over {n('nnodes')} ({self.nnodes})",
            )
        if self.node_rank >= self.nnodes:
            raise FieldError(
                self, "node_rank", lambda n: f"must be < {n('nnodes')} ({self.nnodes})"
            )
        if self.nnodes > 1 and not self.master_port:
            raise FieldError(self, "master_port", lambda n: f"must be set with {n('nnodes')} > 1")
        if tp > 1 and self.device.startswith("cuda"):
            raise FieldError(
                self,
                "tensor_parallel_size",
                lambda n: f"{tp} runs on CPU (gloo) in this version; on CUDA use 1",
            )


@dataclass(frozen=True)
class LoRAModule:
    """An adapter served under ``name`` from ``path`` (vLLM's ``--lora-modules``)."""

    name: str
    path: str  # a local PEFT directory, or an object-store URI (s3://bucket/prefix/name)
    base_model_name: str | None = None
    warm: WarmPolicy | WarmSchedule = "on-demand"
    """device-preferred | host | on-demand (start-up pre-warming), or a window schedule (the
    prewarm scheduler warms it ahead of each window; on-demand outside them)."""


@dataclass(frozen=True)
class ServerConfig:
    """Settings of ``loraplex serve``: the engine's plus the HTTP layer's (vLLM flag names).
    Frozen: derive a changed one with ``dataclasses.replace``."""

    engine: EngineConfig  # its settings are serve's too
    host: str = field(
        default="127.0.0.1", metadata=setting("--host", help="address to bind (default: {default})")
    )
    port: int = field(
        default=8000,
        metadata=setting("--port", ge=0, le=65535, help="port to bind (default: {default})"),
    )
    served_model_name: list[str] = field(  # empty: the model path
        default_factory=list,
        metadata=setting(
            "--served-model-name",
            metavar="NAME",
            help="names the base model answers to; the first is reported (default: MODEL_DIR "
            "as given)",
        ),
    )
    lora_modules: list[LoRAModule] = field(
        default_factory=list,
        metadata=setting(
            "--lora-modules",
            parse=parse_lora_module,
            coerce=lora_modules_from_value,
            metavar="SPEC",
            help="adapters to serve at start-up: NAME=PATH or JSON "
            '\'{"name": N, "path": P, "base_model_name": B}\'; needs --enable-lora',
        ),
    )
    api_keys: list[str] = field(  # inference keys; empty: no auth
        default_factory=list,
        metadata=setting(
            "--api-key",
            env=ENV_API_KEYS,
            metavar="KEY",
            help="inference API key(s); repeat or list several (default: {env}; none: no auth)",
        ),
    )
    admin_api_key: str | None = field(  # admin routes are off unless set
        default=None,
        metadata=setting(
            "--admin-api-key",
            env=(ENV_ADMIN_API_KEY,),
            metavar="KEY",
            help="key for the admin routes (default: {env}; none: admin routes off)",
        ),
    )
    metrics_api_key: str | None = field(  # a scrape key that may read /metrics only
        default=None,
        metadata=setting(
            "--metrics-api-key",
            env=(ENV_METRICS_API_KEY,),
            metavar="KEY",
            help="key that may read /metrics (and nothing else); when set, /metrics needs it "
            "or an operator key (default: {env})",
        ),
    )
    allowed_lora_roots: list[str] = field(
        default_factory=list,
        metadata=setting(
            "--allowed-lora-roots",
            metavar="DIR",
            help="directories that runtime-loaded adapters must lie under",
        ),
    )
    # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: /v1/load_lora_adapter and /v1/unload_lora_adapter
    # without an admin key while the server has no key at all (an admin key, once set, is
    # always required; inference keys never load)
    allow_runtime_lora_updating: bool = field(
        default=False,
        metadata=setting(
            "--allow-runtime-lora-updating",
            parse=parse_vllm_env_flag,
            env=(ENV_ALLOW_RUNTIME_LORA_UPDATING,),
            help="vLLM's runtime load/unload routes on a server without keys, as vLLM "
            "(default: {env} = 1 or true; with --admin-api-key they need that key anyway)",
        ),
    )
    max_waiting: int = field(  # waiting sequences above which new calls get 503 + Retry-After
        default=0,  # vLLM queues every request: no cap unless asked for
        metadata=setting(
            "--max-waiting",
            "--max-num-queued-reqs",
            ge=0,
            help="waiting sequences (prompts x n of every admitted call) before 503 + "
            "Retry-After; 0: no limit, queue like vLLM (default: {default})",
        ),
    )
    retry_after_seconds: int = field(default=1, metadata=setting(ge=0))
    # how long a call over its adapter's max_concurrent_requests waits for a slot before 429
    adapter_queue_timeout_s: float = field(default=10.0, metadata=setting(ge=0))
    # -- bounds on what one request may cost (checked before it costs memory) ----------------
    max_request_bytes: int = field(
        default=8 << 20,
        metadata=setting(
            "--max-request-bytes",
            parse=parse_byte_size,
            ge=1,
            metavar="BYTES",
            help="largest request body, checked while reading it and before authentication "
            "work; larger bodies get 413 (default: {default})",
        ),
    )
    max_prompts_per_request: int = field(
        default=1024,
        metadata=setting(
            "--max-prompts-per-request",
            ge=1,
            help="prompts in one /v1/completions call; more is a 400 (default: {default})",
        ),
    )
    stream_stall_timeout_s: float = field(
        default=30.0,
        metadata=setting(
            "--stream-stall-timeout",
            parse=seconds,
            ge=0,
            metavar="SECONDS",
            help="abort a request whose reader has taken nothing for this long while the "
            "engine kept producing (frees its KV blocks; 0: no time bound; default: {default})",
        ),
    )
    stream_max_unread_tokens: int = field(
        default=4096,
        metadata=setting(
            "--stream-max-unread-tokens",
            parse=human_int,
            ge=0,
            help="abort a request once this many of its tokens were produced and not read "
            "(0: no count bound; default: {default})",
        ),
    )
    prepare_workers: int = field(
        default=4,
        metadata=setting(
            "--prepare-workers",
            ge=1,
            help="threads validating and tokenizing requests whose adapter is in memory "
            "(default: {default})",
        ),
    )
    load_workers: int = field(
        default=4,
        metadata=setting(
            "--load-workers",
            ge=1,
            help="threads preparing requests whose adapter must be loaded first, so cold "
            "loads never delay warm requests (default: {default})",
        ),
    )
    prepare_timeout_s: float = field(
        default=120.0,
        metadata=setting(
            "--prepare-timeout",
            parse=seconds,
            gt=0,
            metavar="SECONDS",
            help="seconds a request may wait for its preparation (adapter load included) "
            "before a 503 + Retry-After (default: {default})",
        ),
    )
    log_level: str = field(
        default="info",
        metadata=setting(
            "--uvicorn-log-level",
            "--log-level",
            parse=parse_log_level,
            choices=LOG_LEVELS,
            metavar="LEVEL",
            help="server log level: {choices} (default: {default})",
        ),
    )
    # adapter registry: None = $LORAPLEX_REGISTRY_URL, else an in-memory one seeded from
    # --lora-modules; "sqlite:///path.db" or "postgresql+psycopg://..." for a shared one
    registry_url: str | None = field(
        default=None,
        metadata=setting(
            "--registry-url",
            parse=stripped,
            env=(ENV_REGISTRY_URL,),
            metavar="URL",
            help="adapter registry: sqlite:///FILE or postgresql+psycopg://... (default: "
            "{env}, else in memory, holding the --lora-modules adapters)",
        ),
    )
    registry_poll_s: float = field(
        default=1.0,
        metadata=setting(
            "--registry-poll-interval",
            parse=seconds,
            gt=0,
            metavar="SECONDS",
            help="seconds between checks for registry changes made elsewhere (default: {default})",
        ),
    )
    require_signatures: bool = field(
        default=False,
        metadata=setting(
            "--require-signatures",
            help="refuse adapters without a valid ed25519 manifest signature (default: {default})",
        ),
    )
    trusted_keys: list[str] = field(
        default_factory=list,
        metadata=setting(
            "--trusted-key",
            metavar="FILE",
            help="ed25519 public key file(s) (PEM) whose signatures are accepted",
        ),
    )
    allowed_store_prefixes: list[str] = field(
        default_factory=list,
        metadata=setting(
            "--allowed-store-prefixes",
            metavar="URI",
            help="object-store prefixes that registered adapter sources must lie under "
            "(e.g. s3://bucket/adapters/)",
        ),
    )
    swap_eviction_delay_s: float = field(
        default=30.0,
        metadata=setting(
            "--swap-eviction-delay",
            parse=seconds,
            ge=0,
            metavar="SECONDS",
            help="seconds after a promote or rollback before the replaced revision's cached "
            "copies are evicted (default: {default})",
        ),
    )

    # -- chat and tools (vLLM's OpenAI frontend flags) ----------------------------------------
    chat_template: str | None = field(  # the template text (the command line reads a file)
        default=None,
        metadata=setting(
            "--chat-template",
            metavar="FILE_OR_TEMPLATE",
            help="Jinja chat template: a file, or the template itself (default: the tokenizer's)",
        ),
    )
    enable_auto_tool_choice: bool = field(
        default=False,
        metadata=setting(
            "--enable-auto-tool-choice",
            help='let the model choose to call tools (tool_choice "auto"; needs '
            "--tool-call-parser; default: {default})",
        ),
    )
    tool_call_parser: str | None = field(
        default=None,
        metadata=setting(
            "--tool-call-parser",
            choices=TOOL_CALL_PARSERS,
            metavar="NAME",
            help="how tool calls are read out of generated text: {choices}",
        ),
    )
    hf_token: str | None = field(  # for hub ids; default: $HF_TOKEN or the stored login
        default=None,
        repr=False,
        metadata=setting(
            "--hf-token",
            metavar="TOKEN",
            help="hub token for hub ids (default: $HF_TOKEN, else huggingface-cli login's)",
        ),
    )
    # -- logging -------------------------------------------------------------------------------
    disable_log_requests: bool = field(
        default=False,
        metadata=setting(
            "--disable-log-requests",
            help="no log line per finished request (default: {default})",
        ),
    )
    max_log_len: int | None = field(
        default=None,
        metadata=setting(
            "--max-log-len",
            ge=0,
            help="characters of the prompt shown in a request's log line at debug level "
            "(default: all)",
        ),
    )
    disable_log_stats: bool = field(
        default=False,
        metadata=setting(
            "--disable-log-stats",
            help="no periodic stats line (throughput, queue, KV, adapter hits; default: {default})",
        ),
    )
    log_stats_interval_s: float = field(
        default=10.0,
        metadata=setting(
            "--log-stats-interval",
            parse=seconds,
            gt=0,
            metavar="SECONDS",
            help="seconds between stats lines (default: {default})",
        ),
    )
    log_format: str = field(
        default="text",
        metadata=setting(
            "--log-format",
            parse=parse_log_format,
            choices=LOG_FORMATS,
            metavar="{text,json}",
            help="log lines as text, or one JSON object per line for log shippers "
            "(default: {default})",
        ),
    )
    disable_uvicorn_access_log: bool = field(
        default=False,
        metadata=setting(
            "--disable-uvicorn-access-log", help="no HTTP access log (default: {default})"
        ),
    )
    disable_access_log_for_endpoints: str | None = field(  # vLLM's comma-separated form
        default=None,
        metadata=setting(
            "--disable-access-log-for-endpoints",
            parse=parse_endpoint_list,
            metavar="PATHS",
            help="no access-log line for these paths, comma-separated, e.g. "
            "/health,/metrics,/ping (query strings ignored)",
        ),
    )
    shutdown_timeout_s: float | None = field(  # None: wait for every open request
        default=None,
        metadata=setting(
            "--shutdown-timeout",
            parse=seconds,
            ge=0,
            metavar="SECONDS",
            help="on SIGTERM, seconds in-flight requests may take to finish before they are "
            "cancelled; 0: at once (default: wait for them)",
        ),
    )
    # -- HTTP (uvicorn / FastAPI) ----------------------------------------------------------------
    root_path: str | None = field(
        default=None,
        metadata=setting(
            "--root-path", help="path prefix of the app behind a path-based proxy (ASGI root_path)"
        ),
    )
    ssl_keyfile: str | None = field(
        default=None, metadata=setting("--ssl-keyfile", metavar="FILE", help="TLS key file")
    )
    ssl_certfile: str | None = field(
        default=None, metadata=setting("--ssl-certfile", metavar="FILE", help="TLS certificate")
    )
    ssl_ca_certs: str | None = field(
        default=None,
        metadata=setting("--ssl-ca-certs", metavar="FILE", help="CA certificates (client certs)"),
    )
    enable_ssl_refresh: bool = field(
        default=False,
        metadata=setting(
            "--enable-ssl-refresh",
            help="reload the certificate, key and CA files when they change, without a "
            "restart (default: {default})",
        ),
    )
    allowed_origins: str | None = field(  # JSON list; None: no CORS headers
        default=None,
        metadata=setting(
            "--allowed-origins",
            parse=parse_json_list,
            metavar="JSON",
            help="CORS origins as a JSON list, e.g. '[\"*\"]' (default: no CORS headers)",
        ),
    )
    allowed_methods: str = field(
        default='["*"]',
        metadata=setting(
            "--allowed-methods", parse=parse_json_list, metavar="JSON", help="CORS methods"
        ),
    )
    allowed_headers: str = field(
        default='["*"]',
        metadata=setting(
            "--allowed-headers", parse=parse_json_list, metavar="JSON", help="CORS headers"
        ),
    )
    allow_credentials: bool = field(
        default=False,
        metadata=setting("--allow-credentials", help="CORS credentials (default: {default})"),
    )
    disable_fastapi_docs: bool = field(
        default=False,
        metadata=setting(
            "--disable-fastapi-docs",
            help="no /docs, /redoc and /openapi.json (default: {default})",
        ),
    )

    @property
    def model_names(self) -> list[str]:
        """Names the base model answers to; the first is reported in responses."""
        return self.served_model_name or [self.engine.model]

    def validate(self) -> None:
        """Raise FieldError (a ValueError) naming the first invalid field."""
        self.engine.validate()
        check_fields(self)
        if self.lora_modules and not self.engine.enable_lora:
            raise FieldError(
                self,
                "lora_modules",
                lambda n: f"LoRA is off: add {n('enable_lora')} to serve LoRA modules",
            )
        seen = dict.fromkeys(self.model_names, "served model name")
        for m in self.lora_modules:
            if not m.name or not m.path:
                raise FieldError(self, "lora_modules", f"{m!r}: name and path are required")
            if m.name in seen:
                raise FieldError(
                    self,
                    "lora_modules",
                    f"name {m.name!r} is used twice (already a {seen[m.name]})",
                )
            seen[m.name] = "LoRA module name"
        if self.admin_api_key is not None and self.admin_api_key in self.api_keys:
            raise FieldError(
                self, "admin_api_key", "the admin key must differ from every inference API key"
            )
        if self.metrics_api_key is not None and (
            self.metrics_api_key in self.api_keys or self.metrics_api_key == self.admin_api_key
        ):
            raise FieldError(
                self,
                "metrics_api_key",
                "the metrics key must differ from the inference and admin keys",
            )
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise FieldError(
                self,
                "enable_auto_tool_choice",
                lambda n: f"needs {n('tool_call_parser')} (one of {', '.join(TOOL_CALL_PARSERS)})",
            )
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise FieldError(
                self,
                "ssl_keyfile" if self.ssl_keyfile is None else "ssl_certfile",
                lambda n: f"{n('ssl_keyfile')} and {n('ssl_certfile')} go together",
            )
        if self.enable_ssl_refresh and self.ssl_certfile is None:
            raise FieldError(
                self,
                "enable_ssl_refresh",
                lambda n: f"needs {n('ssl_certfile')} and {n('ssl_keyfile')}",
            )
        if self.require_signatures and not self.trusted_keys:
            raise FieldError(
                self, "require_signatures", lambda n: f"needs at least one {n('trusted_keys')}"
            )
        for prefix in self.allowed_store_prefixes:
            if "://" not in prefix:
                raise FieldError(
                    self,
                    "allowed_store_prefixes",
                    f"{prefix!r} is not a URI like s3://bucket/path/",
                )
