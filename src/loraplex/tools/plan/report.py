"""The plan as text: the model, each adapter's bytes (by part on a MoE base), the device slot
against KV-cache tokens, the budgets and the decode table."""

from __future__ import annotations

from typing import Any

from loraplex.tools.plan.adapter_shape import PART_NAMES


def _h(n: float) -> str:
    """Bytes for people: 13.0 MiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _parts_line(r: dict[str, Any]) -> str:
    """An adapter's bytes by part, the experts' share of them said plainly."""
    parts = ", ".join(f"{PART_NAMES[p]} {_h(n)}" for p, n in r["parts"].items())
    line = f"{'':<24}  parts: {parts}"
    if "experts" in r["parts"]:
        layout = {"packed": "packed target_parameters", "mixed": "packed and per-expert"}.get(
            r["expert_layout"], "per-expert keys"
        )
        line += (
            f" ({r['adapted_experts']} experts per expert module, {layout}); "
            f"experts: {100 * r['experts_share']:.0f}% of this adapter's bytes"
        )
    return line


def render_plan(plan: dict[str, Any]) -> str:
    """The whole plan as text (the pipeline estimate last, when asked for)."""
    text = _render_capacity(plan)
    if "pipeline" in plan:
        text += "\n\n" + _render_pipeline(plan["pipeline"])
    return text


def _render_pipeline(p: dict[str, Any]) -> str:
    """A pipeline of adapters over one context: each step's prefill, standard vs as served."""
    out = [
        f"pipeline over one {p['context']}-token context (the base answers, then each step adds "
        f"{p['question']} tokens; {p['block_size']}-token blocks):",
        f"{'step':<24}{'kind':>8}{'standard LoRA':>15}{'as served':>11}",
    ]
    for s in p["steps"]:
        kind = "aLoRA" if s["alora"] else "LoRA"
        out.append(f"{s['name'][:24]:<24}{kind:>8}{s['standard_tokens']:>15,}{s['tokens']:>11,}")
    out.append(
        f"prefill tokens {p['prefill_tokens']:,} of {p['standard_prefill_tokens']:,} "
        f"({100 * p['prefill_ratio']:.1f}%); prefill {p['prefill_flops'] / 1e12:.2f} of "
        f"{p['standard_prefill_flops'] / 1e12:.2f} TFLOP; the steps' KV "
        f"{_h(p['kv_bytes'])} of {_h(p['standard_kv_bytes'])}"
    )
    return "\n".join(out)


def _render_capacity(plan: dict[str, Any]) -> str:
    m, d, s, dec = plan["model"], plan["device"], plan["storage"], plan["decode"]
    moe = m["num_experts"] > 0
    inter = f"intermediate {m['intermediate_size']}"
    if moe:
        n_sparse = len(m["sparse_layers"])
        dense = m["num_layers"] - n_sparse
        inter = (
            f"{n_sparse} sparse layer{'s' * (n_sparse != 1)} of {m['num_experts']} experts "
            f"(top-{m['num_experts_per_tok']}, intermediate {m['moe_intermediate_size']})"
            + (f" and {dense} dense (intermediate {m['intermediate_size']})" if dense else "")
        )
    out = [
        f"model {m['name']}: {m['num_layers']} layers, hidden {m['hidden_size']}, heads "
        f"{m['num_heads']}/{m['num_kv_heads']} kv x {m['head_dim']}, {inter}, vocab "
        f"{m['vocab_size']}; {m['params']:,} parameters = {_h(m['weight_bytes'])} in {m['dtype']}"
        + (
            f" with {m['quantization']} projections ({m['projection_bytes_per_param']:.3f} "
            "bytes a weight; embedding, norms and head in the dtype)"
            if m.get("quantization")
            else ""
        ),
    ]
    if moe:
        out.append(
            f"  experts: {_h(m['expert_weight_bytes'])} of the weights; a token reads "
            f"{m['active_params']:,} parameters ({_h(m['active_weight_bytes'])}: "
            f"{m['num_experts_per_tok']} of {m['num_experts']} experts per sparse layer)"
        )
    out += ["", f"{'adapter':<24}{'rank':>5}{'layers':>7}{'parameters':>14}{'bytes':>12}  targets"]
    for r in plan["adapters"]:
        out.append(
            f"{r['name'][:24]:<24}{r['rank']:>5}{r['layers']:>7}{r['params']:>14,}"
            f"{_h(r['bytes']):>12}  {','.join(r['targets'])}"
        )
        if moe and set(r["parts"]) & {"router", "experts"}:
            out.append(_parts_line(r))
        if r["file_bytes"] is not None:
            out.append(f"{'':<24}  file: {r['file_params']:,} parameters, {_h(r['file_bytes'])}")
        out += [f"{'':<24}  note: {n}" for n in r["notes"]]
    serve = f"loraplex serve allocates {_h(d['engine_slot_bytes'])} per slot (every projection"
    if moe:
        serve += (
            f", the router ({_h(d['engine_router_slot_bytes'])}) and all {m['num_experts']} "
            f"experts of each expert projection ({_h(d['engine_expert_slot_bytes'])})"
        )
    out += [
        "",
        f"device slot (rank {d['max_lora_rank']}, {','.join(d['slot_targets'])}): "
        f"{_h(d['slot_bytes'])} = {d['kv_tokens_per_slot']:.1f} KV-cache tokens "
        f"({_h(d['kv_bytes_per_token'])}/token)",
        f"{serve}, and {_h(d['engine_vocab_slot_bytes'])} for embed_tokens + lm_head)",
        "KV per decoding sequence (block 16; windowed layers hold their window): "
        + ", ".join(f"{n:,} tokens {_h(v)}" for n, v in d["kv_bytes_per_sequence"].items()),
    ]
    if "budget" in d:
        out.append(
            f"device budget {_h(d['budget'])}: {d['slots_in_budget']} slots, forgoing "
            f"{d['kv_tokens_forgone']:,.0f} KV tokens"
        )
    if "slots" in d:
        out.append(
            f"{d['slots']} slots: {_h(d['slots_bytes'])}, forgoing "
            f"{d['slots_kv_tokens_forgone']:,.0f} KV tokens"
        )
    if "num_adapters" in s:
        out.append(
            f"{s['num_adapters']:,} adapters: host {_h(s['host_bytes_needed'])}, disk "
            f"{_h(s['disk_bytes_needed'])}"
        )
    if "host_budget" in s:
        out.append(f"host budget {_h(s['host_budget'])}: {s['adapters_in_host']:,} adapters")
    if "disk_budget" in s:
        out.append(f"disk budget {_h(s['disk_budget'])}: {s['adapters_on_disk']:,} adapters")
    out.append("")
    if not moe:
        out += [
            f"decode step: base weights read {_h(dec['base_bytes_per_step'])}; k distinct "
            "adapters in the batch add:",
            f"{'k':>6}{'extra bytes':>14}{'of base':>10}",
        ]
        for r in dec["rows"]:
            out.append(f"{r['k']:>6}{_h(r['extra_bytes']):>14}{100 * r['share_of_base']:>9.2f}%")
        return "\n".join(out)
    e, topk, batch = m["num_experts"], m["num_experts_per_tok"], dec["decode_batch"]
    out += [
        f"decode step: a token reads {topk} of {e} experts per sparse layer, a step of T tokens "
        f"at most min({e}, T x {topk}) (an upper bound: each token taken to choose experts no "
        "other token chose)",
        f"base weights read: one token {_h(dec['base_bytes_per_step'])}; a full batch of {batch} "
        f"tokens ({dec['experts_read_per_layer']['full_batch']} experts per sparse layer) "
        f"{_h(dec['base_bytes_full_batch'])}",
        "k distinct adapters in the batch add (one token each: a batch of k tokens; full batch: "
        f"its {batch} tokens shared evenly by the k adapters, each reading the LoRA of the "
        "experts its tokens choose):",
        f"{'k':>6}{'base read':>12}{'extra bytes':>14}{'of base':>10}"
        f"{'batch base':>13}{'batch extra':>13}{'of base':>10}",
    ]
    for r in dec["rows"]:
        out.append(
            f"{r['k']:>6}{_h(r['base_bytes']):>12}{_h(r['extra_bytes']):>14}"
            f"{100 * r['share_of_base']:>9.2f}%{_h(r['base_bytes_full_batch']):>13}"
            f"{_h(r['extra_bytes_full_batch']):>13}{100 * r['share_of_base_full_batch']:>9.2f}%"
        )
    return "\n".join(out)
