"""The benchmark's assets and request stream: a random Llama and N PEFT adapters (ranks 8/16/64
in turn, all seven projections) in a local object-store directory, built once and reused, and a
seeded Zipf stream of requests over the adapters."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

from loraplex.lora.peft.files import CONFIG_NAME as CONFIG_FILE
from loraplex.lora.peft.files import SAFETENSORS_NAME as WEIGHTS_FILE
from loraplex.tools.bench.throughput import SHAPE as H512_SHAPE

SHAPES: dict[str, dict[str, int]] = {
    "h512": dict(H512_SHAPE),
    "tiny": dict(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=512,
    ),
}
RANKS = (8, 16, 64)
BASE_NAME = "base"


def adapter_name(i: int) -> str:
    return f"a{i:03d}"


def adapter_rank(i: int) -> int:
    return RANKS[i % len(RANKS)]


def build_assets(root: Path, shape: str, n_adapters: int) -> tuple[Path, Path]:
    """(model dir, store dir) under ``root/shape``; built once, reused by later runs.

    One PEFT template adapter per rank comes from ``make_random_adapter``; adapter ``i`` is its
    rank's template with fresh seeded random A and B (same keys and config), written atomically.
    """
    import torch
    from safetensors.torch import load_file, save_file

    from loraplex.testing import ALL_PROJ, make_random_adapter, make_random_model

    base = root / shape
    model = base / "model"
    if not (model / "config.json").is_file():
        make_random_model(model, with_tokenizer=False, seed=0, init_std=0.02, **SHAPES[shape])
    templates = {}
    for r in RANKS:
        t = base / "templates" / f"r{r}"
        if not (t / WEIGHTS_FILE).is_file():
            make_random_adapter(
                model, t, r=r, lora_alpha=2 * r, target_modules=ALL_PROJ, seed=r, std=0.02
            )
        templates[r] = t
    store = base / "store"
    store.mkdir(parents=True, exist_ok=True)
    for i in range(n_adapters):
        dst = store / adapter_name(i)
        if (dst / WEIGHTS_FILE).is_file():
            continue
        t = templates[adapter_rank(i)]
        gen = torch.Generator().manual_seed(1000 + i)
        tensors = {
            k: 0.02 * torch.randn(v.shape, generator=gen, dtype=v.dtype)
            for k, v in load_file(str(t / WEIGHTS_FILE)).items()
        }
        tmp = store / f".tmp-{adapter_name(i)}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        shutil.copyfile(t / CONFIG_FILE, tmp / CONFIG_FILE)
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        os.rename(tmp, dst)
    return model, store


def zipf_stream(
    n_adapters: int, n_requests: int, s: float, seed: int, vocab: int
) -> list[tuple[int, int, list[int]]]:
    """Seeded ``(adapter index, popularity rank, prompt token ids)`` per request.

    Popularity rank k (0-based) has probability ~ 1/(k+1)^s; ranks map to adapters through a
    seeded permutation, so popularity is unrelated to adapter rank or registration order."""
    rng = random.Random(seed)
    perm = list(range(n_adapters))
    rng.shuffle(perm)
    weights = [1.0 / (k + 1) ** s for k in range(n_adapters)]
    ranks = rng.choices(range(n_adapters), weights=weights, k=n_requests)
    lo = min(100, vocab // 4)
    return [
        (perm[k], k, [rng.randrange(lo, vocab) for _ in range(rng.randint(4, 12))]) for k in ranks
    ]
