"""Flags and config file of ``loraplex serve MODEL_DIR`` (vLLM's flag names, so a vLLM user
only changes the command name).

Precedence, per setting: explicit command-line flag > ``--config`` file > environment (API keys
only) > built-in default. Built-in defaults are read from the ``EngineConfig``/``ServerConfig``
dataclass defaults, except ``enable_lora``, which is off unless ``--enable-lora`` (as in vLLM).

Every semantic problem raises ``ServeConfigError`` with one message naming the flag or config
key; syntax errors on the command line are argparse's (exit code 2).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, fields
from decimal import Decimal
from pathlib import Path
from typing import Any

from loraplex.config import (
    ADAPTER_EVICTION_POLICIES,
    WARM_POLICIES,
    EngineConfig,
    LoRAModule,
    ServerConfig,
    parse_byte_size,
)

__all__ = [
    "ServeConfigError",
    "add_serve_arguments",
    "config_from_args",
    "parse_byte_size",
    "parse_serve_args",
]

ENV_API_KEYS = ("LORAPLEX_API_KEY", "VLLM_API_KEY")  # first one set wins
ENV_ADMIN_API_KEY = "LORAPLEX_ADMIN_API_KEY"
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
CONFIG_SUFFIXES = (".yaml", ".yml", ".toml")


class ServeConfigError(ValueError):
    """A problem with ``loraplex serve``'s flags or config file; the message names the flag/key."""


# --------------------------------------------------------------------------- value parsers
# Each takes the text of one flag value (or a string from the config file) and returns the
# typed value, or raises ValueError with a message that does not repeat the flag name.


def _int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None


def _nonempty(text: str) -> str:
    if not text.strip():
        raise ValueError("must not be empty")
    return text


def _human_int(text: str) -> int:
    """vLLM's readable integers: '2048', '32k' (32000), '32K' (32768), '1.5m' (1500000)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtKMGT]?)\s*", text)
    if m is None:
        raise ValueError(f"expected an integer such as 4096, 32k or 32K, got {text!r}")
    num, unit = Decimal(m.group(1)), m.group(2)
    mult = 1
    if unit:
        power = "kmgt".index(unit.lower()) + 1
        mult = (1024 if unit.isupper() else 1000) ** power
    value = num * mult
    if value != value.to_integral_value():
        raise ValueError(f"{text!r} is not a whole number")
    return int(value)


def _seconds(text: str) -> float:
    """A non-negative number of seconds: '0', '2.5', '30s'."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*s?\s*", text)
    if m is None:
        raise ValueError(f"expected a number of seconds such as 5 or 2.5, got {text!r}")
    return float(m.group(1))


def _policy(text: str) -> str:
    value = text.strip().lower()
    if value not in ADAPTER_EVICTION_POLICIES:
        choices = ", ".join(ADAPTER_EVICTION_POLICIES)
        raise ValueError(f"invalid eviction policy {text!r} (choose from {choices})")
    return value


def _store_url(text: str) -> str:
    value = text.strip()
    scheme, sep, rest = value.partition("://")
    if sep and scheme.lower() not in ("s3", "file"):
        raise ValueError(f"unsupported object store {text!r} (use s3://bucket/prefix or a dir)")
    if sep and scheme.lower() == "s3" and not rest.split("/", 1)[0]:
        raise ValueError(f"{text!r} has no bucket (expected s3://bucket/prefix)")
    if not value:
        raise ValueError("must not be empty")
    return value


def _dtype(text: str) -> str:
    """auto/float32/bfloat16/float16, plus vLLM's aliases half -> float16, float -> float32."""
    aliases = {"half": "float16", "float": "float32"}
    value = text.strip().lower()
    value = aliases.get(value, value)
    if value not in DTYPES:
        raise ValueError(
            f"invalid dtype {text!r} (choose from auto, float32, float, bfloat16, float16, half)"
        )
    return value


def _device(text: str) -> str:
    value = text.strip().lower()
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
        raise ValueError(f"invalid device {text!r} (choose from auto, cpu, cuda, cuda:N)")
    return value


def _log_level(text: str) -> str:
    value = text.strip().lower()
    if value not in LOG_LEVELS:
        raise ValueError(f"invalid log level {text!r} (choose from {', '.join(LOG_LEVELS)})")
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
    warm = obj.get("warm", "on-demand")
    if warm not in WARM_POLICIES:
        raise ValueError(f"'warm' must be one of {', '.join(WARM_POLICIES)} in {obj!r}")
    assert isinstance(name, str) and isinstance(path, str)
    return LoRAModule(name=name.strip(), path=path.strip(), base_model_name=base, warm=warm)


def _lora_module(text: str) -> LoRAModule:
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


def _lora_modules_value(value: object) -> list[LoRAModule]:
    """A config-file value: list of 'name=path' strings or dicts, or a mapping name -> path."""
    if isinstance(value, str):
        return [_lora_module(value)]
    if isinstance(value, list):
        out = []
        for item in value:
            if isinstance(item, str):
                out.append(_lora_module(item))
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


# --------------------------------------------------------------------------- option table


@dataclass(frozen=True)
class _Opt:
    """One serve option: its flags (first one is named in errors), dest and value kind."""

    dest: str
    flags: tuple[str, ...]
    kind: str  # str | int | float | bool | strs (list of str) | lora
    help: str
    parse: Callable[[str], Any] = _nonempty
    metavar: str | None = None


def _builtin_defaults() -> dict[str, Any]:
    """Defaults from the EngineConfig/ServerConfig dataclasses (serve: LoRA off by default)."""
    out: dict[str, Any] = {}
    for cls in (EngineConfig, ServerConfig):
        for f in fields(cls):
            if f.default is not MISSING:
                out[f.name] = f.default
            elif f.default_factory is not MISSING:
                out[f.name] = f.default_factory()
    out["enable_lora"] = False  # vLLM semantics: LoRA is off unless --enable-lora
    return out


def _options(d: Mapping[str, Any]) -> tuple[_Opt, ...]:
    """All serve options; ``d`` holds the built-in defaults shown in the help."""

    def on(flag: bool) -> str:
        return "on" if flag else "off"

    return (
        _Opt(
            "model_option",
            ("--model",),
            "str",
            "same as MODEL_DIR (vLLM's older form)",
            metavar="MODEL_DIR",
        ),
        _Opt("host", ("--host",), "str", f"address to bind (default: {d['host']})"),
        _Opt("port", ("--port",), "int", f"port to bind (default: {d['port']})", _int),
        _Opt(
            "enable_lora",
            ("--enable-lora",),
            "bool",
            f"serve LoRA adapters (default: {on(d['enable_lora'])})",
        ),
        _Opt(
            "lora_modules",
            ("--lora-modules",),
            "lora",
            "adapters to serve at start-up: NAME=PATH or JSON "
            '\'{"name": N, "path": P, "base_model_name": B}\'; needs --enable-lora',
            _lora_module,
            "SPEC",
        ),
        _Opt(
            "max_loras",
            ("--max-loras",),
            "int",
            f"adapters resident on the device at once (default: {d['max_loras']})",
            _int,
        ),
        _Opt(
            "max_cpu_loras",
            ("--max-cpu-loras",),
            "int",
            f"adapters kept in host memory (default: {d['max_cpu_loras']}, at least --max-loras)",
            _int,
        ),
        _Opt(
            "max_cpu_lora_bytes",
            ("--max-cpu-lora-bytes",),
            "int",
            "host-memory budget of adapter weights, e.g. 4GiB, 512MiB, 1G (default: no byte "
            "limit, only --max-cpu-loras)",
            parse_byte_size,
            "BYTES",
        ),
        _Opt(
            "adapter_eviction_policy",
            ("--adapter-eviction-policy",),
            "str",
            f"adapter eviction policy (default: {d['adapter_eviction_policy']})",
            _policy,
            "{" + ",".join(ADAPTER_EVICTION_POLICIES) + "}",
        ),
        _Opt(
            "adapter_min_residency_s",
            ("--adapter-min-residency",),
            "float",
            "seconds a newly loaded adapter is protected from eviction "
            f"(default: {d['adapter_min_residency_s']:g})",
            _seconds,
            "SECONDS",
        ),
        _Opt(
            "adapter_load_timeout_s",
            ("--adapter-load-timeout",),
            "float",
            "seconds a request waits for room in host memory before a 503 "
            f"(default: {d['adapter_load_timeout_s']:g})",
            _seconds,
            "SECONDS",
        ),
        _Opt(
            "disk_cache_dir",
            ("--disk-cache-dir",),
            "str",
            "local directory caching object-store adapters (L2; needs --disk-cache-bytes)",
            metavar="DIR",
        ),
        _Opt(
            "disk_cache_bytes",
            ("--disk-cache-bytes",),
            "int",
            "byte budget of --disk-cache-dir, e.g. 20GiB",
            parse_byte_size,
            "BYTES",
        ),
        _Opt(
            "adapter_store_url",
            ("--adapter-store-url",),
            "str",
            "object store of adapters: s3://bucket/prefix (endpoint from $AWS_ENDPOINT_URL, "
            "credentials from the AWS variables), file:///dir or a directory",
            _store_url,
            "URL",
        ),
        _Opt(
            "max_lora_rank",
            ("--max-lora-rank",),
            "int",
            f"largest adapter rank accepted (default: {d['max_lora_rank']})",
            _int,
        ),
        _Opt(
            "dtype",
            ("--dtype",),
            "str",
            f"weight/activation dtype (default: {d['dtype']})",
            _dtype,
            "{auto,float32,float,bfloat16,float16,half}",
        ),
        _Opt(
            "max_model_len",
            ("--max-model-len",),
            "int",
            "context length, e.g. 4096, 32k, 32K (default: from the model config)",
            _human_int,
        ),
        _Opt(
            "max_num_seqs",
            ("--max-num-seqs",),
            "int",
            f"sequences per step (default: {d['max_num_seqs']})",
            _int,
        ),
        _Opt(
            "max_num_batched_tokens",
            ("--max-num-batched-tokens",),
            "int",
            f"tokens per step (default: {d['max_num_batched_tokens']})",
            _human_int,
        ),
        _Opt(
            "served_model_name",
            ("--served-model-name",),
            "strs",
            "names the base model answers to; the first is reported (default: MODEL_DIR as given)",
            metavar="NAME",
        ),
        _Opt(
            "api_keys",
            ("--api-key",),
            "strs",
            f"inference API key(s); repeat or list several (default: ${ENV_API_KEYS[0]} or "
            f"${ENV_API_KEYS[1]}; none: no auth)",
            metavar="KEY",
        ),
        _Opt(
            "enable_prefix_caching",
            ("--enable-prefix-caching",),
            "bool",
            f"reuse KV blocks of shared prefixes (default: {on(d['enable_prefix_caching'])})",
        ),
        _Opt(
            "admin_api_key",
            ("--admin-api-key",),
            "str",
            f"key for the admin routes (default: ${ENV_ADMIN_API_KEY}; none: admin routes off)",
            metavar="KEY",
        ),
        _Opt(
            "allowed_lora_roots",
            ("--allowed-lora-roots",),
            "strs",
            "directories that runtime-loaded adapters must lie under",
            metavar="DIR",
        ),
        _Opt(
            "registry_url",
            ("--registry-url",),
            "str",
            "adapter registry: sqlite:///FILE or postgresql+psycopg://... (default: "
            "$LORAPLEX_REGISTRY_URL, else in memory, holding the --lora-modules adapters)",
            metavar="URL",
        ),
        _Opt(
            "registry_poll_s",
            ("--registry-poll-interval",),
            "float",
            "seconds between checks for registry changes made elsewhere "
            f"(default: {d['registry_poll_s']:g})",
            _seconds,
            "SECONDS",
        ),
        _Opt(
            "require_signatures",
            ("--require-signatures",),
            "bool",
            "refuse adapters without a valid ed25519 manifest signature (default: off)",
        ),
        _Opt(
            "trusted_keys",
            ("--trusted-key",),
            "strs",
            "ed25519 public key file(s) (PEM) whose signatures are accepted",
            metavar="FILE",
        ),
        _Opt(
            "allowed_store_prefixes",
            ("--allowed-store-prefixes",),
            "strs",
            "object-store prefixes that registered adapter sources must lie under "
            "(e.g. s3://bucket/adapters/)",
            metavar="URI",
        ),
        _Opt(
            "swap_eviction_delay_s",
            ("--swap-eviction-delay",),
            "float",
            "seconds after a promote or rollback before the replaced revision's cached copies "
            f"are evicted (default: {d['swap_eviction_delay_s']:g})",
            _seconds,
            "SECONDS",
        ),
        _Opt(
            "max_waiting",
            ("--max-waiting",),
            "int",
            f"queued requests before 503 + Retry-After (default: {d['max_waiting']})",
            _int,
        ),
        _Opt("seed", ("--seed",), "int", f"random seed (default: {d['seed']})", _int),
        _Opt(
            "device",
            ("--device",),
            "str",
            f"auto, cpu, cuda or cuda:N (default: {d['device']})",
            _device,
        ),
        _Opt(
            "kv_cache_memory_bytes",
            ("--kv-cache-memory", "--kv-cache-memory-bytes"),
            "int",
            "KV cache size in bytes: 2GiB, 512MiB (powers of 1024), 1G, 1GB (powers of "
            "1000) or a number (default: sized from device memory)",
            parse_byte_size,
            "BYTES",
        ),
        _Opt(
            "num_threads",
            ("--num-threads",),
            "int",
            "CPU intra-op threads (default: torch's)",
            _int,
        ),
        _Opt(
            "log_level",
            ("--uvicorn-log-level", "--log-level"),
            "str",
            f"server log level: {', '.join(LOG_LEVELS)} (default: {d['log_level']})",
            _log_level,
            "LEVEL",
        ),
    )


def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """Wrap a value parser so argparse reports its message (exit code 2)."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = getattr(parse, "__name__", "value").lstrip("_")
    return convert


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``serve``'s vLLM-compatible flags to ``parser``.

    Every flag defaults to ``argparse.SUPPRESS``, so the namespace holds only what was given
    explicitly; ``config_from_args`` merges it with ``--config`` and the built-in defaults.
    """
    parser.add_argument(
        "model",
        nargs="?",
        default=argparse.SUPPRESS,
        metavar="MODEL_DIR",
        help="Hugging Face-format model directory (holds config.json)",
    )
    for o in _options(_builtin_defaults()):
        kw: dict[str, Any] = {"dest": o.dest, "default": argparse.SUPPRESS, "help": o.help}
        if o.kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = _argparse_type(o.parse)
            kw["metavar"] = o.metavar
            if o.kind in ("strs", "lora"):
                kw.update(nargs="+", action="extend")
        parser.add_argument(*o.flags, **kw)
    parser.add_argument(
        "--config",
        default=argparse.SUPPRESS,
        metavar="FILE",
        help="YAML (.yaml/.yml) or TOML (.toml) file of flag names to values "
        "(dashes or underscores); explicit flags override it",
    )


# --------------------------------------------------------------------------- config file


def _load_toml(text: str) -> Any:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    return tomllib.loads(text)


def _coerce_file_value(o: _Opt, value: object) -> Any:
    """A config-file value, typed like the flag's (raises ValueError)."""
    if o.kind == "bool":
        if isinstance(value, bool):
            return value
        words = {
            "true": True,
            "yes": True,
            "on": True,
            "1": True,
            "false": False,
            "no": False,
            "off": False,
            "0": False,
        }
        if isinstance(value, str) and value.strip().lower() in words:
            return words[value.strip().lower()]
        raise ValueError(f"expected true or false, got {value!r}")
    if o.kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            return o.parse(value)
        raise ValueError(f"expected an integer, got {value!r}")
    if o.kind == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if value < 0:
                raise ValueError(f"expected a number >= 0, got {value!r}")
            return float(value)
        if isinstance(value, str):
            return o.parse(value)
        raise ValueError(f"expected a number, got {value!r}")
    if o.kind == "str":
        if isinstance(value, str):
            return o.parse(value)
        hint = " (quote it)" if isinstance(value, (int, float)) else ""
        raise ValueError(f"expected a string, got {value!r}{hint}")
    if o.kind == "strs":
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise ValueError(f"expected a string or a list of strings, got {value!r}")
        return [o.parse(x) for x in items]
    return _lora_modules_value(value)


def _read_config_file(path_text: str, opts: tuple[_Opt, ...]) -> dict[str, tuple[Any, str]]:
    """dest -> (value, where) from a YAML/TOML file; raises ServeConfigError."""
    path = Path(path_text).expanduser()
    suffix = path.suffix.lower()
    if suffix not in CONFIG_SUFFIXES:
        raise ServeConfigError(
            f"--config: {path_text!r} must end in .yaml, .yml or .toml (got {suffix or 'none'!r})"
        )
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ServeConfigError(f"--config: cannot read {path_text!r}: {reason}") from e
    try:
        if suffix == ".toml":
            data = _load_toml(raw)
        else:
            import yaml

            data = yaml.safe_load(raw)
    except Exception as e:  # tomllib.TOMLDecodeError / yaml.YAMLError: the parser's message
        kind = "TOML" if suffix == ".toml" else "YAML"
        raise ServeConfigError(f"--config: {path_text!r} is not valid {kind}: {e}") from e
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ServeConfigError(
            f"--config: {path_text!r} must hold a mapping of flag names to values, "
            f"got {type(data).__name__}"
        )
    keys = {flag.lstrip("-"): o for o in opts for flag in o.flags}
    keys["model"] = next(o for o in opts if o.dest == "model_option")
    out: dict[str, tuple[Any, str]] = {}
    for key, value in data.items():
        norm = key.strip().lower().replace("_", "-") if isinstance(key, str) else None
        o = keys.get(norm) if norm else None
        if o is None:
            near = difflib.get_close_matches(norm or "", list(keys), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ServeConfigError(f"unknown key {key!r} in config file {path_text!r}{hint}")
        where = f"key {key!r} in {path_text!r}"
        if o.dest in out:
            raise ServeConfigError(f"{where}: sets the same option as {out[o.dest][1]}")
        if value is None:  # null: keep the default
            continue
        try:
            out[o.dest] = (_coerce_file_value(o, value), where)
        except ValueError as e:
            raise ServeConfigError(f"{where}: {e}") from None
    return out


# --------------------------------------------------------------------------- merge + checks


def _resolve(path: str) -> Path:
    return Path(path).expanduser().resolve()


def _hub_hint(path: str) -> str:
    """A hint for vLLM users who pass a Hugging Face hub id instead of a directory."""
    if re.fullmatch(r"[\w.-]+/[\w.-]+", path) and not path.startswith((".", "/")):
        return (
            " (loraplex serves local directories only; download a hub model first, "
            f"e.g. `huggingface-cli download {path} --local-dir DIR`)"
        )
    return ""


def config_from_args(
    args: argparse.Namespace, *, environ: Mapping[str, str] | None = None
) -> ServerConfig:
    """Build and validate the ServerConfig from ``add_serve_arguments``' namespace.

    Merges explicit flags > ``--config`` file > environment (API keys) > built-in defaults,
    checks the model directory (config.json), each ``--lora-modules`` directory
    (adapter_config.json) and each ``--allowed-lora-roots`` directory, and resolves those
    paths (relative paths are relative to the working directory, also in the file). The
    served name defaults to MODEL_DIR as given, so clients use the same name as with vLLM.
    Raises ServeConfigError naming the flag or key at fault.
    """
    env = os.environ if environ is None else environ
    defaults = _builtin_defaults()
    opts = _options(defaults)
    given: dict[str, tuple[Any, str]] = {}
    if getattr(args, "config", None) is not None:
        given.update(_read_config_file(args.config, opts))
    for o in opts:
        value = getattr(args, o.dest, None)
        if value is not None:
            given[o.dest] = (value, o.flags[0])

    def get(dest: str) -> Any:
        return given[dest][0] if dest in given else defaults.get(dest)

    flags = {o.dest: o.flags[0] for o in opts}

    def where(dest: str) -> str:
        return given[dest][1] if dest in given else flags[dest]

    def fail(dest: str, problem: str) -> ServeConfigError:
        return ServeConfigError(f"{where(dest)}: {problem}")

    # MODEL_DIR: positional or --model (both only if equal), else the file's 'model'
    positional = getattr(args, "model", None)
    option = getattr(args, "model_option", None)
    if positional is not None and option is not None and _resolve(positional) != _resolve(option):
        raise ServeConfigError(
            f"MODEL_DIR {positional!r} and --model {option!r} differ; give the model once"
        )
    model = positional if positional is not None else get("model_option")
    model_where = "MODEL_DIR" if positional is not None else where("model_option")
    if model is None:
        raise ServeConfigError(
            "MODEL_DIR is required: loraplex serve MODEL_DIR [flags] (put MODEL_DIR first: "
            "--lora-modules, --served-model-name, --api-key and --allowed-lora-roots take "
            "every word after them)"
        )

    # numbers
    bounds = {
        "port": (0, 65535),
        "max_loras": (1, None),
        "max_cpu_loras": (1, None),
        "max_lora_rank": (1, None),
        "max_model_len": (1, None),
        "max_num_seqs": (1, None),
        "max_num_batched_tokens": (1, None),
        "max_waiting": (0, None),
        "num_threads": (1, None),
        "kv_cache_memory_bytes": (1, None),
        "max_cpu_lora_bytes": (1, None),
        "disk_cache_bytes": (1, None),
        "adapter_load_timeout_s": (0.001, None),
        "registry_poll_s": (0.001, None),
    }
    for dest, (lo, hi) in bounds.items():
        value = get(dest)
        if value is None:
            continue
        if value < lo or (hi is not None and value > hi):
            want = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
            raise fail(dest, f"must be {want}, got {value}")
    max_loras, max_cpu_loras = get("max_loras"), get("max_cpu_loras")
    if "max_cpu_loras" not in given:
        max_cpu_loras = max(max_cpu_loras, max_loras)  # vLLM: defaults to at least max_loras
    elif max_cpu_loras < max_loras:
        raise fail("max_cpu_loras", f"must be >= --max-loras ({max_loras}), got {max_cpu_loras}")

    # LoRA modules and names
    enable_lora = get("enable_lora")
    lora_modules: list[LoRAModule] = list(get("lora_modules"))
    if lora_modules and not enable_lora:
        if "enable_lora" in given:
            hint = f" (it is turned off by {where('enable_lora')})"
        elif "lora_modules" in given and not given["lora_modules"][1].startswith("--"):
            hint = " (or set 'enable-lora: true' in the config file)"
        else:
            hint = ""
        raise fail("lora_modules", f"LoRA is off: add --enable-lora to serve LoRA modules{hint}")
    served = list(get("served_model_name")) or [model]
    seen: dict[str, str] = {}
    for name in served:
        seen.setdefault(name, "served model name")
    for m in lora_modules:
        if m.name in seen:
            raise fail("lora_modules", f"name {m.name!r} is used twice (already a {seen[m.name]})")
        seen[m.name] = "LoRA module name"

    # keys
    api_keys: list[str] = list(get("api_keys"))
    if not api_keys:
        api_keys = [env[k] for k in ENV_API_KEYS if env.get(k, "").strip()][:1]
    admin_key = get("admin_api_key")
    if admin_key is None and env.get(ENV_ADMIN_API_KEY, "").strip():
        admin_key = env[ENV_ADMIN_API_KEY]
    if admin_key is not None and admin_key in api_keys:
        admin_where = where("admin_api_key") if "admin_api_key" in given else ENV_ADMIN_API_KEY
        raise ServeConfigError(
            f"{admin_where}: the admin key must differ from every inference API key"
        )

    # paths
    model_dir = _resolve(model)
    if not model_dir.is_dir():
        what = "does not exist" if not model_dir.exists() else "is not a directory"
        raise ServeConfigError(f"{model_where}: {model!r} {what}{_hub_hint(model)}")
    if not (model_dir / "config.json").is_file():
        raise ServeConfigError(
            f"{model_where}: {model!r} has no config.json (expected a Hugging Face-format "
            "model directory)"
        )
    resolved_modules = []
    for m in lora_modules:
        if "://" in m.path and not m.path.startswith("file://"):  # object store: checked at load
            resolved_modules.append(m)
            continue
        adapter_dir = _resolve(m.path.removeprefix("file://"))
        if not adapter_dir.is_dir():
            what = "does not exist" if not adapter_dir.exists() else "is not a directory"
            raise fail("lora_modules", f"adapter {m.name!r}: {m.path!r} {what}{_hub_hint(m.path)}")
        if not (adapter_dir / "adapter_config.json").is_file():
            raise fail(
                "lora_modules",
                f"adapter {m.name!r}: {m.path!r} has no adapter_config.json (expected a PEFT "
                "adapter directory)",
            )
        resolved_modules.append(LoRAModule(m.name, str(adapter_dir), m.base_model_name, m.warm))
    disk_dir, disk_bytes = get("disk_cache_dir"), get("disk_cache_bytes")
    if disk_dir is not None and disk_bytes is None:
        raise fail("disk_cache_dir", "needs --disk-cache-bytes (the disk tier's byte budget)")
    if disk_bytes is not None and disk_dir is None:
        raise fail("disk_cache_bytes", "needs --disk-cache-dir")
    if disk_dir is not None:
        disk_path = _resolve(disk_dir)
        if disk_path.exists() and not disk_path.is_dir():
            raise fail("disk_cache_dir", f"{disk_dir!r} is not a directory")
        disk_dir = str(disk_path)
    store_url = get("adapter_store_url")
    if store_url is not None and "://" not in store_url:
        store_path = _resolve(store_url)
        if not store_path.is_dir():
            raise fail("adapter_store_url", f"{store_url!r} is not a directory")
        store_url = str(store_path)
    roots = []
    for root in get("allowed_lora_roots"):
        root_dir = _resolve(root)
        if not root_dir.is_dir():
            what = "does not exist" if not root_dir.exists() else "is not a directory"
            raise fail("allowed_lora_roots", f"{root!r} {what}")
        roots.append(str(root_dir))

    registry_url = get("registry_url")
    if registry_url is None and env.get("LORAPLEX_REGISTRY_URL", "").strip():
        registry_url = env["LORAPLEX_REGISTRY_URL"].strip()
    trusted = []
    for key_file in get("trusted_keys"):
        key_path = _resolve(key_file)
        if not key_path.is_file():
            raise fail("trusted_keys", f"{key_file!r} is not a file")
        trusted.append(str(key_path))
    if get("require_signatures") and not trusted:
        raise fail("require_signatures", "needs at least one --trusted-key")
    for prefix in get("allowed_store_prefixes"):
        if "://" not in prefix:
            raise fail("allowed_store_prefixes", f"{prefix!r} is not a URI like s3://bucket/path/")

    engine = EngineConfig(
        model=str(model_dir),
        dtype=get("dtype"),
        device=get("device"),
        seed=get("seed"),
        enable_lora=enable_lora,
        max_loras=max_loras,
        max_cpu_loras=max_cpu_loras,
        max_lora_rank=get("max_lora_rank"),
        max_cpu_lora_bytes=get("max_cpu_lora_bytes"),
        adapter_eviction_policy=get("adapter_eviction_policy"),
        adapter_min_residency_s=get("adapter_min_residency_s"),
        adapter_load_timeout_s=get("adapter_load_timeout_s"),
        disk_cache_dir=disk_dir,
        disk_cache_bytes=disk_bytes,
        adapter_store_url=store_url,
        kv_cache_memory_bytes=get("kv_cache_memory_bytes"),
        max_model_len=get("max_model_len"),
        max_num_seqs=get("max_num_seqs"),
        max_num_batched_tokens=get("max_num_batched_tokens"),
        enable_prefix_caching=get("enable_prefix_caching"),
        num_threads=get("num_threads"),
    )
    config = ServerConfig(
        engine=engine,
        host=get("host"),
        port=get("port"),
        served_model_name=served,
        lora_modules=resolved_modules,
        api_keys=api_keys,
        admin_api_key=admin_key,
        allowed_lora_roots=roots,
        max_waiting=get("max_waiting"),
        log_level=get("log_level"),
        registry_url=registry_url,
        registry_poll_s=get("registry_poll_s"),
        require_signatures=bool(get("require_signatures")),
        trusted_keys=trusted,
        allowed_store_prefixes=list(get("allowed_store_prefixes")),
        swap_eviction_delay_s=get("swap_eviction_delay_s"),
    )
    try:
        config.validate()
    except ValueError as e:  # the checks above should have caught it; keep one error type
        raise ServeConfigError(str(e)) from e
    return config


def parse_serve_args(argv: list[str], *, environ: Mapping[str, str] | None = None) -> ServerConfig:
    """Parse ``serve``'s argv (without the command name) into a validated ServerConfig.

    argparse errors (unknown flags, malformed values) exit with code 2; semantic problems
    raise ServeConfigError.
    """
    parser = argparse.ArgumentParser(
        prog="loraplex serve",
        description="Serve MODEL_DIR and its LoRA adapters over an OpenAI-compatible API.",
        allow_abbrev=False,  # a vLLM command line must parse exactly as vLLM would
    )
    add_serve_arguments(parser)
    return config_from_args(parser.parse_args(argv), environ=environ)
