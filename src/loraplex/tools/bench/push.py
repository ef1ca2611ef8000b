"""Push-to-first-token latency of adapter pushes, in-process and over HTTP, and the decode
throughput of other streams while pushes arrive: ``python -m loraplex.tools.bench.push``.

Models: random weights at SmolLM2-135M's shape (hidden 576, 30 layers, 9/3 heads, MLP 1536,
vocab 49152) and Llama-3.2-1B's (hidden 2048, 16 layers, 32/8 heads, MLP 8192; its vocabulary
is ``--llama-vocab``, 128256 in the real model: only the LM head's cost depends on it), built
once under ``--cache-dir``. Adapters: random PEFT state dicts on all seven projections of every
layer, ranks ``--ranks`` (default 16 and 64), in the engine's dtype.

- **in-process**: ``LLM.add_lora(LoRARequest(name, lora_tensors=..., peft_config=...))`` then
  one request on that name until its first token; beside it the first token of the same
  request with the adapter already resident (what the push adds is the difference).
- **HTTP**: ``POST /v1/admin/adapters/{name}/push`` (body pre-encoded, as a trainer sends it)
  then ``POST /v1/completions`` with ``max_tokens=1``, timed at the client; the push's own
  answer time beside it.
- **decode under pushes** (HTTP): ``--streams`` concurrent completions of ``--tokens`` tokens
  on a resident adapter, with no pushes and with rank-16 pushes (bodies encoded beforehand)
  every ``--push-gaps`` seconds (0: back to back) in a thread, A B A B; aggregate tokens/s of
  the streams (best of two) and the pushes made meanwhile.

Each latency is the median of ``--repeats`` pushes of fresh weights (a new revision each).
Numbers, not assertions: these machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                         intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True),
    "llama-1b": dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                     intermediate_size=8192, tie_word_embeddings=True),
}  # fmt: skip
PROJ = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
        "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip
PROMPT = list(range(100, 116))  # 16 prompt tokens
ADMIN_KEY = "sk-bench-push"


def build_model(root: Path, shape: str, llama_vocab: int) -> Path:
    from loraplex.testing import make_random_model

    kw = dict(SHAPES[shape])
    if shape == "llama-1b":
        kw["vocab_size"] = llama_vocab
    out = root / f"{shape}-v{kw['vocab_size']}"
    if not (out / "config.json").is_file():
        make_random_model(out, "llama", with_tokenizer=False, seed=0, init_std=0.02,
                          dtype=torch.bfloat16, **kw)  # fmt: skip
    return out


def adapter_dims(model: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """(layers, proj -> (d_in, d_out)) of the model in ``model``."""
    c = json.loads((model / "config.json").read_text())
    h, inter = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * (c.get("head_dim") or h // c["num_attention_heads"])
    dims = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}  # fmt: skip
    return c["num_hidden_layers"], dims


def random_adapter(
    model: Path, rank: int, seed: int, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A PEFT LoRA state dict (PEFT's key names) on every projection, and its config."""
    layers, dims = adapter_dims(model)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for proj, (d_in, d_out) in dims.items():
            key = f"base_model.model.model.layers.{i}.{PROJ[proj]}.{proj}"
            tensors[f"{key}.lora_A.weight"] = (0.02 * torch.randn(rank, d_in, generator=g)).to(
                dtype
            )
            tensors[f"{key}.lora_B.weight"] = (0.02 * torch.randn(d_out, rank, generator=g)).to(
                dtype
            )
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": sorted(PROJ), "task_type": "CAUSAL_LM"}  # fmt: skip
    return tensors, config


def _ms(xs: list[float]) -> float:
    return 1000 * statistics.median(xs)


def bench_in_process(model: Path, ranks: list[int], repeats: int, dtype: str) -> list[dict]:
    from loraplex import LLM, LoRARequest, SamplingParams

    tdtype = getattr(torch, dtype)
    llm = LLM(str(model), enable_lora=True, max_loras=4, max_lora_rank=max(ranks), dtype=dtype,
              max_cpu_loras=8, skip_tokenizer_init=True)  # fmt: skip
    engine = llm.engine
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ids = iter(range(1 << 30))

    def first_token(name: str) -> None:
        rid = f"b{next(ids)}"
        engine.add_request(rid, PROMPT, one, LoRARequest(name))
        while not any(o.request_id == rid and o.outputs[0].token_ids for o in engine.step()):
            pass
        while engine.has_unfinished_requests():
            engine.step()

    rows = []
    for rank in ranks:
        pushes, totals, resident = [], [], []
        for k in range(repeats + 1):  # the first round warms up (slot, kernels)
            tensors, config = random_adapter(model, rank, 1000 * rank + k, tdtype)
            lr = LoRARequest(f"live-r{rank}", lora_tensors=tensors, peft_config=config,
                             revision=f"step-{k}")  # fmt: skip
            t0 = time.perf_counter()
            llm.add_lora(lr)
            t1 = time.perf_counter()
            first_token(lr.name)
            t2 = time.perf_counter()
            first_token(lr.name)  # the same revision again: resident
            t3 = time.perf_counter()
            if k:
                pushes.append(t1 - t0)
                totals.append(t2 - t0)
                resident.append(t3 - t2)
        mb = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20
        rows.append({"path": "in-process", "rank": rank, "MiB": round(mb, 1),
                     "push_ms": _ms(pushes), "push_to_first_token_ms": _ms(totals),
                     "first_token_resident_ms": _ms(resident)})  # fmt: skip
    return rows


def _encode(tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> tuple[bytes, dict]:
    from safetensors.torch import save

    body = save(tensors)
    headers = {
        "Content-Type": "application/octet-stream",
        "X-Loraplex-Adapter-Config": base64.b64encode(json.dumps(config).encode()).decode(),
        "X-Loraplex-Body-SHA256": hashlib.sha256(body).hexdigest(),
    }
    return body, headers


def bench_http(
    model: Path,
    ranks: list[int],
    repeats: int,
    dtype: str,
    streams: int,
    tokens: int,
    push_gaps: list[float],
) -> tuple[list[dict], dict]:
    import httpx

    from loraplex.config import EngineConfig, ServerConfig
    from loraplex.server.app import create_app
    from loraplex.testing.server import serve_in_thread

    tdtype = getattr(torch, dtype)
    config = ServerConfig(
        EngineConfig(model=str(model), enable_lora=True, max_loras=4, max_cpu_loras=8,
                     max_lora_rank=max(ranks), dtype=dtype, skip_tokenizer_init=True,
                     max_num_seqs=max(streams + 1, 4)),
        served_model_name=["base"], log_level="warning", admin_api_key=ADMIN_KEY,
    )  # fmt: skip
    app = create_app(config)
    rows = []
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=600, headers=auth) as c:

        def push(name: str, rank: int, seed: int, label: str | None) -> float:
            body, headers = _encode(*random_adapter(model, rank, seed, tdtype))
            return send(name, body, headers, label)

        def send(name: str, body: bytes, headers: dict[str, str], label: str | None) -> float:
            if label is not None:
                headers = {**headers, "X-Loraplex-Revision": label}
            t0 = time.perf_counter()
            r = c.post(f"/v1/admin/adapters/{name}/push", content=body, headers=headers)
            assert r.status_code == 201, r.text
            return t0

        def first(name: str) -> None:
            r = c.post("/v1/completions", json={"model": name, "prompt": PROMPT,
                                                "max_tokens": 1, "ignore_eos": True})  # fmt: skip
            assert r.status_code == 200, r.text

        for rank in ranks:
            pushes, totals = [], []
            for k in range(repeats + 1):
                t0 = push(f"live-r{rank}", rank, 1000 * rank + k, f"step-{k}")
                t1 = time.perf_counter()
                first(f"live-r{rank}")
                t2 = time.perf_counter()
                if k:
                    pushes.append(t1 - t0)
                    totals.append(t2 - t0)
            rows.append({"path": "http", "rank": rank, "push_ms": _ms(pushes),
                         "push_to_first_token_ms": _ms(totals)})  # fmt: skip
        # the pushes' bodies made before the rounds: the client's own work stays out of them
        bodies = [_encode(*random_adapter(model, 16, 50_000 + i, tdtype)) for i in range(12)]
        push("steady", 16, 7, "v1")
        decode = {
            f"every {gap:g}s" if gap else "back to back": _decode_under_pushes(
                c, lambda i: send("churn", *bodies[i % len(bodies)], None), streams, tokens, gap
            )
            for gap in push_gaps
        }
    return rows, decode


def _decode_under_pushes(c: Any, push: Any, streams: int, tokens: int, gap: float) -> dict:
    """Aggregate tokens/s of ``streams`` concurrent completions on a resident adapter, without
    and with pushes to another name every ``gap`` seconds (0: back to back), A B A B; each
    push sends one of a dozen pre-encoded bodies (new bytes to the registry each time it comes
    round: pruned revisions are gone)."""
    count = iter(range(1 << 30))

    def one_round(with_pushes: bool) -> tuple[float, int]:
        stop = threading.Event()
        n_push = [0]

        def pusher() -> None:
            while not stop.is_set():
                push(next(count))
                n_push[0] += 1
                stop.wait(gap)

        def stream(out: list[int]) -> None:
            r = c.post("/v1/completions", json={"model": "steady", "prompt": PROMPT,
                                                "max_tokens": tokens, "ignore_eos": True})  # fmt: skip
            out.append(r.json()["usage"]["completion_tokens"])

        got: list[int] = []
        th = [threading.Thread(target=stream, args=(got,)) for _ in range(streams)]
        p = threading.Thread(target=pusher) if with_pushes else None
        if p:
            p.start()
        t0 = time.perf_counter()
        for t in th:
            t.start()
        for t in th:
            t.join()
        dt = time.perf_counter() - t0
        stop.set()
        if p:
            p.join()
        return sum(got) / dt, n_push[0]

    rates: dict[str, list[float]] = {"no pushes": [], "pushes": []}
    pushed = 0
    for with_pushes in (False, True, False, True):
        rate, n = one_round(with_pushes)
        rates["pushes" if with_pushes else "no pushes"].append(rate)
        pushed += n
    return {k: round(max(v), 1) for k, v in rates.items()} | {"pushes_during": pushed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", default="/tmp/loraplex-bench-push")
    ap.add_argument("--shapes", default="smollm2-135m,llama-1b")
    ap.add_argument("--ranks", default="16,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--llama-vocab", type=int, default=128256)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--no-http", action="store_true")
    ap.add_argument("--push-gaps", default="0,1", help="seconds between pushes (0: back to back)")
    args = ap.parse_args(argv)
    root = Path(args.cache_dir)
    ranks = [int(r) for r in args.ranks.split(",")]
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for shape in args.shapes.split(","):
        model = build_model(root, shape, args.llama_vocab)
        for row in bench_in_process(model, ranks, args.repeats, args.dtype):
            print(json.dumps({"shape": shape, **row}), flush=True)
        if not args.no_http:
            gaps = [float(g) for g in args.push_gaps.split(",")]
            rows, decode = bench_http(model, ranks, args.repeats, args.dtype, args.streams,
                                      args.tokens, gaps)  # fmt: skip
            for row in rows:
                print(json.dumps({"shape": shape, **row}), flush=True)
            print(json.dumps({"shape": shape, "decode_tok_s": decode}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
