"""``loraplex verify ADAPTER --model DIR``: check an adapter before it takes traffic.

    loraplex verify /adapters/sql --model /models/llama3 [--prompt TEXT ...] [--max-tokens 16]

Three checks, each failure reported in words and with exit status 1:

1. **static** (no weights computed): the adapter's ``target_modules`` must match projections of
   this model (else it is a *silent no-op*: served, it would answer exactly like the base), and
   every LoRA tensor must fit the base's shapes (``A: [r, d_in]``, ``B: [d_out, r]``, layer
   indices within the model: else it was trained for a *wrong base*); all-zero B matrices are a
   no-op too;
2. **engine vs merged reference**: the loraplex engine runs the prompts greedily with the adapter
   unmerged (the way it serves it); transformers + PEFT merge the adapter into a copy of the base
   and score the engine's tokens teacher-forced (unmerged where merging would write a tied
   model's shared embedding / LM head matrix). Reported: max |logprob difference| over the
   engine's top-20 tokens at every step, and greedy-token agreement (a disagreement within
   ``2 x atol`` of a tie counts as a tie, not a failure);
3. **effect**: the same reference with the adapter disabled: max |logprob difference| between
   base and adapter. Below ``atol`` the adapter changes nothing: a no-op.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loraplex.bench.plan import PlanError, adapter_from_config, model_from_config
from loraplex.lora.digest import DigestError, safetensors_header
from loraplex.lora.peft_format import (
    BIN_NAME,
    CONFIG_NAME,
    OTHER_TOWER_RE,
    SAFETENSORS_NAME,
    VOCAB_LAYER,
    VOCAB_MODULES,
    merge_writes_tied_matrix,
    parse_tensor_key,
)

__all__ = ["DEFAULT_PROMPTS", "VerifyReport", "main", "static_check", "verify_adapter"]

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a short SQL query that counts the users.",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Translate to French: good morning, my friend.",
    "List three colors:",
]
TOP_K = 20  # the engine's logprobs limit


@dataclass
class PromptResult:
    prompt: str
    tokens: int
    agree: int  # steps whose reference argmax is the engine's token
    ties: int  # steps where they differ within 2 x atol of a tie
    first_diff: int | None  # first step with a real disagreement
    max_diff: float  # max |logprob diff| over the engine's top-k at every step
    effect: float  # max |logprob diff| base vs adapter (reference, teacher-forced)


@dataclass
class VerifyReport:
    adapter: str
    model: str
    ok: bool = False
    verdict: str = ""  # ok | silent_no_op | wrong_base | disagreement | load_error
    problems: list[str] = field(default_factory=list)
    rank: int = 0
    targets: list[str] = field(default_factory=list)
    modules: int = 0
    prompts: list[PromptResult] = field(default_factory=list)
    max_diff: float | None = None
    effect: float | None = None
    atol: float = 0.0


# -- static ----------------------------------------------------------------------------------------
def _tensor_shapes(adapter: Path) -> dict[str, list[int]]:
    st = adapter / SAFETENSORS_NAME
    if st.is_file():
        try:
            return {k: list(t.shape) for k, t in safetensors_header(st).items()}
        except (OSError, DigestError) as e:
            raise PlanError(f"cannot read {st}: {e}") from None
    binf = adapter / BIN_NAME
    if binf.is_file():
        import torch

        sd = torch.load(binf, map_location="cpu", weights_only=True)
        return {k: list(v.shape) for k, v in sd.items()}
    raise PlanError(f"{adapter} has no {SAFETENSORS_NAME} or {BIN_NAME}")


def static_check(adapter: Path, model_dir: Path, report: VerifyReport) -> None:
    """Targets vs the model's projections and tensor shapes vs the base; fills ``report``."""
    try:
        cfg = json.loads((adapter / CONFIG_NAME).read_text())
        mcfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"cannot read the adapter or model config: {e}") from None
    m = model_from_config(mcfg, model_dir.name)
    try:
        shape = adapter_from_config(cfg, m, adapter.name)
    except PlanError as e:
        if "change nothing" in str(e):
            report.verdict = "silent_no_op"
            report.problems.append(
                f"silent no-op: target_modules {cfg.get('target_modules')!r} match none of this "
                f"model's modules ({', '.join((*m.adapter_projs, *VOCAB_MODULES))}); served, it would "
                "answer exactly like the base model"
            )
            return
        raise
    report.rank, report.targets, report.modules = shape.max_rank, shape.targets, len(shape.modules)
    wrong: list[str] = []
    seen: set[tuple[int, str]] = set()
    for key, sh in sorted(_tensor_shapes(adapter).items()):
        if m.text_only and OTHER_TOWER_RE.match(key):
            continue  # a multimodal base's other towers: never served, never checked
        k = parse_tensor_key(key)
        if k is None:
            if "lora_" in key:
                wrong.append(f"{key}: not a LoRA of a Llama-family module")
            continue
        layer, proj, ab = k.layer, k.proj, k.ab
        known = proj in VOCAB_MODULES if layer == VOCAB_LAYER else proj in m.adapter_projs
        if not known or layer >= m.num_layers:
            wrong.append(f"{key}: the model has no such module ({m.num_layers} layers)")
            continue
        d_in, d_out = m.dims(proj)
        if ab == "A" and (len(sh) != 2 or sh[1] != d_in):
            wrong.append(f"{key}: shape {sh}, the base's {proj} takes d_in={d_in}")
        elif ab == "B" and (len(sh) != 2 or sh[0] != d_out):
            wrong.append(f"{key}: shape {sh}, the base's {proj} gives d_out={d_out}")
        seen.add((layer, proj))
    if wrong:
        report.verdict = "wrong_base"
        report.problems.append(
            f"wrong base: {len(wrong)} LoRA tensors do not fit {model_dir} (hidden "
            f"{m.hidden_size}, {m.num_layers} layers, intermediate {m.intermediate_size}); "
            "first: " + "; ".join(wrong[:3])
        )
    elif not seen:
        report.verdict = "silent_no_op"
        report.problems.append(
            "silent no-op: the weights file holds no LoRA tensors for this model's projections"
        )


def _zero_b(adapter: Path) -> bool:
    import torch

    st = adapter / SAFETENSORS_NAME
    if st.is_file():
        from safetensors.torch import load_file

        sd = load_file(str(st))
    else:
        sd = torch.load(adapter / BIN_NAME, map_location="cpu", weights_only=True)
    bs = [v for k, v in sd.items() if "lora_B" in k]
    return bool(bs) and all(not bool(torch.any(v != 0)) for v in bs)


# -- dynamic ---------------------------------------------------------------------------------------
def verify_adapter(
    adapter: str | Path,
    model: str | Path,
    *,
    prompts: list[str] | None = None,
    max_tokens: int = 16,
    atol: float = 1e-3,
    dtype: str = "float32",
) -> VerifyReport:
    """Run every check; ``report.ok`` and ``report.verdict`` say how it went."""
    import torch

    from loraplex import LLM, LoRARequest, SamplingParams
    from loraplex.types import LoraplexError

    a_dir, m_dir = Path(adapter), Path(model)
    report = VerifyReport(str(a_dir), str(m_dir), atol=atol)
    static_check(a_dir, m_dir, report)
    if report.problems:
        return report
    if _zero_b(a_dir):
        report.verdict = "silent_no_op"
        report.problems.append("silent no-op: every lora_B matrix is zero (an untrained adapter)")
        return report
    prompts = prompts or DEFAULT_PROMPTS
    # 1. the engine, adapter unmerged (as served)
    try:
        llm = LLM(
            str(m_dir), enable_lora=True, max_loras=1, max_lora_rank=max(report.rank, 1),
            dtype=dtype, max_num_seqs=len(prompts),
        )  # fmt: skip
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                logprobs=TOP_K)  # fmt: skip
        outs = llm.generate(prompts, params, lora_request=LoRARequest("verify", str(a_dir)))
        tok = llm.get_tokenizer()
        prompt_ids = [tok(p).input_ids for p in prompts]
    except (LoraplexError, ValueError, RuntimeError) as e:
        report.verdict = "load_error"
        report.problems.append(f"the engine refused the adapter: {e}")
        return report
    del llm
    # 2. the reference: PEFT on a float32 copy of the base; base scores, then merged scores
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(m_dir), dtype=torch.float32)
    try:
        peft = PeftModel.from_pretrained(base, str(a_dir)).eval()
    except (ValueError, RuntimeError, KeyError) as e:
        report.verdict = "load_error"
        report.problems.append(f"transformers + PEFT cannot load the adapter on this base: {e}")
        return report
    seqs = [ids + o.outputs[0].token_ids for ids, o in zip(prompt_ids, outs, strict=True)]

    @torch.no_grad()
    def score(model: Any) -> list[torch.Tensor]:
        rows = []
        for ids, seq, o in zip(prompt_ids, seqs, outs, strict=True):
            logits = model(torch.tensor([seq])).logits[0].float()
            n = len(o.outputs[0].token_ids)
            rows.append(torch.log_softmax(logits[len(ids) - 1 : len(ids) - 1 + n], dim=-1))
        return rows

    with peft.disable_adapter():
        base_lp = score(peft)
    adapter_cfg = json.loads((a_dir / CONFIG_NAME).read_text())
    if merge_writes_tied_matrix(adapter_cfg, json.loads((m_dir / "config.json").read_text())):
        ref_lp = score(peft)  # merging would write the tied matrix: the unmerged model is right
    else:
        ref_lp = score(peft.merge_and_unload().eval())
    for p, o, ref, b in zip(prompts, outs, ref_lp, base_lp, strict=True):
        got = o.outputs[0]
        agree = ties = 0
        first = None
        worst = 0.0
        for step, (tid, lp) in enumerate(zip(got.token_ids, got.logprobs or [], strict=True)):
            worst = max([worst, *(abs(v - float(ref[step, t])) for t, v in lp.top.items())])
            best = int(ref[step].argmax())
            if best == tid:
                agree += 1
            elif float(ref[step, best] - ref[step, tid]) <= 2 * atol:
                ties += 1
            elif first is None:
                first = step
        effect = float((ref - b).abs().max()) if len(ref) else 0.0
        report.prompts.append(
            PromptResult(p, len(got.token_ids), agree, ties, first, worst, effect)
        )
    report.max_diff = max(r.max_diff for r in report.prompts)
    report.effect = max(r.effect for r in report.prompts)
    bad = [r for r in report.prompts if r.first_diff is not None]
    if report.max_diff > atol or bad:
        report.verdict = "disagreement"
        report.problems.append(
            f"the engine disagrees with the merged reference: max |logprob diff| "
            f"{report.max_diff:.3g} (atol {atol:g}), greedy tokens differ in {len(bad)} of "
            f"{len(report.prompts)} prompts"
        )
    elif report.effect < atol:
        report.verdict = "silent_no_op"
        report.problems.append(
            f"silent no-op: the adapter changes the base's logprobs by at most "
            f"{report.effect:.3g} (< atol {atol:g})"
        )
    else:
        report.verdict, report.ok = "ok", True
    return report


def render(report: VerifyReport) -> str:
    lines = [f"adapter {report.adapter} on {report.model}"]
    if report.modules:
        fit = "" if report.verdict == "wrong_base" else ": shapes fit the base"
        lines.append(
            f"rank {report.rank}, {report.modules} modules ({','.join(report.targets)}){fit}"
        )
    if report.prompts:
        lines += ["", f"{'prompt':<40}{'tokens':>7}{'agree':>7}{'ties':>5}{'first diff':>11}"
                  f"{'max|dlogp|':>12}{'vs base':>9}"]  # fmt: skip
        for r in report.prompts:
            lines.append(
                f"{r.prompt[:39]!s:<40}{r.tokens:>7}{r.agree:>7}{r.ties:>5}"
                f"{'-' if r.first_diff is None else r.first_diff:>11}{r.max_diff:>12.2e}"
                f"{r.effect:>9.3f}"
            )
        lines.append("")
    if report.ok:
        total = sum(r.tokens for r in report.prompts)
        agree = sum(r.agree for r in report.prompts)
        lines.append(
            f"OK: the engine (adapter unmerged) equals transformers + PEFT merged: max |logprob "
            f"diff| {report.max_diff:.2e} (atol {report.atol:g}), greedy tokens agree on "
            f"{agree}/{total} steps (the rest near-ties); the adapter moves the base's logprobs "
            f"by up to {report.effect:.3f}"
        )
    else:
        lines += [f"FAIL ({report.verdict}): {p}" for p in report.problems]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``loraplex verify``: 0 when the adapter checks out, 1 when it does not, 2 on bad input."""
    p = argparse.ArgumentParser(
        prog="loraplex verify",
        description="Check an adapter (engine, unmerged) against transformers + PEFT merged.",
        allow_abbrev=False,
    )
    p.add_argument("adapter", help="PEFT adapter directory")
    p.add_argument("--model", required=True, help="base model directory (HF format)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable; default: built-in)")
    p.add_argument("--prompts-file", help="one prompt per line")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--atol", type=float, default=1e-3, help="logprob tolerance (default 1e-3)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--json", action="store_true")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return int(e.code) if isinstance(e.code, int) else 2

    def fail(msg: str) -> int:
        print(f"loraplex verify: error: {msg}", file=sys.stderr)
        return 2

    adapter, model = Path(args.adapter), Path(args.model)
    if not (adapter / CONFIG_NAME).is_file():
        return fail(f"{adapter} is not a PEFT adapter directory (no {CONFIG_NAME})")
    if not (model / "config.json").is_file():
        return fail(f"{model} is not a model directory (no config.json)")
    if args.max_tokens < 1 or not args.atol > 0:
        return fail("--max-tokens must be >= 1 and --atol > 0")
    prompts = list(args.prompt or [])
    if args.prompts_file:
        try:
            prompts += [ln for ln in Path(args.prompts_file).read_text().splitlines() if ln.strip()]
        except OSError as e:
            return fail(f"cannot read {args.prompts_file}: {e.strerror or e}")
    try:
        report = verify_adapter(
            adapter, model, prompts=prompts or None, max_tokens=args.max_tokens, atol=args.atol,
            dtype=args.dtype,
        )  # fmt: skip
    except PlanError as e:
        return fail(str(e))
    print(json.dumps(asdict(report), indent=1) if args.json else render(report))
    return 0 if report.ok else 1
