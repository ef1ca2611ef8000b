"""GPT-OSS's MXFP4 experts: dequantized at load (what loraplex does) against kept narrow.

Builds ``--experts`` random MXFP4 experts of gpt-oss-20b's shape (``gate_up [2 I, D]``,
``down [D, I]``, D = INTER = 2880; more bytes than the last-level cache, as a decode step streams
them) and times one pass over all of them at each row count (a decode step's rows per expert)
through:

- ``bf16 mm``: the experts dequantized at load to bf16, ``torch.mm`` (the grouped-experts
  path loraplex runs on CPU today);
- ``bf16 panel``: the same weights on the dense layers' bf16 panel kernel;
- ``mxfp4 deq``: kept MXFP4, dequantized on every call (``dequantize_mxfp4``) then ``mm``:
  keeping 4 bits without a kernel of its own;
- ``int8 g32``: MXFP4 rewritten *exactly* as int8 groups of 32 (an e2m1 value times two is an
  integer in [-12, 12]; the e8m0 scale halved is the group's scale) on the quantized panel
  kernel: 1.125 bytes a weight, bit-identical products;
- ``int4 g32``: the quantized panel kernel's 4-bit path at MXFP4's byte count (0.625 bytes a
  weight: a stand-in for the speed a grouped MXFP4 kernel would reach; e2m1 is not int4's
  uniform grid, so these are not GPT-OSS's values).

Resident bytes per expert are printed for each. The median of ``--repeats`` alternating
passes is reported.

    .venv/bin/python scripts/bench_mxfp4.py
    .venv/bin/python scripts/bench_mxfp4.py --experts 4 --rows 1 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

D = INTER = 2880  # gpt-oss-20b's hidden and expert widths


def mxfp4_to_int8(blocks: torch.Tensor, scales: torch.Tensor) -> object:
    """MXFP4 ``blocks [N, G, 16]`` / ``scales [N, G]`` as an exact int8 ``QuantWeight`` in
    groups of 32: ``q = 2 * e2m1`` (an integer in [-12, 12]), ``scale = 2 ** (e - 128)``."""
    from loraplex.model.gpt_oss import FP4_VALUES
    from loraplex.model.quant.weights import QuantWeight

    lut = torch.tensor([int(2 * v) for v in FP4_VALUES], dtype=torch.int8)
    b = blocks.to(torch.uint8)
    q = torch.stack((lut[(b & 0x0F).int()], lut[(b >> 4).int()]), dim=-1).flatten(-3)  # [N, K]
    s = torch.ldexp(torch.ones_like(scales, dtype=torch.float32), scales.int() - 128)  # [N, G]
    return QuantWeight(q.contiguous(), 8, s.contiguous(), None, 32)


def main(argv: list[str] | None = None) -> int:
    from loraplex.model.gpt_oss import dequantize_mxfp4
    from loraplex.model.panel_gemm import PanelLinear, load_panel_kernel
    from loraplex.model.quant.cpu_kernel import load_qgemm
    from loraplex.model.quant.kernels import PanelQuantLinear
    from loraplex.model.quant.weights import QuantWeight

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    panel, qgemm = load_panel_kernel(), load_qgemm()
    if torch.bfloat16 not in panel.dtypes:
        print("the panel kernels have no AVX512-BF16 path on this CPU: nothing to compare")
        return 1
    g = torch.Generator().manual_seed(0)
    kinds: dict[str, list] = {
        k: [] for k in ("bf16 mm", "bf16 panel", "mxfp4 deq", "int8 g32", "int4 g32")
    }
    nbytes = dict.fromkeys(kinds, 0)
    for _ in range(args.experts):
        for n, k in ((2 * INTER, D), (D, INTER)):
            blocks = torch.randint(0, 256, (n, k // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(118, 124, (n, k // 32), generator=g, dtype=torch.uint8)
            w = dequantize_mxfp4(blocks, scales).reshape(n, k).bfloat16()  # exact in bf16
            q8 = mxfp4_to_int8(blocks, scales)
            assert torch.equal(q8.dequantize(torch.bfloat16), w)  # type: ignore[attr-defined]
            q4 = QuantWeight.quantize(w.float(), 4, 32)
            kinds["bf16 mm"].append(lambda x, w=w: torch.mm(x, w.t()))
            kinds["bf16 panel"].append(PanelLinear(panel, w, None))
            kinds["mxfp4 deq"].append(
                lambda x, b=blocks, s=scales, n=n, k=k: torch.mm(
                    x, dequantize_mxfp4(b, s).reshape(n, k).bfloat16().t()
                )
            )
            kinds["int8 g32"].append(PanelQuantLinear(q8, torch.bfloat16, qgemm))  # type: ignore[arg-type]
            kinds["int4 g32"].append(PanelQuantLinear(q4, torch.bfloat16, qgemm))
            nbytes["bf16 mm"] += w.nbytes
            nbytes["bf16 panel"] += w.nbytes
            nbytes["mxfp4 deq"] += blocks.nbytes + scales.nbytes
            nbytes["int8 g32"] += q8.nbytes  # type: ignore[attr-defined]
            nbytes["int4 g32"] += q4.nbytes
    per = {name: b / args.experts / 2**20 for name, b in nbytes.items()}
    print(f"{args.experts} experts of gpt-oss-20b [{2 * INTER}x{D}] + [{D}x{INTER}], "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}; MiB per expert: "
          + ", ".join(f"{n} {v:.1f}" for n, v in per.items()))  # fmt: skip
    print(
        f"{'rows':>5}" + "".join(f"{name + ' ms':>15}" for name in kinds) + f"{'best/bf16 mm':>14}"
    )
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=g).bfloat16() for k in (D, INTER)}
        times: dict[str, list[float]] = {name: [] for name in kinds}
        for _ in range(args.repeats + 1):  # the first pass of each warms up
            for name, fns in kinds.items():
                t = time.perf_counter()
                for j, fn in enumerate(fns):
                    fn(xs[D if j % 2 == 0 else INTER])
                times[name].append(time.perf_counter() - t)
        med = {name: statistics.median(ts[1:]) for name, ts in times.items()}
        best = min(med, key=med.__getitem__)
        line = f"{rows:>5}" + "".join(f"{s * 1e3:>15.2f}" for s in med.values())
        print(line + f"{med['bf16 mm'] / med[best]:>9.2f}x ({best})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
