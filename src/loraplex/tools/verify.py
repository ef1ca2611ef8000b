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

On a mixture-of-experts base (``Qwen3MoeForCausalLM``, ``MixtralForCausalLM``) the static check
also fits the router (``mlp.gate``: ``A [r, hidden]``, ``B [E, r]``) and the experts in either
layout: per-expert keys (``mlp.experts.{e}.gate_proj``, Mixtral's
``block_sparse_moe.experts.{e}.w1``: one expert's shapes, ``e`` below the base's expert count)
or PEFT's ``target_parameters`` on the packed experts (``mlp.experts[.base_layer].lora_A/B``:
``A [E r, d_in]``, ``B [d_out, E r]`` of ``gate_up_proj`` or ``down_proj``). The adapter is then
read with the engine's own loader (an expert projection as ``a [E, r, d_in]``,
``b [E, d_out, r]``): modules, and experts of an expert module, whose B is all zero do nothing
and are listed (experts a router never chose in training keep their initial zero B). Where
transformers + PEFT load less of the adapter than the engine serves (PEFT's conversion of
per-expert keys onto transformers 5's packed experts drops a dense layer's MLP LoRA, and loads
nothing for gate/up experts without down), the comparison would blame the engine for the
reference's gap: verify stops with ``no_reference`` naming the parts it cannot check.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplex.checkpoint.modules import (
    ATTN_PROJ_NAMES,
    EXPERT_CHECKPOINT_NAMES,
    PACKED_EXPERT_PARAMS,
    ROUTER,
    VOCAB_LAYER,
)
from loraplex.checkpoint.safetensors import SafetensorsError, safetensors_header
from loraplex.lora.peft.config import merge_writes_tied_matrix
from loraplex.lora.peft.files import BIN_NAME, CONFIG_NAME, SAFETENSORS_NAME
from loraplex.lora.peft.tensors import (
    EXPERT_KEY_RE,
    OTHER_TOWER_RE,
    PACKED_KEY_RE,
    ROUTER_KEY_RE,
    parse_tensor_key,
)
from loraplex.tools.plan import (
    PACKED_GATE_UP,
    PART_NAMES,
    PARTS,
    ModelShape,
    PlanError,
    adapter_from_config,
    model_from_config,
    part_of,
)

if TYPE_CHECKING:
    from loraplex.lora.adapter import LoRAAdapter

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
    verdict: str = ""  # ok | silent_no_op | wrong_base | disagreement | load_error | no_reference
    problems: list[str] = field(default_factory=list)
    rank: int = 0
    targets: list[str] = field(default_factory=list)
    modules: int = 0
    parts: dict[str, int] = field(default_factory=dict)  # modules by part (attention, experts, ...)
    experts: int = 0  # experts per expert module (0: none)
    expert_layout: str | None = None  # per_expert | packed | mixed
    notes: list[str] = field(default_factory=list)  # e.g. modules / experts whose B is all zero
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
        except (OSError, SafetensorsError) as e:
            raise PlanError(f"cannot read {st}: {e}") from None
    binf = adapter / BIN_NAME
    if binf.is_file():
        import torch

        sd = torch.load(binf, map_location="cpu", weights_only=True)
        return {k: list(v.shape) for k, v in sd.items()}
    raise PlanError(f"{adapter} has no {SAFETENSORS_NAME} or {BIN_NAME}")


def _expert_tensor(key: str, sh: list[int], m: ModelShape) -> tuple[tuple[int, str], str] | None:
    """A per-expert or router LoRA tensor of a MoE base: ((layer, module), problem or "");
    None when ``key`` is neither."""
    moe = m.moe
    assert moe is not None
    expert = EXPERT_KEY_RE.match(key)
    hit = expert or ROUTER_KEY_RE.match(key)
    if hit is None:
        return None
    layer, ab, proj = int(hit["layer"]), hit["ab"], ROUTER
    # transformers 5 names every sparse block mlp (Gemma 4's sits under the layer: "")
    if (hit["block"] or "") not in ("mlp", moe.block):
        return (layer, proj), (
            f"{key}: names the sparse block {hit['block']!r} (another architecture's); this "
            f"base's is {moe.block!r}"
        )
    if expert is not None:
        names = EXPERT_CHECKPOINT_NAMES[moe.block]  # the base's own names (Mixtral: w1 w3 w2)
        if expert["proj"] not in names:
            return (layer, expert["proj"]), (
                f"{key}: this base's experts have no {expert['proj']!r} (theirs: "
                f"{', '.join(names)}; made for another architecture?)"
            )
        proj = names[expert["proj"]]
        if int(expert["expert"]) >= moe.num_experts:
            return (layer, proj), (
                f"{key}: expert {expert['expert']} >= the base's {moe.num_experts} experts "
                "(made for a model with more experts?)"
            )
    if layer not in moe.layers:
        return (layer, proj), (
            f"{key}: layer {layer} has no sparse block (sparse layers: {list(moe.layers)})"
        )
    d_in, d_out = moe.shapes[proj]
    if ab == "A" and (len(sh) != 2 or sh[1] != d_in):
        return (layer, proj), f"{key}: shape {sh}, the base's {proj} takes d_in={d_in}"
    if ab == "B" and (len(sh) != 2 or sh[0] != d_out):
        return (layer, proj), f"{key}: shape {sh}, the base's {proj} gives d_out={d_out}"
    return (layer, proj), ""


def _packed_pair(
    layer: int,
    a: tuple[str, list[int]],
    b: tuple[str, list[int]],
    m: ModelShape,
    ranks: dict[tuple[int, str], int],
) -> tuple[list[tuple[int, str]], str]:
    """The expert modules one packed A/B pair (``target_parameters``) adapts, or a problem
    (``ranks``: the config's, (layer, module) -> rank)."""
    moe = m.moe
    assert moe is not None
    (a_key, sa), (_, sb) = a, b
    if layer not in moe.layers:
        return [], f"{a_key}: layer {layer} has no experts (sparse: {list(moe.layers)})"
    if len(sa) != 2 or len(sb) != 2 or sa[0] != sb[1]:
        return [], f"{a_key}: A {sa} and B {sb} are no LoRA pair (A [E r, d_in], B [d_out, E r])"
    n = moe.num_experts
    if sa[0] % n:
        return [], (
            f"{a_key}: {sa[0]} rows are no rank for each of the base's {n} experts (made for "
            "another expert count?)"
        )
    want = {p: (m.dims(q[0])[0], sum(m.dims(x)[1] for x in q))
            for p, q in PACKED_EXPERT_PARAMS.items()}  # fmt: skip
    if moe.packed_in_out:  # stored [E, in, out]: PEFT's A is [E r, out], its B [in, E r]
        want = {p: (o, i) for p, (i, o) in want.items()}
    for param, dims in want.items():
        if (sa[1], sb[0]) != dims:
            continue
        parts = PACKED_EXPERT_PARAMS[param]
        r = ranks.get((layer, PACKED_GATE_UP if len(parts) > 1 else parts[0]))
        if r is not None and sa[0] != n * r:
            return [], (
                f"{a_key}: {sa[0]} rows, the config's rank {r} for each of the base's {n} "
                f"experts makes {n * r} (made for {sa[0] / r:g} experts?)"
            )
        return [(layer, q) for q in parts], ""
    fits = ", ".join(f"{p} A [E r, {i}] B [{o}, E r]" for p, (i, o) in want.items())
    return [], f"{a_key}: A {sa} and B {sb} fit neither packed expert parameter ({fits})"


def static_check(adapter: Path, model_dir: Path, report: VerifyReport) -> None:
    """Targets vs the model's modules and tensor shapes vs the base; fills ``report``."""
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
            what = f"target_modules {cfg.get('target_modules')!r}"
            if cfg.get("target_parameters"):
                what += f" / target_parameters {cfg['target_parameters']!r}"
            report.problems.append(
                f"silent no-op: {what} match none of this model's modules "
                f"({', '.join(m.adapter_names)}); served, it would answer exactly like the base "
                "model"
            )
            return
        raise
    report.rank, report.targets, report.modules = shape.max_rank, shape.targets, len(shape.modules)
    counts = [part_of(proj) for _, proj in shape.modules]
    report.parts = {p: counts.count(p) for p in PARTS if p in counts}
    report.experts, report.expert_layout = shape.adapted_experts, shape.expert_layout
    wrong: list[str] = []
    seen: set[tuple[int, str]] = set()
    packed: dict[tuple[int, int], dict[str, tuple[str, list[int]]]] = {}
    sparse = set(m.sparse)
    for key, sh in sorted(_tensor_shapes(adapter).items()):
        if m.text_only and OTHER_TOWER_RE.match(key):
            continue  # a multimodal base's other towers: never served, never checked
        if m.is_moe:
            if (hit := PACKED_KEY_RE.match(key)) is not None:
                depth = hit["inner"].count(".base_layer")
                packed.setdefault((int(hit["layer"]), depth), {})[hit["ab"]] = (key, sh)
                continue
            found = _expert_tensor(key, sh, m)
            if found is not None:
                if found[1]:
                    wrong.append(found[1])
                else:
                    seen.add(found[0])
                continue
        k = parse_tensor_key(key)
        if k is None:
            if "lora_" in key:
                wrong.append(f"{key}: not a LoRA of a module this model serves")
            continue
        layer, proj, ab = k.layer, k.proj, k.ab
        known = (
            proj in m.outer_modules
            if layer == VOCAB_LAYER
            else proj in m.layer_adapter_projs(min(layer, m.num_layers - 1))
        )
        if layer in sparse and proj in m.layer_projs(layer):
            known = True  # a sparse layer's shared expert
        elif layer in sparse and proj not in ATTN_PROJ_NAMES:
            wrong.append(
                f"{key}: layer {layer}'s MLP is {m.num_experts} experts and a router (no {proj})"
            )
            continue
        if not known or layer >= m.num_layers:
            wrong.append(f"{key}: the model has no such module ({m.num_layers} layers)")
            continue
        d_in, d_out = m.dims(proj, layer)
        if ab == "A" and (len(sh) != 2 or sh[1] != d_in):
            wrong.append(f"{key}: shape {sh}, the base's {proj} takes d_in={d_in}")
        elif ab == "B" and (len(sh) != 2 or sh[0] != d_out):
            wrong.append(f"{key}: shape {sh}, the base's {proj} gives d_out={d_out}")
        seen.add((layer, proj))
    for (layer, _), pair in sorted(packed.items()):
        if set(pair) != {"A", "B"}:
            key = next(iter(pair.values()))[0]
            wrong.append(f"{key}: a packed expert LoRA without its lora_{'AB'[('A' in pair)]}")
            continue
        modules, problem = _packed_pair(layer, pair["A"], pair["B"], m, shape.modules)
        if problem:
            wrong.append(problem)
        seen.update(modules)
    if wrong:
        report.verdict = "wrong_base"
        base = f"hidden {m.hidden_size}, {m.num_layers} layers, intermediate {m.intermediate_size}"
        if m.is_moe:
            base += (
                f", {m.num_experts} experts of intermediate {m.moe_intermediate_size} in layers "
                f"{list(m.sparse)}"
            )
        report.problems.append(
            f"wrong base: {len(wrong)} LoRA tensors do not fit {model_dir} ({base}); first: "
            + "; ".join(wrong[:3])
        )
    elif not seen:
        report.verdict = "silent_no_op"
        report.problems.append(
            "silent no-op: the weights file holds no LoRA tensors for this model's modules"
        )


def _load_served(adapter: Path, model_dir: Path, rank: int) -> LoRAAdapter:
    """The adapter as the engine's loader reads it (``AdapterError`` when it refuses it)."""
    import torch

    from loraplex.checkpoint.modules import BaseModelSpec
    from loraplex.lora.adapter import load_peft_adapter

    spec = BaseModelSpec.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    return load_peft_adapter(adapter, spec, max_lora_rank=max(rank, 1), dtype=torch.float32)


def _zero_b(adapter: LoRAAdapter, report: VerifyReport) -> bool:
    """True when every B of the served adapter is zero; notes the modules, and the experts of
    an expert module (``b [E, d_out, r]``), whose B is all zero (no effect)."""
    zero_modules: list[str] = []
    zero_experts: list[str] = []
    live = False
    for (layer, proj), w in adapter.weights.items():
        where = proj if layer == VOCAB_LAYER else f"layer {layer} {proj}"
        if w.b.dim() == 3:  # an expert projection: every expert's B
            dead = int((w.b.flatten(1) == 0).all(dim=1).sum())
            live |= dead < w.b.shape[0]
            if dead == w.b.shape[0]:
                zero_modules.append(where)
            elif dead:
                zero_experts.append(f"{where}: {dead} of {w.b.shape[0]}")
        elif bool((w.b == 0).all()):
            zero_modules.append(where)
        else:
            live = True
    if live and zero_modules:
        report.notes.append(
            f"{len(zero_modules)} of {len(adapter.weights)} modules have an all-zero B (no "
            f"effect): {', '.join(zero_modules[:6])}{', ...' if len(zero_modules) > 6 else ''}"
        )
    if live and zero_experts:
        report.notes.append(
            "experts with an all-zero B (not adapted, or never routed to in training): "
            + "; ".join(zero_experts[:6])
            + ("; ..." if len(zero_experts) > 6 else "")
        )
    return not live


def _lora_part(name: str) -> tuple[int, str] | None:
    """(layer, part) of a LoRA parameter or tensor name (a PEFT model's or a file's)."""
    for regex, part in ((EXPERT_KEY_RE, "experts"), (PACKED_KEY_RE, "experts"),
                        (ROUTER_KEY_RE, "router")):  # fmt: skip
        if (hit := regex.match(name)) is not None:
            return int(hit["layer"]), part
    k = parse_tensor_key(name)
    return None if k is None else (k.layer, part_of(k.proj))


def _reference_gaps(adapter: LoRAAdapter, peft: Any) -> list[str]:
    """The (layer, part)s the engine serves with a non-zero B that the transformers + PEFT
    reference holds no non-zero LoRA B for: what the comparison could not check."""
    served = {
        (layer, part_of(proj))
        for (layer, proj), w in adapter.weights.items()
        if bool((w.b != 0).any())
    }
    ref = set()
    for name, t in peft.named_parameters():
        if ".lora_B" in name or ".lora_embedding_B" in name:
            where = _lora_part(name)
            if where is not None and bool((t != 0).any()):
                ref.add(where)
    gaps = sorted(served - ref)
    return [
        PART_NAMES[part] if layer == VOCAB_LAYER else f"layer {layer} {PART_NAMES[part]}"
        for layer, part in gaps
    ]


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
    try:
        served = _load_served(a_dir, m_dir, report.rank)  # the engine's loader, as it serves it
    except LoraplexError as e:
        report.verdict = "load_error"
        report.problems.append(f"the engine refused the adapter: {e}")
        return report
    if _zero_b(served, report):
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
        tok = llm.get_tokenizer()
        # an activated LoRA applies from its invocation on: each prompt ends with it
        invocation = list(served.alora_invocation_tokens or ())
        prompt_ids = [tok(p).input_ids + invocation for p in prompts]
        outs = llm.generate(
            [{"prompt_token_ids": ids} for ids in prompt_ids],
            params,
            lora_request=LoRARequest("verify", str(a_dir)),
        )
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
    gaps = _reference_gaps(served, peft)
    if gaps:
        report.verdict = "no_reference"
        report.problems.append(
            f"no reference: transformers + PEFT load no LoRA for {', '.join(gaps)} of this "
            "adapter, which the engine serves, so the engine cannot be checked against it "
            "(known gaps of PEFT's conversion of per-expert keys onto transformers 5's packed "
            "experts: a dense layer's MLP LoRA, gate/up experts without down_proj)"
        )
        return report
    seqs = [ids + o.outputs[0].token_ids for ids, o in zip(prompt_ids, outs, strict=True)]

    @torch.no_grad()
    def score(model: Any, alora: bool = False) -> list[torch.Tensor]:
        rows = []
        for ids, seq, o in zip(prompt_ids, seqs, outs, strict=True):
            # PEFT's aLoRA: the last len(seq) - start positions adapted (start: the invocation)
            kw = {"alora_offsets": [len(seq) - len(ids) + len(invocation)]} if alora else {}
            logits = model(torch.tensor([seq]), **kw).logits[0].float()
            n = len(o.outputs[0].token_ids)
            rows.append(torch.log_softmax(logits[len(ids) - 1 : len(ids) - 1 + n], dim=-1))
        return rows

    with peft.disable_adapter():
        base_lp = score(peft)
    adapter_cfg = json.loads((a_dir / CONFIG_NAME).read_text())
    if invocation:
        ref_lp = score(peft, alora=True)  # an aLoRA is never merged
    elif merge_writes_tied_matrix(adapter_cfg, json.loads((m_dir / "config.json").read_text())):
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
        parts = ""
        if set(report.parts) & {"router", "experts"}:
            layout = {"packed": "packed, target_parameters", "mixed": "packed and per-expert"}
            layout_of = layout.get(str(report.expert_layout), "per-expert keys")
            each = {"experts": f" ({report.experts} experts each, {layout_of})"}
            parts = "; " + ", ".join(
                f"{PART_NAMES[p]} {n}{each.get(p, '')}" for p, n in report.parts.items()
            )
        lines.append(
            f"rank {report.rank}, {report.modules} modules ({','.join(report.targets)}{parts}){fit}"
        )
    lines += [f"note: {n}" for n in report.notes]
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
