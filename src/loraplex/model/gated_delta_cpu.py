"""The gated delta rule's decode step as one C call on CPU (``native/gated_delta.c``).

In torch the step is a gather of every row's state pages, a decayed copy, two einsums, an
outer-product add and a scatter back: some seven passes over ``B * Hv * dk * dv`` float32
(2 MiB a row at 32 value heads of 128), and past the caches each is a trip to memory. The
kernel reads each state once from its source page and writes it once to its destination page,
with the convolution, silu and the l2 norms in the same pass (``scripts/bench_gated_delta.py``
measures both). The prefill stays the torch backend's chunked rule.

:func:`load_delta_rule_kernel` builds and checks the kernel once per process;
``select_delta_rule`` (``model/gated_delta.py``) takes :class:`CDeltaRule` on CPU where it
loads, else the torch backend. Per call the kernel checks what it reads (dtypes, strides) and
hands anything else to the torch decode.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from loraplex.config import layer_cpu_kernel_enabled
from loraplex.model.gated_delta_ops import DeltaDims, TorchDeltaRule
from loraplex.native.build import (
    ELEMENT_TYPES,
    SOURCE_DIR,
    KernelBuildError,
    load_checked,
    open_kernel,
)

log = logging.getLogger(__name__)

SOURCE = SOURCE_DIR / "gated_delta.c"
MAX_HEAD_DIM = 1024  # the kernel's scratch per head (gated_delta.c)
MAX_KERNEL = 16


class DeltaRuleKernel:
    """The loaded ``gated_delta.c`` function with its argument types (ctypes releases the GIL
    while it runs)."""

    def __init__(self, library: Path) -> None:
        lib, (decode,), self.shared_threads = open_kernel(library, "loraplex_gdn_decode")
        i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        decode.argtypes = [
            ptr, i64, i32, ptr, ptr, i64, ptr, i64, ptr, ptr, ptr, i64, ptr, i64, ptr,
            i64, i64, i64, i64, i64, i64, i32,
        ]  # fmt: skip
        decode.restype = i32
        self.decode = decode
        self._lib = lib
        self.library = library


class CDeltaRule(TorchDeltaRule):
    """:class:`~loraplex.model.gated_delta_ops.DeltaRule` with the decode step in C (float32
    or bfloat16 rows on CPU); the prefill, and any decode the kernel does not read, are the
    torch backend's."""

    name = "cpu-kernel"

    def __init__(self, dims: DeltaDims, kernel: DeltaRuleKernel) -> None:
        super().__init__(dims)
        self.kernel = kernel
        self.fits = (
            max(dims.dk, dims.dv) <= MAX_HEAD_DIM
            and dims.kernel <= MAX_KERNEL
            and dims.hv % dims.hk == 0
        )

    def decode(
        self, mixed: torch.Tensor, conv_w: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        src: torch.Tensor, dst: torch.Tensor, conv: torch.Tensor, rec: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        e = ELEMENT_TYPES.get(mixed.dtype)
        if (
            e is None
            or not self.fits
            or not mixed.is_cpu
            or mixed.stride(1) != 1
            or conv_w.dtype != mixed.dtype
            or conv.dtype != mixed.dtype
            or not conv_w.is_contiguous()
            or (conv[0].numel() and not conv[0].is_contiguous())
            or rec.dtype != torch.float32
            or not rec[0].is_contiguous()
            or g.dtype != torch.float32
            or beta.dtype != torch.float32
            or g.stride(1) != 1
            or beta.stride(1) != 1
            or src.dtype != torch.int64
            or dst.dtype != torch.int64
            or not (src.is_contiguous() and dst.is_contiguous())
        ):
            return super().decode(mixed, conv_w, g, beta, src, dst, conv, rec)
        d = self.dims
        B = mixed.shape[0]
        out = torch.empty(B, d.hv, d.dv, dtype=torch.float32)
        threads = torch.get_num_threads() if self.kernel.shared_threads else 1
        rc = self.kernel.decode(
            mixed.data_ptr(), mixed.stride(0), e, conv_w.data_ptr(), g.data_ptr(), g.stride(0),
            beta.data_ptr(), beta.stride(0), src.data_ptr(), dst.data_ptr(), conv.data_ptr(),
            conv.stride(0), rec.data_ptr(), rec.stride(0), out.data_ptr(),
            B, d.hk, d.hv, d.dk, d.dv, d.kernel, threads,
        )  # fmt: skip
        if rc != 0:  # out of the kernel's range: self.fits keeps this from happening
            raise ValueError(f"gated delta decode kernel refused dims {d}")
        return out


def self_check(rule: CDeltaRule) -> None:
    """The kernel against the torch decode on a small GQA case with a row staying on its page,
    float32 and bfloat16; ``KernelBuildError`` on a mismatch."""
    d = DeltaDims(hk=2, hv=4, dk=8, dv=12, kernel=4)
    torch_rule = TorchDeltaRule(d)
    gen = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        mixed = torch.randn(3, d.conv_dim, generator=gen).to(dtype)
        conv_w = torch.randn(d.conv_dim, d.kernel, generator=gen).to(dtype)
        g, beta = -torch.rand(3, d.hv, generator=gen), torch.rand(3, d.hv, generator=gen)
        conv = torch.randn(5, d.conv_dim, d.kernel - 1, generator=gen).to(dtype)
        rec = torch.randn(5, d.hv, d.dk, d.dv, generator=gen)
        src, dst = torch.tensor([0, 2, 4]), torch.tensor([1, 2, 3])
        conv_t, rec_t = conv.clone(), rec.clone()
        want = torch_rule.decode(mixed, conv_w, g, beta, src, dst, conv_t, rec_t)
        got = CDeltaRule(d, rule.kernel).decode(mixed, conv_w, g, beta, src, dst, conv, rec)
        ok = (
            torch.allclose(got, want, atol=tol, rtol=tol)
            and torch.allclose(rec, rec_t, atol=tol, rtol=tol)
            and torch.equal(conv, conv_t)
        )
        if not ok:
            raise KernelBuildError(f"gated delta decode kernel disagrees with torch ({dtype})")


def _check_kernel(kernel: DeltaRuleKernel) -> None:
    self_check(CDeltaRule(DeltaDims(1, 1, 1, 1, 1), kernel))


def load_kernel(cache_dir: Path | None = None, *, isa: str | None = None) -> DeltaRuleKernel:
    """Build (once per cache key), load and check the kernel; ``KernelBuildError`` if any step
    fails. Memoised per process and instruction set."""
    return load_checked(DeltaRuleKernel, _check_kernel, SOURCE, "gated_delta", cache_dir, isa)


def load_delta_rule_kernel(dims: DeltaDims) -> CDeltaRule | None:
    """The C backend for ``dims``, or None where the kernel is switched off
    (``$LORAPLEX_LAYER_CPU_KERNEL=0``: the layer ops' switch) or does not build."""
    if not layer_cpu_kernel_enabled():
        return None
    try:
        return CDeltaRule(dims, load_kernel())
    except KernelBuildError as e:
        log.warning("gated delta C kernel unavailable, using torch: %s", e)
        return None
