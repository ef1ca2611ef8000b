"""loraplex's weight-quantized GEMMs on CPU (``native/quant_gemm.c``), loaded through ctypes.

Built and cached like every C kernel (:mod:`loraplex.native.build`: once per source, compiler,
instruction set and CPU, into a private directory) and checked against a float64 reference of
every bit width and activation dtype before first use. Its GEMM reads the
:class:`~loraplex.model.quant.weights.QuantWeight` layout as it is stored (int4 nibbles or int8,
float32 scales, int8 zero points), for any number of rows of x in float32 or bfloat16 (torch's
own int4/int8 CPU kernels are slow for float32 activations and for more than a few rows). Its
panel GEMMs read the same weights repacked into column panels (the dense panel kernel's layout,
``native/panel.h``): 4- and 8-bit weights with bf16 x (AVX512-BF16), and W4A8 (AVX512-VNNI);
the Linears over them are ``PanelQuantLinear`` and ``PanelW4A8Linear`` (``kernels.py``), which
check them on each weight they are built for.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from loraplex.config import layer_cpu_kernel_enabled
from loraplex.native.build import (
    ELEMENT_TYPES,
    SOURCE_DIR,
    KernelBuildError,
    cpu_flags,
    load_checked,
    open_kernel,
)

SOURCE = SOURCE_DIR / "quant_gemm.c"


class QGemmKernel:
    """The loaded ``loraplex_qgemm`` / ``loraplex_qdequant`` over the stored layout, and the
    quantized panel GEMMs ``loraplex_panel_q_*`` / ``loraplex_panel_w4a8_*`` over weights
    repacked into column panels (ctypes releases the GIL while they run)."""

    def __init__(self, library: Path) -> None:
        lib, fns, self.shared_threads = open_kernel(
            library, "loraplex_qgemm", "loraplex_qdequant", "loraplex_qgemm_features",
            "loraplex_panel_q_bytes", "loraplex_panel_q_pack", "loraplex_panel_q_gemm",
            "loraplex_panel_w4a8_bytes", "loraplex_panel_w4a8_pack", "loraplex_panel_w4a8_gemm",
            "loraplex_panel_q_gemm_amx", "loraplex_amx_enable", "loraplex_amx_faults",
            "loraplex_panel_w4a8_gemm_amx",
        )  # fmt: skip
        gemm, deq, features, qsize, qpack, qgemm, wsize, wpack, wgemm, *amx = fns
        features.argtypes, features.restype = [], ctypes.c_int
        bits = features()
        self.avx512, self.bf16_dot = bool(bits & 1), bool(bits & 2)
        """The AVX-512 path; AVX512-BF16 dot products (bf16 x, and the 4- and 8-bit panels)."""
        self.w4a8 = bool(bits & 4)
        """Whether this build computes 4-bit weights x int8 activations (AVX512-VNNI)."""
        self.panel = bits >> 8
        """The quantized panels' width in output columns."""
        self.amx_compiled, self.amx_emulated = bool(bits & 8), bool(bits & 16)
        """Whether this build has the 4- and 8-bit panels on AMX tiles (``native/amx.h``), and
        whether those tiles are its software model (the ``amx-model`` build: tests)."""
        i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        gemm.argtypes = [
            ptr, i64, i32, i64, i64, ptr, i32, ptr, ptr, i64, i64, ptr, ptr, i64, i32, i32
        ]  # fmt: skip
        deq.argtypes = [ptr, i32, ptr, ptr, i64, i64, i64, i64, i64, ptr, i32, i32]
        gemm.restype = deq.restype = i32
        qsize.argtypes, qsize.restype = [i64, i64, i64, i32], i64
        qpack.argtypes, qpack.restype = [ptr, ptr, ptr, i64, i64, i64, i32, ptr], None
        qgemm.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, i64, i32, ptr, ptr, i64, i32, i32]
        qgemm.restype = i32
        wsize.argtypes, wsize.restype = [i64, i64, i64], i64
        wpack.argtypes, wpack.restype = [ptr, ptr, ptr, i64, i64, i64, ptr], None
        wgemm.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, ptr, i64, i32, i32]
        wgemm.restype = i32
        amx_gemm, self._amx_enable, self._amx_faults, w4a8_amx = amx
        amx_gemm.argtypes, amx_gemm.restype = qgemm.argtypes, i32
        w4a8_amx.argtypes, w4a8_amx.restype = wgemm.argtypes, i32
        self._w4a8_amx = w4a8_amx
        self.amx_int8_compiled = bool(bits & 32)
        """Whether this build has the W4A8 panels on AMX-INT8 tiles."""
        self._amx_enable.argtypes = self._amx_faults.argtypes = []
        self._amx_enable.restype = self._amx_faults.restype = i32
        self._amx_gemm = amx_gemm
        self._lib, self._gemm, self._deq = lib, gemm, deq
        self._qsize, self._qpack, self._qgemm = qsize, qpack, qgemm
        self._wsize, self._wpack, self._wgemm = wsize, wpack, wgemm
        self.library = library

    def _threads(self) -> int:
        return torch.get_num_threads() if self.shared_threads else 1

    def gemm(
        self,
        x: torch.Tensor,  # [T, K] float32 / bfloat16, rows contiguous
        q: torch.Tensor,  # int4: uint8 [N, K/2]; int8: int8 [N, K]
        bits: int,
        scales: torch.Tensor,  # float32 [N, G]
        zeros: torch.Tensor | None,  # int8 [N, G]
        group_size: int,
        bias: torch.Tensor | None,  # float32 [N]
        out: torch.Tensor,  # [T, N], x's dtype, rows contiguous
    ) -> torch.Tensor:
        """``out = x @ W.T + bias`` for the quantized ``W`` (semantics in
        ``native/quant_gemm.c``)."""
        T, K = x.shape
        rc = self._gemm(
            x.data_ptr(), x.stride(0), ELEMENT_TYPES[x.dtype], T, K, q.data_ptr(), bits,
            scales.data_ptr(), 0 if zeros is None else zeros.data_ptr(), group_size,
            scales.shape[0], 0 if bias is None else bias.data_ptr(), out.data_ptr(),
            out.stride(0), ELEMENT_TYPES[out.dtype], self._threads(),
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("quantized GEMM kernel: cannot allocate its scratch")
        return out

    def dequant(
        self,
        q: torch.Tensor,
        bits: int,
        scales: torch.Tensor,
        zeros: torch.Tensor | None,
        group_size: int,
        n0: int,
        n1: int,
        out: torch.Tensor,  # [n1 - n0, K] float32 / bfloat16, contiguous
    ) -> torch.Tensor:
        """``out = W[n0:n1]`` in ``out``'s dtype."""
        N, K = scales.shape[0], out.shape[1]
        rc = self._deq(
            q.data_ptr(), bits, scales.data_ptr(), 0 if zeros is None else zeros.data_ptr(),
            group_size, N, K, n0, n1, out.data_ptr(), ELEMENT_TYPES[out.dtype], self._threads(),
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("quantized dequantization kernel: cannot allocate its scratch")
        return out

    def pack_q(
        self, q: torch.Tensor, bits: int, scales: torch.Tensor, zeros: torch.Tensor | None, k: int
    ) -> torch.Tensor:
        """The panel layout of a 4- or 8-bit weight stored as ``QuantWeight`` stores it (``q``
        uint8 [N, K / 2] in 32-column blocks or int8 [N, K], ``scales`` float32 [N, G],
        ``zeros`` int8 [N, G])."""
        n, g = scales.shape
        out = torch.empty(self._qsize(n, k, g, bits), dtype=torch.uint8)
        self._qpack(q.data_ptr(), scales.data_ptr(), 0 if zeros is None else zeros.data_ptr(),
                     n, k, g, bits, out.data_ptr())  # fmt: skip
        return out

    def gemm_q(
        self,
        x: torch.Tensor,  # bf16 [T, K] rows contiguous
        packed: torch.Tensor,
        n: int,
        bits: int,
        group_size: int,
        groups: int,
        bias: torch.Tensor | None,  # float32 [N]
        out: torch.Tensor,  # bf16 [T, N]
        *,
        tiles: bool = False,
    ) -> torch.Tensor:
        """``out = x @ W.T + bias`` over the 4- or 8-bit panels: AVX512-BF16 dots, or AMX-BF16
        tiles (``tiles``: the same semantics; only where :attr:`amx`)."""
        fn, what = (
            (self._amx_gemm, "AMX quantized GEMM") if tiles else (self._qgemm, "quantized GEMM")
        )
        return self._quantized(fn, what, x, packed, n, (group_size, groups, bits), bias, out)

    @functools.cached_property
    def amx(self) -> bool:
        """Whether :meth:`gemm_q` may run on tiles here: compiled in, and (on hardware) the CPU says
        AMX-TILE and AMX-BF16, a child process ran the tiles once and agreed with the AVX-512
        panels (:func:`amx_probe_passes`: a CPU, kernel or hypervisor that faults on them
        costs that child only), and the OS lets this process use them."""
        if not self.amx_compiled:
            return False
        if not self.amx_emulated:
            flags = cpu_flags() or frozenset()
            if not {"amx_tile", "amx_bf16"} <= flags or not amx_probe_passes(self.library):
                return False
        return self._amx_enable() == 0 and _amx_agrees(self)

    @functools.cached_property
    def amx_int8(self) -> bool:
        """Whether :meth:`gemm_w4a8` may run on tiles here: :attr:`amx`, AMX-INT8 compiled in and
        (on hardware) in the CPU's flags, and its sums the same bits as the VNNI panels'."""
        if not (self.amx and self.amx_int8_compiled and self.w4a8):
            return False
        if not self.amx_emulated and "amx_int8" not in (cpu_flags() or frozenset()):
            return False
        return _amx_int8_agrees(self)

    def amx_faults(self) -> int:
        """Misuses of the tiles the software model has seen (0 on hardware)."""
        return int(self._amx_faults())

    def _quantized(
        self,
        fn: Any,
        what: str,
        x: torch.Tensor,
        packed: torch.Tensor,
        n: int,
        layout: tuple[int, ...],  # the packed weight's group size, groups (and bits)
        bias: torch.Tensor | None,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Run one of the quantized GEMMs (same calling convention): y = x @ W.T + bias."""
        t, k = x.shape
        rc = fn(
            x.data_ptr(), x.stride(0), t, k, packed.data_ptr(), n, *layout,
            0 if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
            ELEMENT_TYPES[x.dtype], self._threads(),
        )  # fmt: skip
        if rc == -2:
            raise MemoryError(f"panel {what} kernel: cannot allocate its scratch")
        if rc != 0:
            raise KernelBuildError(f"panel {what} kernel: not for this build, dtype or shape")
        return out

    def pack_w4a8(
        self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, k: int
    ) -> torch.Tensor:
        """The W4A8 panel layout of a 4-bit ``QuantWeight``'s ``q``, ``scales``, ``zeros``."""
        n, g = scales.shape
        out = torch.empty(self._wsize(n, k, g), dtype=torch.uint8)
        self._wpack(q.data_ptr(), scales.data_ptr(), 0 if zeros is None else zeros.data_ptr(),
                    n, k, g, out.data_ptr())  # fmt: skip
        return out

    def gemm_w4a8(
        self,
        x: torch.Tensor,  # [T, K] float32 or bf16, rows contiguous
        packed: torch.Tensor,
        n: int,
        group_size: int,
        groups: int,
        bias: torch.Tensor | None,  # float32 [N]
        out: torch.Tensor,  # [T, N] x's dtype
        *,
        tiles: bool = False,
    ) -> torch.Tensor:
        """W4A8 over its panels: AVX512-VNNI, or AMX-INT8 tiles (``tiles``: the same bits; only
        where :attr:`amx_int8`)."""
        fn, what = (self._w4a8_amx, "AMX W4A8") if tiles else (self._wgemm, "W4A8")
        return self._quantized(fn, what, x, packed, n, (group_size, groups), bias, out)


AMX_PROBE_SECONDS = 60.0
"""How long the child process that first runs the AMX tiles may take (it runs in
milliseconds; a hung one counts as a failure)."""


@functools.cache
def amx_probe_passes(library: Path) -> bool:
    """Run ``loraplex_amx_probe`` of ``library`` in a child Python (ctypes only, no torch):
    whether it exited 0, the tiles agreeing with the AVX-512 panels. Once per process and
    library."""
    code = "import ctypes, sys; sys.exit(ctypes.CDLL(sys.argv[1]).loraplex_amx_probe())"
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, str(library)],
            capture_output=True,
            timeout=AMX_PROBE_SECONDS,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def usable_quant_panels() -> QGemmKernel | None:
    """The kernel for its panel GEMMs where they may run (``$LORAPLEX_LAYER_CPU_KERNEL`` is not
    ``0``, as for the dense panels) and it builds and checks here, else None (``QuantKernels``
    warns once why it did not build)."""
    if not layer_cpu_kernel_enabled():
        return None
    try:
        return load_qgemm()
    except KernelBuildError:
        return None


def load_qgemm(cache_dir: Path | None = None, *, isa: str | None = None) -> QGemmKernel:
    """Build (once per cache key), load and check the kernel; ``KernelBuildError`` if any step
    fails. Memoised per process and instruction set."""
    return load_checked(QGemmKernel, _self_check, SOURCE, "qgemm_cpu", cache_dir, isa)


def _self_check(kernel: QGemmKernel) -> None:
    """Both bit widths, with and without zero points, float32 and bfloat16 x, against float64;
    odd sizes exercise every tail (rows not a multiple of four, groups of 32 and per-channel)."""
    from loraplex.model.quant.weights import QuantWeight

    g = torch.Generator().manual_seed(0)
    for bits, gs, zeros in ((4, 32, True), (4, 64, False), (8, 96, True), (8, 96, False)):
        n, k = 7, 96 if gs == 96 else 128
        qw = QuantWeight.random(n, k, bits, gs, asymmetric=zeros, generator=g)
        ref = qw.dequantize(torch.float64)  # [N, K]
        bias = torch.randn(n, generator=g)
        for dtype in ELEMENT_TYPES:
            x = torch.randn(5, k, generator=g).to(dtype)
            want = x.double() @ ref.T + bias.double()
            got = torch.empty(5, n, dtype=dtype)
            kernel.gemm(x, qw.q, bits, qw.scales, qw.zeros, gs, bias, got)
            deq = kernel.dequant(
                qw.q, bits, qw.scales, qw.zeros, gs, 1, n, torch.empty(n - 1, k, dtype=dtype)
            )
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            scale = want.abs().max().item() + 1.0
            if not torch.allclose(got.double(), want, atol=tol * scale, rtol=tol):
                diff = (got.double() - want).abs().max().item()
                raise KernelBuildError(
                    f"quantized GEMM kernel disagrees with the reference: int{bits}, {dtype}, "
                    f"max diff {diff:.3g}"
                )
            if not torch.allclose(deq.double(), ref[1:], atol=0, rtol=tol):
                raise KernelBuildError(f"quantized dequantization kernel is wrong: int{bits}")


def _amx_agrees(kernel: QGemmKernel) -> bool:
    """The AMX panels against float64 on both bit widths, groups and per channel, with and
    without zero points, 1 to 33 rows (one, two and three blocks of 16), a panel's padding
    columns; and no misuse of the tiles seen by the software model. A disagreement disables
    only the tiles (the AVX-512 panels were checked on their own)."""
    from loraplex.model.quant.weights import QuantWeight

    g = torch.Generator().manual_seed(2)
    for bits, gs, zeros in ((4, 32, True), (4, 128, False), (8, 64, True), (8, 128, False)):
        n, k = 40, 128
        qw = QuantWeight.random(n, k, bits, gs, asymmetric=zeros, generator=g)
        packed = kernel.pack_q(qw.q, bits, qw.scales, qw.zeros, k)
        bias = torch.randn(n, generator=g)
        for t in (1, 5, 17, 33):
            x = torch.randn(t, k, generator=g).to(torch.bfloat16)
            want = x.double() @ qw.dequantize(torch.float64).T + bias.double()
            got = torch.empty(t, n, dtype=torch.bfloat16)
            groups = qw.scales.shape[1]
            try:
                kernel.gemm_q(x, packed, n, bits, gs, groups, bias, got, tiles=True)
            except KernelBuildError:
                return False
            tol = 2e-2
            scale = want.abs().max().item() + 1.0
            if not torch.allclose(got.double(), want, atol=tol * scale, rtol=tol):
                return False
    return kernel.amx_faults() == 0


def _amx_int8_agrees(kernel: QGemmKernel) -> bool:
    """W4A8 on AMX-INT8 tiles gives the VNNI panels' bits (both sum exactly in int32, then
    scale the same way): groups of 64 and 128 and per channel, with and without zero points,
    float32 and bf16 x, 1 to 33 rows; and no misuse of the tiles seen by the model."""
    from loraplex.model.quant.weights import QuantWeight

    g = torch.Generator().manual_seed(3)
    for gs, zeros, dtype in ((64, True, torch.bfloat16), (128, False, torch.float32),
                             (256, True, torch.float32)):  # fmt: skip
        n, k = 40, 256
        qw = QuantWeight.random(n, k, 4, gs, asymmetric=zeros, generator=g)
        packed = kernel.pack_w4a8(qw.q, qw.scales, qw.zeros, k)
        bias = torch.randn(n, generator=g)
        groups = qw.scales.shape[1]
        for t in (1, 17, 33):
            x = (torch.randn(t, k, generator=g) * 3).to(dtype)
            want = kernel.gemm_w4a8(x, packed, n, gs, groups, bias, torch.empty(t, n, dtype=dtype))
            got = torch.empty(t, n, dtype=dtype)
            try:
                kernel.gemm_w4a8(x, packed, n, gs, groups, bias, got, tiles=True)
            except KernelBuildError:
                return False
            if not torch.equal(got, want):
                return False
    return kernel.amx_faults() == 0
