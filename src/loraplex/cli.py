"""``loraplex`` command line: ``demo`` and ``generate`` (the server arrives with ``serve``)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from loraplex.types import LoraplexError


def _parse_lora(spec: str) -> tuple[str, str]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora expects NAME=PATH, got {spec!r}")
    return name, path


def cmd_generate(args: argparse.Namespace) -> int:
    from loraplex import LLM, LoRARequest, SamplingParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        enable_lora=bool(args.lora),
    )
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


def cmd_demo(args: argparse.Namespace) -> int:
    """Build (once) a small random Llama and four PEFT adapters, then run one mixed batch."""
    from loraplex import LLM, LoRARequest, SamplingParams
    from loraplex.testing import (
        ALL_PROJ,
        ATTN_PROJ,
        MLP_PROJ,
        load_merged_reference,
        make_random_adapter,
        make_random_model,
        reference_greedy,
    )

    root = Path(args.cache_dir).expanduser()
    model_dir = root / "model"
    if not (model_dir / "config.json").is_file():
        print(f"building a random Llama (h256, 4 layers, GQA) in {model_dir} ...")
        make_random_model(
            model_dir,
            hidden_size=256,
            num_layers=4,
            num_heads=8,
            num_kv_heads=4,
            intermediate_size=768,
            seed=0,
        )
    specs = {
        "all-r8": dict(r=8, target_modules=ALL_PROJ, seed=1),
        "attn-r16": dict(r=16, target_modules=ATTN_PROJ, seed=2),
        "mlp-r4-rslora": dict(r=4, target_modules=MLP_PROJ, use_rslora=True, seed=3),
        "qv-r32": dict(r=32, target_modules=["q_proj", "v_proj"], seed=4),
    }
    loras: list[LoRARequest | None] = [None]
    for name, kw in specs.items():
        d = root / "adapters" / name
        if not (d / "adapter_config.json").is_file():
            make_random_adapter(model_dir, d, **kw)
        loras.append(LoRARequest(name, d))
    llm = LLM(str(model_dir), max_loras=4, dtype="auto")
    prompts = ["What is the capital of France?", "def add(a, b):"]
    batch_p = [p for p in prompts for _ in loras]
    batch_l = [lr for _ in prompts for lr in loras]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(batch_p, params, lora_request=batch_l)
    dt = time.perf_counter() - t0
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        f"one mixed batch: {len(outs)} requests, base + {len(loras) - 1} adapters "
        f"(random weights, so the text is noise): {ntok} tokens in {dt:.2f}s = {ntok / dt:.1f} tok/s"
    )
    print("checking each output against transformers + PEFT with that adapter merged ...")
    tok = llm.get_tokenizer()
    ok = True
    for prompt, lr, out in zip(batch_p, batch_l, outs, strict=True):
        ref = load_merged_reference(model_dir, lr.path if lr else None)
        want, _ = reference_greedy(ref, tok(prompt).input_ids, len(out.outputs[0].token_ids))
        same = want == out.outputs[0].token_ids
        ok &= same
        who = out.adapter.short if out.adapter else "base"
        print(f"  {'equal' if same else 'DIFFERENT':<9} {who:<42} {prompt!r}")
    print(f"all KV blocks and slots free afterwards: {llm.engine.is_idle()}")
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loraplex", description="Multi-LoRA LLM inference.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="run one prompt on the base model and each --lora adapter")
    g.add_argument("model", help="HF-format model directory")
    g.add_argument("--prompt", required=True)
    g.add_argument("--lora", action="append", type=_parse_lora, default=[], metavar="NAME=PATH")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--max-loras", type=int, default=8)
    g.add_argument("--max-lora-rank", type=int, default=64)
    g.set_defaults(func=cmd_generate)
    d = sub.add_parser("demo", help="random model + 4 adapters, one mixed batch (no downloads)")
    d.add_argument("--cache-dir", default="~/.cache/loraplex/demo-random")
    d.add_argument("--max-tokens", type=int, default=32)
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (LoraplexError, ValueError, OSError) as e:
        print(f"loraplex {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
