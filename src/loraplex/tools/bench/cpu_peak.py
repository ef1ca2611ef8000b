"""The CPU's arithmetic peak for a decode step's GEMMs: ``python -m loraplex.tools.bench.cpu_peak``.

A 16-sequence decode step multiplies every weight by 16 rows: ``2 * 16 * params`` flops. On a
CPU without AMX that arithmetic, not the weights' bytes, can be the binding limit, so the
benchmarks quote this compute floor beside the byte floor. Measured with ``native/cpu_peak.c``
(built like the engine's kernels): float32 FMAs, AVX512-BF16 pair dot products and
AVX512-VNNI int8 quad dot products (the arithmetic a W4A8 kernel would trade the bf16 dots
for: it only lowers the compute floor where its rate is above bf16's) on twelve independent
accumulators per thread, on torch's thread count, best of ``--rounds``.
"""

from __future__ import annotations

import argparse
import ctypes
import sys

import torch

from loraplex.native.build import SOURCE_DIR, build_library

SOURCE = SOURCE_DIR / "cpu_peak.c"
ACC = 12


def peak_gflops(kind: str, threads: int | None = None, rounds: int = 3) -> float | None:
    """G multiply-or-add operations per second of ``kind`` ("fp32-fma", "bf16-dot" or
    "int8-dot") over ``threads`` threads (default torch's), None where this CPU's build lacks
    the instruction."""
    lib = ctypes.CDLL(str(build_library(SOURCE, "cpu_peak")))
    fn = lib.loraplex_cpu_peak
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_double
    threads = threads or torch.get_num_threads()
    lanes, sink = ctypes.c_int(0), ctypes.c_float(0.0)
    iters = 20_000_000
    code = {"fp32-fma": 0, "bf16-dot": 1, "int8-dot": 2}[kind]
    per_lane = (2, 4, 8)[code]  # an FMA: 2 ops a lane; a bf16 pair dot: 4; an int8 quad dot: 8
    best = None
    for _ in range(rounds):
        s = fn(code, iters, threads, ctypes.byref(lanes), ctypes.byref(sink))
        if s < 0:
            return None
        flops = iters * ACC * threads * lanes.value * per_lane
        best = max(best or 0.0, flops / s / 1e9)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    threads = args.threads or torch.get_num_threads()
    for kind in ("fp32-fma", "bf16-dot", "int8-dot"):
        g = peak_gflops(kind, threads, args.rounds)
        unit = "GOP/s" if kind == "int8-dot" else "GFLOP/s"
        print(
            f"{kind:<9} {threads} threads: "
            + ("not in this build" if g is None else f"{g:.0f} {unit}")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
