"""``loraplex plan``'s command line: ``main(argv) -> int`` (0 on success, 2 on bad input)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from loraplex.config.argtypes import byte_size, positive_int, positive_ints
from loraplex.tools.plan.adapter_shape import adapter_from_config, adapter_from_path
from loraplex.tools.plan.capacity import DEFAULT_DECODE_BATCH, DTYPE_BYTES, QUANT_BITS, build_plan
from loraplex.tools.plan.model_shape import PRESETS, PlanError, load_model
from loraplex.tools.plan.report import render_plan
from loraplex.tools.plan.sharing import pipeline_estimate


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loraplex plan",
        description="Capacity planner: adapter bytes, device slots vs KV-cache tokens, host/disk "
        "budgets, decode byte model.",
        allow_abbrev=False,
    )
    p.add_argument(
        "--model", required=True, help=f"model dir, config.json, or {', '.join(PRESETS)}"
    )
    p.add_argument("--adapter", action="append", default=[], metavar="PATH",
                   help="PEFT dir / adapter_config.json / JSON manifest (repeatable)")  # fmt: skip
    p.add_argument(
        "--rank", type=positive_int, help="a synthetic adapter of this rank (with --targets)"
    )
    p.add_argument("--targets", default="q_proj,v_proj",
                   help="with --rank: modules, comma-separated, or all-linear (on a MoE base "
                   "gate_proj,up_proj,down_proj / w1,w3,w2 adapt every expert, gate the "
                   "router)")  # fmt: skip
    p.add_argument("--target-parameters", default="", metavar="P,P,...",
                   help="with --rank on a MoE base: PEFT target_parameters, e.g. "
                   "mlp.experts.gate_up_proj,mlp.experts.down_proj,mlp.gate.weight")  # fmt: skip
    p.add_argument("--dtype", choices=list(DTYPE_BYTES), help="default: the model's")
    p.add_argument(
        "--quantization",
        choices=list(QUANT_BITS),
        help="the base's projections quantized (GPTQ/AWQ/W4A16: int4; W8A8: int8)",
    )
    p.add_argument(
        "--quantization-group-size",
        type=positive_int,
        metavar="N",
        help="int4 columns per scale (default 128)",
    )
    p.add_argument("--max-lora-rank", type=positive_int, help="slot rank (default: the largest)")
    p.add_argument(
        "--device-budget", type=byte_size, metavar="BYTES", help="e.g. 2GiB for adapters"
    )
    p.add_argument(
        "--slots", type=positive_int, help="device slots (max_loras) to price in KV tokens"
    )
    p.add_argument("--num-adapters", type=positive_int, help="adapters to keep on host and disk")
    p.add_argument("--host-budget", type=byte_size, metavar="BYTES")
    p.add_argument("--disk-budget", type=byte_size, metavar="BYTES")
    p.add_argument(
        "--decode-k", type=positive_ints, default=[1, 2, 4, 8, 16, 32], metavar="K,K,..."
    )
    p.add_argument("--decode-batch", type=positive_int, default=DEFAULT_DECODE_BATCH,
                   metavar="T", help="tokens of a full decode batch, for a MoE base's experts "
                   "read (default: %(default)s, the engine's --max-num-seqs)")  # fmt: skip
    p.add_argument("--pipeline-context", type=positive_int, metavar="TOKENS",
                   help="estimate a pipeline of the adapters over one context of this many "
                   "tokens: the base answers, then each adapter adds --pipeline-question tokens "
                   "(aLoRA adapters share the context's base blocks)")  # fmt: skip
    p.add_argument("--pipeline-question", type=positive_int, default=64, metavar="TOKENS",
                   help="tokens each pipeline step adds (invocation + question; default 64)")  # fmt: skip
    p.add_argument("--pipeline-steps", type=positive_int, default=4, metavar="N",
                   help="with --rank: how many steps the synthetic adapter runs (default 4)")  # fmt: skip
    p.add_argument("--alora", action="store_true",
                   help="with --rank: the synthetic adapter is an activated LoRA")  # fmt: skip
    p.add_argument("--block-size", type=positive_int, default=16, help="KV block (default 16)")
    p.add_argument("--json", action="store_true")
    return p


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    """``loraplex plan``: 0 on success, 2 on bad input."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code) if isinstance(e.code, int) else 2
    try:
        m = load_model(args.model)
        adapters = [adapter_from_path(a, m) for a in args.adapter]
        if args.rank is not None:
            t = args.targets.strip()
            targets: str | list[str] = t if t == "all-linear" else _csv(t)
            cfg: dict[str, Any] = {"r": args.rank, "target_modules": targets}
            if _csv(args.target_parameters):
                cfg["target_parameters"] = _csv(args.target_parameters)
            if args.alora:
                cfg["alora_invocation_tokens"] = [0]  # which tokens does not change the bytes
            synthetic = adapter_from_config(cfg, m, f"r{args.rank}")
            copies = args.pipeline_steps if args.pipeline_context else 1
            adapters += [synthetic] * copies
        plan = build_plan(
            m,
            adapters,
            dtype=args.dtype,
            max_lora_rank=args.max_lora_rank,
            device_budget=args.device_budget,
            slots=args.slots,
            num_adapters=args.num_adapters,
            host_budget=args.host_budget,
            disk_budget=args.disk_budget,
            decode_k=args.decode_k,
            decode_batch=args.decode_batch,
            quantization=args.quantization,
            quantization_group_size=args.quantization_group_size,
        )
        if args.pipeline_context is not None:
            plan["pipeline"] = pipeline_estimate(
                adapters,
                context=args.pipeline_context,
                question=args.pipeline_question,
                block_size=args.block_size,
                kv_bytes_per_token=plan["device"]["kv_bytes_per_token"],
                flops_per_token=2 * plan["model"].get("active_params", plan["model"]["params"]),
            )
    except PlanError as e:
        print(f"loraplex plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan, indent=1) if args.json else render_plan(plan))
    return 0
