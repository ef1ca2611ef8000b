"""The quantized GEMM kernels against the bf16 panel kernel, streaming real-sized weights.

Builds ``--layers`` layers of a Llama-3.2-1B-shaped model's projections (fused q/k/v, o,
fused gate/up, down: the weights a decode step streams from memory, more than the last-level
cache) as random bf16 weights, and times one pass over all of them at each row count for:

- ``bf16``: the panel GEMM kernel on the bf16 weights;
- ``int4``: the quantized GEMM kernel's 4-bit panels (W4A16: bf16 x, groups of ``--group-size``);
- ``w4a8``: its W4A8 panels (int8 x per token, AVX512-VNNI), where the CPU has it;
- ``bf16-torch``: torch's own bf16 GEMM on the same weights (oneDNN: AMX tiles where the CPU
  has them);
- ``int4-amx`` / ``w4a8-amx``: the same panels on AMX-BF16 / AMX-INT8 tiles, where the CPU has
  them (their second path, ``native/amx.h``).

The ratios are against the faster bf16 kernel at each row count.

Each pass is timed ``--repeats`` times, alternating the kernels; the median is reported with
the operations per second (2 x rows x weights) beside the CPU's measured peaks
(``loraplex.tools.bench.cpu_peak``): the bf16 dot products' for bf16 and int4, the int8 dots' for w4a8.

    .venv/bin/python scripts/bench_quant_kernels.py
    .venv/bin/python scripts/bench_quant_kernels.py --rows 1 16 --layers 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace

import torch

SHAPES = ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192))  # qkv, o, gate_up, down


def main(argv: list[str] | None = None) -> int:
    from loraplex.model.panel_gemm import PanelLinear, load_panel_kernel
    from loraplex.model.quant.cpu_kernel import load_qgemm
    from loraplex.model.quant.kernels import PanelQuantLinear, PanelW4A8Linear
    from loraplex.model.quant.weights import ActQuant, QuantWeight
    from loraplex.tools.bench.cpu_peak import peak_gflops

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--isa", default=None, help="the quantized kernel's build (amx-model: the "
                    "tiles' software model, to check this script's tile columns; slow)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kernel, quant = load_panel_kernel(), load_qgemm(isa=args.isa)
    if torch.bfloat16 not in kernel.dtypes:
        print("the panel kernel has no AVX512-BF16 path on this CPU: nothing to compare")
        return 1
    names = ["bf16", "bf16-torch", "int4"] + ["w4a8"] * quant.w4a8
    names += ["int4-amx"] * quant.amx + ["w4a8-amx"] * quant.amx_int8
    kinds: dict[str, list[tuple[object, int]]] = {name: [] for name in names}
    g = torch.Generator().manual_seed(0)
    for _ in range(args.layers):
        for n, k in SHAPES:
            w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
            qw = QuantWeight.quantize(w.float(), 4, args.group_size)
            kinds["bf16"].append((PanelLinear(kernel, w, None), k))
            kinds["bf16-torch"].append((lambda x, w=w: torch.nn.functional.linear(x, w), k))
            int4 = PanelQuantLinear(qw, torch.bfloat16, quant)
            kinds["int4"].append((int4, k))
            if "int4-amx" in kinds:
                kinds["int4-amx"].append((int4.alt, k))  # the same panels, on tiles
            if quant.w4a8:
                w4a8 = PanelW4A8Linear(replace(qw, act=ActQuant("int8")), quant)
                kinds["w4a8"].append((w4a8, k))
                if "w4a8-amx" in kinds:
                    kinds["w4a8-amx"].append((w4a8.alt, k))
    ops_per_row = 2 * args.layers * sum(n * k for n, k in SHAPES)
    peaks = {"bf16-dot": peak_gflops("bf16-dot"), "int8-dot": peak_gflops("int8-dot")}
    print(
        f"{args.layers} layers of {[list(s) for s in SHAPES]}, {torch.get_num_threads()} threads; "
        f"peaks: bf16 dots {peaks['bf16-dot']:.0f} GFLOP/s, "
        f"int8 dots {peaks['int8-dot'] or 0:.0f} GOP/s"
    )
    quantized = [name for name in kinds if not name.startswith("bf16")]
    print(f"{'rows':>5}" + "".join(f"{name + ' ms':>14}{'G/s':>7}{'peak':>6}" for name in kinds)
          + "".join(f"{name + '/bf16':>14}" for name in quantized))  # fmt: skip
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=g).bfloat16() for k in {k for _, k in SHAPES}}
        times: dict[str, list[float]] = {name: [] for name in kinds}
        for _ in range(args.repeats + 1):  # the first pass of each warms up
            for name, lins in kinds.items():
                t = time.perf_counter()
                for lin, k in lins:
                    lin(xs[k])  # type: ignore[operator]
                times[name].append(time.perf_counter() - t)
        med = {name: statistics.median(ts[1:]) for name, ts in times.items()}
        line = f"{rows:>5}"
        for name, s in med.items():
            rate = ops_per_row * rows / s / 1e9
            peak = peaks["int8-dot" if name.startswith("w4a8") else "bf16-dot"] or float("nan")
            line += f"{s * 1e3:>14.2f}{rate:>7.0f}{rate / peak:>6.0%}"
        best_bf16 = min(med["bf16"], med["bf16-torch"])
        line += "".join(f"{best_bf16 / med[name]:>13.2f}x" for name in quantized)
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
