"""Base-model GEMMs on CPU from weights packed in column panels (``native/panel_gemm.c``).

At decode sizes (a few to a few dozen rows) oneDNN's bf16 kernels on a CPU with AVX512-BF16
but no AMX reach about 40% of the dot-product peak: its small-batch blocking reloads
accumulators, so a thin model's step is bound by loads rather than by the weights' bytes or the
arithmetic. The panel kernel keeps a block of rows' sums in registers for the whole K and
streams each weight panel once per block of rows (semantics and layout in ``panel_gemm.c``);
measured side by side with oneDNN in docs/benchmarks.md ("The rest of the step").

Built, cached and checked like the other C kernels (:mod:`loraplex.native.build`);
``PanelLinear`` holds only the packed weight (the original is not kept) and reads it back for
the merger (:meth:`PanelLinear.dense_weight`). Quantized weights in the same column panels
(``native/panel.h``) are the quantized GEMM kernel's (``model/quant/cpu_kernel.py``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from loraplex.config import layer_cpu_kernel_enabled
from loraplex.native.build import (
    ELEMENT_TYPES,
    SOURCE_DIR,
    KernelBuildError,
    load_checked,
    open_kernel,
)

log = logging.getLogger(__name__)

SOURCE = SOURCE_DIR / "panel_gemm.c"


class PanelKernel:
    """The loaded ``loraplex_panel_*`` functions (ctypes releases the GIL while they run)."""

    def __init__(self, library: Path) -> None:
        lib, fns, self.shared_threads = open_kernel(
            library, "loraplex_panel_gemm", "loraplex_panel_pack", "loraplex_panel_bytes",
            "loraplex_panel_width", "loraplex_panel_features",
        )  # fmt: skip
        gemm, pack, size, width, features = fns
        i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        gemm.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, i32, i32]
        gemm.restype = i32
        pack.argtypes, pack.restype = [ptr, i64, i64, i64, i32, ptr], None
        size.argtypes, size.restype = [i64, i64, i32], i64
        width.argtypes, width.restype = [], i32
        features.argtypes, features.restype = [], i32
        bits = features()
        self.dtypes = frozenset(
            d for d, bit in ((torch.float32, 1), (torch.bfloat16, 2)) if bits & bit
        )
        """The dtypes this build computes with vectors (bf16: AVX512-BF16 dot products)."""
        self.panel = width()
        self._lib, self._gemm, self._pack, self._size = lib, gemm, pack, size
        self.library = library

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """The panel layout of ``weight [N, K]`` (rows contiguous) as a byte tensor."""
        n, k = weight.shape
        out = torch.empty(self._size(n, k, ELEMENT_TYPES[weight.dtype]), dtype=torch.uint8)
        self._pack(weight.data_ptr(), weight.stride(0), n, k, ELEMENT_TYPES[weight.dtype],
                   out.data_ptr())  # fmt: skip
        return out

    def gemm(
        self,
        x: torch.Tensor,  # [T, K] rows contiguous, the weight's dtype
        packed: torch.Tensor,
        n: int,
        bias: torch.Tensor | None,  # float32 [N]
        out: torch.Tensor,  # [T, N] rows contiguous
    ) -> torch.Tensor:
        t, k = x.shape
        threads = torch.get_num_threads() if self.shared_threads else 1
        rc = self._gemm(
            x.data_ptr(), x.stride(0), t, k, packed.data_ptr(), n,
            0 if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
            ELEMENT_TYPES[x.dtype], threads,
        )  # fmt: skip
        if rc != 0:
            raise KernelBuildError(f"panel GEMM kernel: this build does not compute {x.dtype}")
        return out


class PanelLinear:
    """``y = x @ W.T + b`` on the panel kernel; the weight is kept only in its packed layout."""

    def __init__(self, kernel: PanelKernel, weight: torch.Tensor, bias: torch.Tensor | None):
        self.kernel = kernel
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.nbytes = weight.nbytes + (bias.nbytes if bias is not None else 0)
        self.packed = kernel.pack(weight.contiguous())
        self.bias = bias  # as given (the merger and dense_weight return it)
        self._bias32 = None if bias is None else bias.float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) != 1 or x.dtype != self.dtype:
            x = x.contiguous().to(self.dtype)
        out = torch.empty(x.shape[0], self.out_features, dtype=self.dtype)
        return self.kernel.gemm(x, self.packed, self.out_features, self._bias32, out)

    def dense_weight(self) -> torch.Tensor:
        """W [N, K] read back from the panels (exact: a reordering)."""
        n, k, w = self.out_features, self.in_features, self.kernel.panel
        panels = -(-n // w)
        if self.dtype == torch.float32:
            p = self.packed.view(torch.float32).view(panels, k, w)
            full = p.permute(0, 2, 1).reshape(panels * w, k)
        else:
            k2 = -(-k // 2)
            p = self.packed.view(torch.bfloat16).view(panels, k2, w, 2)
            full = p.permute(0, 2, 1, 3).reshape(panels * w, 2 * k2)
        return full[:n, :k].contiguous()


def usable_panel_kernel() -> PanelKernel | None:
    """The kernel where it may run (``$LORAPLEX_LAYER_CPU_KERNEL`` is not ``0``) and builds
    and checks here, else None (with one warning naming why it did not build)."""
    if not layer_cpu_kernel_enabled():
        return None
    try:
        return load_panel_kernel()
    except KernelBuildError as e:
        _warn_once(str(e))
        return None


@functools.cache
def _warn_once(reason: str) -> None:
    log.warning("panel GEMM kernel unavailable (%s); oneDNN / torch kernels instead", reason)


def load_panel_kernel(cache_dir: Path | None = None, *, isa: str | None = None) -> PanelKernel:
    """Build (once per cache key), load and check the kernel; ``KernelBuildError`` if any step
    fails. Memoised per process and instruction set."""
    return load_checked(PanelKernel, self_check, SOURCE, "panel_gemm", cache_dir, isa)


def self_check(kernel: PanelKernel) -> None:
    """Each dtype the build computes, against float64: odd shapes (a partial panel, an odd K,
    row counts around the block size), a bias, and the weight read back exactly."""
    g = torch.Generator().manual_seed(0)
    for dtype in sorted(kernel.dtypes, key=str):
        for n, k, t in ((37, 45, 11), (64, 32, 8), (5, 16, 1)):
            w = torch.randn(n, k, generator=g).to(dtype)
            bias = torch.randn(n, generator=g).to(dtype)
            lin = PanelLinear(kernel, w, bias)
            x = torch.randn(t, k, generator=g).to(dtype)
            want = x.double() @ w.double().T + bias.double()
            got = lin(x).double()
            # float32 sums of k products; bf16: the result rounded once more
            tol = 1e-5 if dtype == torch.float32 else 2.0**-7
            if not torch.allclose(got, want, rtol=tol, atol=tol * (k**0.5)):
                diff = (got - want).abs().max().item()
                raise KernelBuildError(
                    f"panel GEMM kernel disagrees with float64 in {dtype} (max diff {diff:.3g})"
                )
            if not torch.equal(lin.dense_weight(), w):
                raise KernelBuildError(f"panel GEMM kernel: the {dtype} weight does not read back")
