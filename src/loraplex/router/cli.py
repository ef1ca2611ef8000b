"""``loraplex route``: flags and config file of the router (``main(argv) -> int``).

Precedence per setting: command-line flag > ``--config`` file (YAML or TOML, the flag names
with dashes or underscores, ``weights`` as a mapping) > environment (the replica API key
only) > built-in default. Every problem prints ``loraplex route: error: ...`` and exits 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from loraplex.router.app import RouterConfig
from loraplex.router.replicas import normalize_url
from loraplex.router.scoring import POLICIES, Thresholds, Weights

ENV_API_KEY = "LORAPLEX_API_KEY"
_WEIGHTS = tuple(f.name for f in fields(Weights))

# flag dest -> (RouterConfig/Thresholds field, parse); "weights" is handled on its own
_SCALARS: dict[str, tuple[str, type]] = {
    "replicas_file": ("replicas_file", str),
    "replicas_dns": ("replicas_dns", str),
    "policy": ("policy", str),
    "poll_interval": ("poll_interval_s", float),
    "poll_timeout": ("poll_timeout_s", float),
    "readmit_after": ("readmit_after", int),
    "eject_after": ("eject_after", int),
    "max_retries": ("max_retries", int),
    "connect_timeout": ("connect_timeout_s", float),
    "read_timeout": ("read_timeout_s", float),
    "retry_after": ("retry_after_s", int),
    "replica_api_key": ("replica_api_key", str),
    "host": ("host", str),
    "port": ("port", int),
    "log_level": ("log_level", str),
    "max_waiting": ("max_waiting", int),
    "max_kv_usage": ("max_kv_usage", float),
    "max_in_flight": ("max_in_flight", int),
}
_THRESHOLDS = ("max_waiting", "max_kv_usage", "max_in_flight")


class RouteConfigError(ValueError):
    """A bad flag, config key or value; the message names it."""


def _weight(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    name = name.strip().replace("-", "_")
    if not sep or name not in _WEIGHTS:
        raise argparse.ArgumentTypeError(
            f"expected NAME=VALUE with NAME one of {', '.join(_WEIGHTS)}, got {text!r}"
        )
    try:
        return name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {value!r} is not a number") from None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``loraplex route`` parser (also used by tests to check the deploy manifests)."""
    d = RouterConfig()
    th, w = Thresholds(), Weights()
    p = _Parser(
        prog="loraplex route",
        description="Residency-aware router: the OpenAI API in front of many loraplex or vLLM "
        "replicas; requests go where their adapter is warm until that replica is saturated.",
        allow_abbrev=False,
    )
    g = p.add_argument_group("replicas")
    g.add_argument("--replica", action="append", default=None, metavar="URL",
                   help="a replica's base URL (repeat for more)")  # fmt: skip
    g.add_argument("--replicas-file", metavar="FILE",
                   help="file of replica URLs, one per line; re-read when it changes")  # fmt: skip
    g.add_argument("--replicas-dns", metavar="NAME:PORT",
                   help="DNS name whose addresses are the replicas (a headless Service); "
                        "re-resolved on every poll")  # fmt: skip
    g.add_argument("--replica-api-key", metavar="KEY",
                   help=f"API key for the router's own polls of /v1/adapters (default: "
                        f"${ENV_API_KEY}); clients' Authorization headers are passed through")  # fmt: skip
    r = p.add_argument_group("routing")
    r.add_argument("--policy", choices=POLICIES, default=None,
                   help=f"routing policy (default: {d.policy})")  # fmt: skip
    r.add_argument("--weight", action="append", type=_weight, default=None, metavar="NAME=VALUE",
                   help="score weight, e.g. --weight device=1 --weight waiting=0.1; names: "
                        + ", ".join(f"{k} ({getattr(w, k):g})" for k in _WEIGHTS))  # fmt: skip
    r.add_argument("--max-waiting", type=int, default=None, metavar="N",
                   help=f"queue depth at which a replica is saturated (default: {th.max_waiting})")  # fmt: skip
    r.add_argument("--max-kv-usage", type=float, default=None, metavar="FRACTION",
                   help=f"KV-cache usage at which a replica is saturated (default: "
                        f"{th.max_kv_usage:g})")  # fmt: skip
    r.add_argument("--max-in-flight", type=int, default=None, metavar="N",
                   help=f"router requests outstanding at which a replica is saturated (default: "
                        f"{th.max_in_flight})")  # fmt: skip
    h = p.add_argument_group("health and retries")
    h.add_argument("--poll-interval", type=float, default=None, metavar="SECONDS",
                   help=f"seconds between polls of every replica (default: {d.poll_interval_s:g})")  # fmt: skip
    h.add_argument("--poll-timeout", type=float, default=None, metavar="SECONDS",
                   help=f"timeout of one poll request (default: {d.poll_timeout_s:g})")  # fmt: skip
    h.add_argument("--readmit-after", type=int, default=None, metavar="N",
                   help=f"good health checks before an ejected replica is used again (default: "
                        f"{d.readmit_after})")  # fmt: skip
    h.add_argument("--eject-after", type=int, default=None, metavar="N",
                   help=f"failed or timed-out health checks in a row that eject a replica "
                        f"(default: {d.eject_after}; a refused connection ejects at once)")  # fmt: skip
    h.add_argument("--max-retries", type=int, default=None, metavar="N",
                   help=f"other replicas tried when one fails before the first byte (default: "
                        f"{d.max_retries})")  # fmt: skip
    h.add_argument("--connect-timeout", type=float, default=None, metavar="SECONDS",
                   help=f"(default: {d.connect_timeout_s:g})")  # fmt: skip
    h.add_argument("--read-timeout", type=float, default=None, metavar="SECONDS",
                   help=f"longest silence from a replica (default: {d.read_timeout_s:g})")  # fmt: skip
    h.add_argument("--retry-after", type=int, default=None, metavar="SECONDS",
                   help=f"Retry-After of the router's 503s (default: {d.retry_after_s})")  # fmt: skip
    s = p.add_argument_group("server")
    s.add_argument("--host", default=None, help=f"address to bind (default: {d.host})")
    s.add_argument("--port", type=int, default=None, help=f"port to bind (default: {d.port})")
    s.add_argument("--log-level", default=None,
                   choices=("critical", "error", "warning", "info", "debug", "trace"),
                   help=f"(default: {d.log_level})")  # fmt: skip
    s.add_argument("--config", metavar="FILE", help="YAML or TOML file with the same settings")
    return p


def _load_file(path: str) -> dict[str, Any]:
    """The config file as a flat mapping with underscore keys."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml"):
        raise RouteConfigError(f"--config: {path!r} must end in .yaml, .yml or .toml")
    try:
        text = p.read_text()
    except OSError as e:
        raise RouteConfigError(f"--config: cannot read {path!r}: {e.strerror or e}") from e
    try:
        if suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib  # type: ignore[no-redef]
            data = tomllib.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:
        raise RouteConfigError(f"--config: {path!r} is not valid {suffix[1:].upper()}: {e}") from e
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RouteConfigError(f"--config: {path!r} must hold a mapping of settings")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _typed(key: str, value: Any, kind: type) -> Any:
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind is str and isinstance(value, str) and value.strip():
        return value
    raise RouteConfigError(f"--config: {key}: expected {kind.__name__}, got {value!r}")


def config_from_args(
    args: argparse.Namespace, *, environ: dict[str, str] | None = None
) -> RouterConfig:
    """Merge flags, the config file, the environment and defaults into a validated config."""
    env = dict(os.environ) if environ is None else environ
    file = _load_file(args.config) if args.config else {}
    allowed = {"replicas", "weights", *_SCALARS}
    unknown = sorted(set(file) - allowed)
    if unknown:
        raise RouteConfigError(
            f"--config: unknown setting {unknown[0]!r} (known: {', '.join(sorted(allowed))})"
        )
    values: dict[str, Any] = {}
    for dest, (field_name, kind) in _SCALARS.items():
        flag = getattr(args, dest)
        if flag is not None:
            values[field_name] = flag
        elif dest in file:
            values[field_name] = _typed(dest, file[dest], kind)
    if "replica_api_key" not in values and env.get(ENV_API_KEY, "").strip():
        values["replica_api_key"] = env[ENV_API_KEY]
    if values.get("policy", "residency") not in POLICIES:
        raise RouteConfigError(
            f"--config: policy: {values['policy']!r} is not one of {', '.join(POLICIES)}"
        )
    # replicas: flags replace the file's list
    raw_replicas = args.replica if args.replica is not None else file.get("replicas", [])
    if isinstance(raw_replicas, str):
        raw_replicas = [raw_replicas]
    if not isinstance(raw_replicas, list) or not all(isinstance(u, str) for u in raw_replicas):
        raise RouteConfigError(f"--config: replicas: expected a list of URLs, got {raw_replicas!r}")
    try:
        replicas = [normalize_url(u) for u in raw_replicas]
    except ValueError as e:
        raise RouteConfigError(f"--replica: {e}") from None
    # weights: file mapping, then flags on top
    weights: dict[str, float] = {}
    fw = file.get("weights", {})
    if not isinstance(fw, dict):
        raise RouteConfigError(f"--config: weights: expected a mapping, got {fw!r}")
    for k, v in fw.items():
        name = str(k).replace("-", "_")
        if name not in _WEIGHTS:
            raise RouteConfigError(
                f"--config: weights: unknown weight {k!r} (known: {', '.join(_WEIGHTS)})"
            )
        weights[name] = _typed(f"weights.{k}", v, float)
    for name, v in args.weight or []:
        weights[name] = v
    thresholds = Thresholds(**{k: values.pop(k) for k in _THRESHOLDS if k in values})
    if "replicas_file" in values and not Path(values["replicas_file"]).is_file():
        raise RouteConfigError(f"--replicas-file: {values['replicas_file']!r} is not a file")
    config = replace(
        RouterConfig(),
        replicas=replicas,
        weights=replace(Weights(), **weights),
        thresholds=thresholds,
        **values,
    )
    try:
        config.validate()
    except ValueError as e:
        raise RouteConfigError(str(e)) from None
    return config


def parse_route_args(argv: list[str], *, environ: dict[str, str] | None = None) -> RouterConfig:
    """argv (after ``route``) -> validated RouterConfig; argparse errors exit 2."""
    return config_from_args(build_parser().parse_args(argv), environ=environ)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        config = parse_route_args(argv)
    except RouteConfigError as e:
        print(f"loraplex route: error: {e}", file=sys.stderr)
        return 2
    from loraplex.router.app import run_router

    run_router(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
