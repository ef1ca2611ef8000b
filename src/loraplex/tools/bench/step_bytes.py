"""What a decode step reads, and the random adapters the step benchmarks use.

Shared by ``loraplex.tools.bench.profile_step`` and ``loraplex.tools.bench.throughput`` (which print every
measured ratio next to the byte bound these give).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from loraplex.engine.llm_engine import LLMEngine


def make_adapters(model_dir: Path, root: Path, n: int, rank: int, targets: list[str]) -> list[Path]:
    """``n`` random PEFT adapters for ``model_dir`` under ``root`` (made once, then reused)."""
    from loraplex.lora.peft.files import CONFIG_NAME
    from loraplex.testing import make_random_adapter

    out = []
    for i in range(n):
        d = root / f"adapter{i:02d}"
        if not (d / CONFIG_NAME).is_file():
            make_random_adapter(
                model_dir, d, r=rank, lora_alpha=2 * rank, target_modules=targets,
                seed=500 + i, std=0.02,
            )  # fmt: skip
        out.append(d)
    return out


def read_bandwidth_gbs(mib: int = 256) -> float:
    """Read bandwidth of a large float32 reduction (bytes read per second), in GB/s."""
    x = torch.randn(mib * 2**20 // 4)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def weight_bytes_per_step(engine: LLMEngine) -> int:
    """Base weights a decode step reads: every layer's projections and norms (however many
    its architecture has), the final norm and the LM head. A MoE layer's experts all count (an
    upper bound: a step reads only those its tokens chose; ``loraplex.tools.bench.moe`` counts
    those)."""
    m = engine.model
    return m.norm.nbytes + m.head.nbytes + sum(L.nbytes for L in m.layers)


def state_bytes_per_step(engine: LLMEngine, rows: int) -> int:
    """Recurrent-state bytes a decode step of ``rows`` sequences moves: each recurrent layer
    (a hybrid's linear attention) reads one state page per row and writes one (0 for an
    attention-only model)."""
    cache = engine.cache
    if cache.state_shape is None:
        return 0
    per_layer = cache.conv[:, 0].nbytes // cache.conv.shape[0]
    per_layer += cache.recurrent[:, 0].nbytes // cache.recurrent.shape[0]
    layers = sum(len(g.layers) for g in cache.groups if g.state)
    return 2 * rows * layers * per_layer


def adapter_bytes_per_step(engine: LLMEngine, slots: set[int]) -> int:
    """Bytes of the rank rows the step's adapters own in the modules they target (non-zero;
    every expert of a MoE layer's expert modules: an upper bound, as for the weights)."""
    if engine.adapters is None or not slots:
        return 0
    bank = engine.adapters.bank
    total = 0
    for slot in slots:
        rs, re = bank.slot_rows(slot)
        for key in bank.module_shapes:
            a, bt = bank.tables(*key)
            cap = bank.capacity
            for e in range(bank.module_experts.get(key, 1)):  # an expert module: each expert's
                if bool(a[e * cap + rs : e * cap + re].any()):
                    total += (re - rs) * (a.shape[1] + bt.shape[1]) * a.element_size()
    return total


def kv_bytes_per_step(engine: LLMEngine) -> int:
    """K and V bytes the running sequences' contexts occupy (read once per decode step)."""
    c = engine.model_config
    per_tok = 2 * c.num_layers * c.num_kv_heads * c.head_dim * engine.cache.k.element_size()
    return per_tok * sum(s.num_tokens for s in engine.running_sequences())
