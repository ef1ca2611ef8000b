"""The value lists of the settings (each list once) and the text parsers of their values.

Each parser takes the text of one flag value (or a string from a config file) and returns the
value, or raises ValueError with a message that does not repeat the flag name. A list that names
implementations in a higher layer (eviction and scheduling policies, tool-call parsers) is
checked against their registry by a test: config imports nothing of those layers.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal

# --------------------------------------------------------------------------- value lists

DTYPES = ("auto", "float32", "bfloat16", "float16")
"""``--dtype``: ``auto`` (chosen from the model and the device) or the name of a torch dtype
(the engine maps each to ``getattr(torch, name)``; config stays torch-free)."""
DTYPE_ALIASES = {"float": "float32", "half": "float16"}  # vLLM's spellings
QUANTIZED_CHECKPOINT_FORMATS = ("gptq", "awq", "compressed-tensors", "fp8")
"""Quantized checkpoint formats (``quantization_config.quant_method``); each has its reader in
``loraplex.model.quant.formats``."""
QUANTIZE_AT_LOAD = ("int8", "int4")
"""``--quantization`` values that quantize a float checkpoint at load."""
QUANTIZATION_METHODS = (*QUANTIZED_CHECKPOINT_FORMATS, *QUANTIZE_AT_LOAD)
"""``--quantization``: the checkpoint formats, then the on-the-fly ones."""
ADAPTER_EVICTION_POLICIES = ("hybrid", "hybrid-forecast", "lru", "lfu", "fifo")
"""Names of ``loraplex.cache.policy.POLICIES`` (checked by a test; config imports nothing)."""
SCHEDULING_POLICIES = ("fcfs", "priority", "fair")
"""Names of ``loraplex.engine.scheduling.POLICIES`` (checked by a test; config imports nothing
of the engine)."""
WHITESPACE_MODES = ("compact", "bounded", "any")
"""``--structured-outputs-whitespace``: how JSON grammars treat whitespace between tokens
(``loraplex.engine.structured``)."""
TOOL_CALL_PARSERS = ("hermes", "llama3_json")
"""Names of ``loraplex.server.tools.PARSERS`` (checked by a test; config imports nothing)."""
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
LOG_FORMATS = ("text", "json")

_CLASS_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")

# --------------------------------------------------------------------------- value parsers

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


def dtype_spellings() -> list[str]:
    """Every ``--dtype`` spelling, each alias after the name it stands for."""
    return [s for d in DTYPES for s in (d, *(a for a, t in DTYPE_ALIASES.items() if t == d))]


def parse_dtype(text: str) -> str:
    """One of :data:`DTYPES`, or one of vLLM's :data:`DTYPE_ALIASES` (half, float)."""
    value = text.strip().lower()
    value = DTYPE_ALIASES.get(value, value)
    if value not in DTYPES:
        raise ValueError(f"invalid dtype {text!r} (choose from {', '.join(dtype_spellings())})")
    return value


def parse_device(text: str) -> str:
    value = text.strip().lower()
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
        raise ValueError(f"invalid device {text!r} (choose from auto, cpu, cuda, cuda:N)")
    return value


def _one_of(text: str, names: tuple[str, ...], what: str) -> str:
    """``text`` stripped and lower-cased when it is one of ``names``, else a ValueError that
    names ``what`` and the choices."""
    value = text.strip().lower()
    if value not in names:
        raise ValueError(f"invalid {what} {text!r} (choose from {', '.join(names)})")
    return value


def parse_eviction_policy(text: str) -> str:
    return _one_of(text, ADAPTER_EVICTION_POLICIES, "eviction policy")


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
    return _one_of(text, SCHEDULING_POLICIES, "scheduling policy")


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
    return _one_of(text, LOG_LEVELS, "log level")


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
    return _one_of(text, LOG_FORMATS, "log format")
