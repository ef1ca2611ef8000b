"""``loraplex route``: flags and config file of the router (``main(argv) -> int``).

Every flag, config key, bound and default is declared once, on the ``RouterConfig`` /
``Thresholds`` / ``Weights`` field it sets (see :mod:`loraplex.config.fields`; ``serve`` reads
its config file with the same loader). Precedence per setting: command-line flag > ``--config``
file (YAML or TOML, the flag names with dashes or underscores, ``replicas`` as a list and
``weights`` as a mapping) > environment (the replica and status API keys only) > built-in
default. Every problem prints ``loraplex route: error: ...`` and exits 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from loraplex.config.settings import FileWording, Settings
from loraplex.router.config import RouterConfig


class RouteConfigError(ValueError):
    """A bad flag, config key or value; the message names it."""


def route_settings() -> Settings:
    """``route``'s settings: every declared field of RouterConfig and its Thresholds."""
    wording = FileWording(
        where="--config: {key}", unknown="--config: unknown setting {key!r} in {path!r}"
    )
    return Settings(RouterConfig, error=RouteConfigError, wording=wording)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``loraplex route`` parser (also used by tests to check the deploy manifests)."""
    p = _Parser(
        prog="loraplex route",
        description="Residency-aware router: the OpenAI API in front of many loraplex or vLLM "
        "replicas; requests go where their adapter is warm until that replica is saturated.",
        allow_abbrev=False,
    )
    route_settings().add_arguments(p, config_group="server")
    return p


def config_from_args(
    args: argparse.Namespace, *, environ: Mapping[str, str] | None = None
) -> RouterConfig:
    """Merge flags, the config file, the environment and defaults into a validated config."""
    values = route_settings().resolve(args, os.environ if environ is None else environ)
    replicas_file = values["replicas_file"]
    if replicas_file is not None and not Path(replicas_file).is_file():
        raise values.error("replicas_file", f"{replicas_file!r} is not a file")
    config: RouterConfig = values.build()
    try:
        config.validate()
    except ValueError as e:
        raise RouteConfigError(str(e)) from None
    return config


def parse_route_args(argv: list[str], *, environ: Mapping[str, str] | None = None) -> RouterConfig:
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
