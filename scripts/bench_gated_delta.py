"""Time the gated delta rule's backends on this machine's CPU: the paged decode step and one
sequence's prefill, at Qwen3.5-like shapes (16 key heads of 128, 16 or 32 value heads of 128,
convolution kernel 4, blocks of 16).

    python scripts/bench_gated_delta.py [--repeat 5] [--threads N] [--dtype bfloat16]

Every backend available on the CPU runs the same inputs side by side (the machine is shared:
compare the ratios within one run); each line is the median of ``--repeat`` runs after a
warm-up, with the largest difference of the backend's outputs from torch's. A backend whose
prefill is torch's (the C one: decode only) has no prefill line of its own.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from loraplex.model.attention import NO_PAGE, StateSpan
from loraplex.model.gated_delta_ops import DeltaDims, DeltaRule, TorchDeltaRule

BLOCK = 16


def _median_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _backends(dims: DeltaDims) -> dict[str, DeltaRule]:
    """torch, and the C kernel where it builds."""
    found: dict[str, DeltaRule] = {"torch": TorchDeltaRule(dims)}
    try:
        from loraplex.model.gated_delta_cpu import load_delta_rule_kernel
    except ImportError:
        return found
    c = load_delta_rule_kernel(dims)
    if c is not None:
        found[c.name] = c
    return found


def _inputs(dims: DeltaDims, n: int, pages: int, dtype: torch.dtype) -> tuple:
    g = torch.Generator().manual_seed(n)
    mixed = torch.randn(n, dims.conv_dim, generator=g).to(dtype)
    conv_w = (torch.randn(dims.conv_dim, dims.kernel, generator=g) / 2).to(dtype)
    decay = -torch.rand(n, dims.hv, generator=g)
    beta = torch.rand(n, dims.hv, generator=g)
    conv = torch.randn(pages, dims.conv_dim, dims.kernel - 1, generator=g).to(dtype)
    rec = torch.randn(pages, dims.hv, dims.dk, dims.dv, generator=g) * 0.1
    return mixed, conv_w, decay, beta, conv, rec


def bench_decode(dims: DeltaDims, batch: int, dtype: torch.dtype, repeat: int) -> None:
    """``batch`` decode rows, half of them moving to a new page (a block end), half staying."""
    mixed, conv_w, g, beta, conv, rec = _inputs(dims, batch, 2 * batch, dtype)
    src = torch.arange(batch)
    dst = torch.where(src % 2 == 0, src, src + batch)
    ref = None
    for name, rule in _backends(dims).items():
        c, r = conv.clone(), rec.clone()
        out = rule.decode(mixed, conv_w, g, beta, src, dst, c, r)
        err = 0.0 if ref is None else (out - ref).abs().max().item()
        ref = out if ref is None else ref
        ms = _median_ms(lambda: rule.decode(mixed, conv_w, g, beta, src, dst, c, r), repeat)  # noqa: B023
        print(f"decode  Hv={dims.hv:<3d} B={batch:<4d} {name:<8s} {ms:9.3f} ms  "
              f"max|d|={err:.1e}")  # fmt: skip


def bench_prefill(dims: DeltaDims, n: int, dtype: torch.dtype, repeat: int) -> None:
    """One fresh sequence of ``n`` tokens in one chunk: a snapshot at every block end."""
    nblk = -(-n // BLOCK)
    mixed, conv_w, g, beta, conv, rec = _inputs(dims, n, nblk, dtype)
    ends = [*range(BLOCK, n, BLOCK), n]
    span = StateSpan(0, n, 0, NO_PAGE, ends, list(range(nblk)))
    ref = None
    for name, rule in _backends(dims).items():
        if name != "torch" and type(rule).prefill is TorchDeltaRule.prefill:
            continue  # the torch prefill under another name
        out = rule.prefill(mixed, conv_w, g, beta, span, BLOCK, conv, rec)
        err = 0.0 if ref is None else (out - ref).abs().max().item()
        ref = out if ref is None else ref
        ms = _median_ms(
            lambda: rule.prefill(mixed, conv_w, g, beta, span, BLOCK, conv, rec),  # noqa: B023
            repeat,
        )
        print(f"prefill Hv={dims.hv:<3d} L={n:<5d} {name:<8s} {ms:9.3f} ms  "
              f"({ms * 1e3 / n:7.1f} us/token)  max|d|={err:.1e}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: its default)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--skip-prefill", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, model dtype {dtype}")
    for hv in (16, 32):
        dims = DeltaDims(hk=16, hv=hv, dk=128, dv=128, kernel=4)
        for batch in (1, 8, 32):
            bench_decode(dims, batch, dtype, args.repeat)
        if not args.skip_prefill:
            for n in (512, 2048):
                bench_prefill(dims, n, dtype, args.repeat)


if __name__ == "__main__":
    main()
