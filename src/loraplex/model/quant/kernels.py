"""Linears over quantized weights, behind the model's one ``Linear`` protocol, and the start-up
choice among them.

Candidates for an integer weight (:class:`QuantWeight`) on CPU: loraplex's C kernel
(``native/quant_gemm.c``, any rows, float32 or bfloat16 x), the same kernel's 4- and 8-bit panel
path (bfloat16 x with AVX512-BF16, weights repacked into the dense panel kernel's column panels,
whose sums stay in registers), torch's packed int4 and int8 CPU kernels
(bfloat16 / float16 x only: for float32 x they run ten times slower than the float GEMM), and
dequantizing into a float buffer for a plain GEMM (prompt chunks of many rows). Each is checked
against the dequantized reference on the real weight's first rows when it is built, and
:func:`select_quant_linear` times the candidates once per distinct (shape, bits, group size) on
the decode batch sizes an engine runs, keeping the fastest (``docs/benchmarks.md`` has the
figures). On CUDA a Triton kernel (``triton_gemm.py``) reads the integer layout as stored; W8A8 and
float8 weights, and any device without Triton, use the dequantizing Linear.

W8A8 checkpoints quantize the base product's *input* (int8 per token, or float8). The LoRA delta
is added by the caller from the same unquantized ``x`` (``LoRABinding.add`` reads the layer's
input, never what a Linear made of it): an adapter was trained against full-precision
activations, and quantizing them for the adapter's tiny GEMMs would only add error where the
speed does not need it (vLLM's FP8 MoE + LoRA bug was exactly that). These Linears therefore
never write to ``x``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraplex.model.quant.cpu_kernel import QGemmKernel, load_qgemm, usable_quant_panels
from loraplex.model.quant.linear import QuantLinearBase
from loraplex.model.quant.weights import ActQuant, FP8Weight, QuantWeight
from loraplex.native.build import KernelBuildError

log = logging.getLogger(__name__)

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


def quantize_activation(x: torch.Tensor, act: ActQuant) -> torch.Tensor:
    """What a W8A8 base product sees of ``x [T, K]``: quantized and dequantized again, in
    float32 (the products of the int8 / fp8 GEMM, emulated exactly in float32 on CPU)."""
    xf = x.float()
    if act.kind == "int8":  # symmetric per token, dynamic
        s = (xf.abs().amax(-1, keepdim=True) / 127.0).clamp(min=1e-10)
        return torch.round(xf / s).clamp(-128, 127) * s
    s = (
        torch.tensor(act.scale)
        if act.scale is not None
        else (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    )
    return (xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s


class DequantLinear(QuantLinearBase):
    """Dequantize the whole weight into x's dtype on every call, then ``F.linear``: correct on
    every device and format (float8 included), the fallback and the prompt-chunk path."""

    name = "dequant"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.quant.dequantize(torch.float32).to(device=x.device, dtype=x.dtype)
        act = self.quant.act
        if act is not None:  # W8A8: the base product's input is quantized (LoRA's is not)
            return self._add_bias(F.linear(quantize_activation(x, act), w.float()).to(x.dtype))
        return self._add_bias(F.linear(x, w))


class CKernelLinear(QuantLinearBase):
    """loraplex's C kernel: unpacks each weight once per call for every row of x. Inputs of at
    least ``dequant_rows`` rows dequantize blocks of ``BLOCK_ROWS`` output rows into a float
    buffer small enough to stay in cache and run the float GEMM on it instead (where the
    start-up timing found that faster)."""

    name = "c-kernel"
    alt_name = "dequant"
    BLOCK_ROWS = 256  # output rows dequantized at a time (a few hundred KiB)

    def __init__(self, weight: QuantWeight, kernel: object) -> None:
        super().__init__(weight)
        if weight.act is not None:
            raise KernelBuildError("the C kernel reads unquantized activations only")
        self.kernel = kernel
        self.bias32 = None if weight.bias is None else weight.bias.float().contiguous()

    @property
    def dequant_rows(self) -> int | None:
        """From how many rows x takes the dequantizing path (:attr:`alt_rows`)."""
        return self.alt_rows

    @dequant_rows.setter
    def dequant_rows(self, rows: int | None) -> None:
        self.alt_rows = rows

    def alt(self, x: torch.Tensor) -> torch.Tensor:
        return self.via_dequant(x)

    def via_dequant(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b`` by dequantized row blocks and the float GEMM (x gathered already)."""
        q = self.quant
        assert isinstance(q, QuantWeight)
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        w = torch.empty(min(self.BLOCK_ROWS, self.out_features), self.in_features, dtype=x.dtype)
        for n0 in range(0, self.out_features, self.BLOCK_ROWS):
            n1 = min(n0 + self.BLOCK_ROWS, self.out_features)
            block = w[: n1 - n0]
            self.kernel.dequant(q.q, q.bits, q.scales, q.zeros, q.group_size, n0, n1, block)
            out[:, n0:n1] = F.linear(x, block)
        return self._add_bias(out)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        q = self.quant
        assert isinstance(q, QuantWeight)
        x = self._gather(x).contiguous()
        if self.alt_rows is not None and x.shape[0] >= self.alt_rows:
            return self.via_dequant(x)
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        return self.kernel.gemm(x, q.q, q.bits, q.scales, q.zeros, q.group_size, self.bias32, out)


class PanelQuantLinear(QuantLinearBase):
    """4- and 8-bit weights on the quantized panel GEMM (``native/quant_gemm.c``: bf16 x with
    AVX512-BF16; each pair of values made an exact bf16 pair, 4-bit nibbles OR'd into 128 + q,
    each group's offset and scale applied to its float32 sums); the weight is repacked into
    its panels (ours is dropped). Where the CPU has AMX tiles (``QGemmKernel.amx``), its second
    path runs the same panels' pair products on AMX-BF16 tiles, blocks of 16 rows a tile."""

    def __init__(self, weight: QuantWeight, dtype: torch.dtype, kernel: QGemmKernel | None) -> None:
        super().__init__(weight)
        if (
            kernel is None
            or weight.bits not in (4, 8)
            or weight.act is not None
            or dtype != torch.bfloat16
            or not kernel.bf16_dot
            or weight.in_features % 2
            or weight.group_size % 2
        ):
            raise KernelBuildError("the panel quantized kernel: bf16 x, even sizes, AVX512-BF16")
        self.kernel, self.bits = kernel, weight.bits
        self.name = f"panel-int{weight.bits}"
        self.packed = kernel.pack_q(
            weight.q, weight.bits, weight.scales, weight.zeros, weight.in_features
        )
        self.group_size, self.groups = weight.group_size, weight.scales.shape[1]
        self.bias32 = None if weight.bias is None else weight.bias.float().contiguous()
        self._nbytes = self.packed.nbytes
        self.quant = None  # type: ignore[assignment]  # only the panels are kept
        tiles = kernel.amx and weight.in_features % 32 == 0 and weight.group_size % 32 == 0
        self.alt_name = "amx" if tiles else None

    @property
    def nbytes(self) -> int:
        return self._nbytes + (self.perm.nbytes if self.perm is not None else 0)

    def _columns(self, pi: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """float64 W rows of panel ``pi``'s column ``c`` (index tensors of one shape S), read
        from the layout ``native/quant_gemm.c`` describes: [*S, K] in stored column order."""
        n, k, w, g = self.out_features, self.in_features, self.kernel.panel, self.groups
        panels = -(-n // w)
        if self.bits == 4:  # [panels, four inputs j, half, column c, s]: q[4j + s] | q[4j+2+s] << 4
            at = panels * -(-k // 4) * 2 * w
            v = self.packed[:at].view(panels, -1, 2, 16, 2)[pi, :, c // 16, c % 16].long()
            q = torch.stack((v & 15, v >> 4), dim=-1).transpose(-1, -2)  # [*S, J, nibble, s]
        else:  # [panels, pair kk, column, 2]
            at = panels * k * w
            q = self.packed[:at].view(torch.int8).view(panels, k // 2, w, 2)[pi, :, c].long()
        q = q.reshape(*pi.shape, -1)[..., :k]
        sc, zp = _panel_groups(self.packed, at, panels, g, w)
        return _affine(q, sc[pi, :, c], zp[pi, :, c], self.group_size)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """W [N, K] read back from the panels (checkpoint column order)."""
        ids = torch.arange(self.out_features)
        wt = self._columns(ids // self.kernel.panel, ids % self.kernel.panel)
        if self.perm is not None:
            wt = wt[:, torch.argsort(self.perm)]
        return wt.to(dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of W in float32, only those unpacked (a tied embedding's lookup reads
        the head's panels, so the pair stays one matrix)."""
        if self.perm is not None:
            raise ValueError("rows() reads a weight in its stored column order")
        return self._columns(ids // self.kernel.panel, ids % self.kernel.panel).float()

    def alt(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x.contiguous(), tiles=True)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = self._gather(x).contiguous()
        tiles = self.alt_rows is not None and x.shape[0] >= self.alt_rows
        return self._run(x, tiles=tiles)

    def _run(self, x: torch.Tensor, *, tiles: bool) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        return self.kernel.gemm_q(
            x, self.packed, self.out_features, self.bits, self.group_size, self.groups,
            self.bias32, out, tiles=tiles,
        )  # fmt: skip


def _panel_groups(
    packed: torch.Tensor, at: int, panels: int, groups: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a quantized panel layout's scales (float32) and zero points (int8), both
    [panels, G, NR], stored from byte ``at`` on (``native/quant_gemm.c``)."""
    n = panels * groups * width
    sc = packed[at : at + n * 4].view(torch.float32).view(panels, groups, width)
    return sc, packed[at + n * 4 : at + n * 5].view(torch.int8).view(panels, groups, width)


def _affine(q: torch.Tensor, sc: torch.Tensor, zp: torch.Tensor, group_size: int) -> torch.Tensor:
    """float64 ``W = scale * (q - zero)`` of rows q [..., K] from their groups' sc / zp [..., G]."""
    cols = torch.arange(q.shape[-1]) // group_size
    return sc.double()[..., cols] * (q.double() - zp.double()[..., cols])


class PanelW4A8Linear(QuantLinearBase):
    """W4A8 (compressed-tensors' preset): 4-bit weights, the base product's input quantized to
    int8 per token (dynamic, symmetric, ``absmax / 127`` as vLLM and
    :func:`quantize_activation`), exact int32 group sums on AVX512-VNNI in the quantized panel
    GEMM (``native/quant_gemm.c``), float32 or bf16 x. LoRA reads the unquantized x (module docstring).
    Where the CPU has AMX-INT8 (``QGemmKernel.amx_int8``), its second path sums the same panels
    on tiles, the same bits; ``QuantKernels`` times from how many rows it runs."""

    name = "panel-w4a8"

    def __init__(self, weight: QuantWeight, kernel: QGemmKernel | None) -> None:
        super().__init__(weight)
        if (
            kernel is None
            or not kernel.w4a8
            or weight.bits != 4
            or weight.act != ActQuant("int8")
            or weight.in_features % 32
            or weight.group_size % 8
        ):
            raise KernelBuildError("the W4A8 panel kernel: 4-bit weights, int8 x, AVX512-VNNI")
        self.kernel = kernel
        tiles = kernel.amx_int8 and weight.in_features % 64 == 0 and weight.group_size % 64 == 0
        self.alt_name = "amx-int8" if tiles else None
        self.packed = kernel.pack_w4a8(weight.q, weight.scales, weight.zeros, weight.in_features)
        self.group_size, self.groups = weight.group_size, weight.scales.shape[1]
        self.bias32 = None if weight.bias is None else weight.bias.float().contiguous()
        self.act = weight.act
        self.quant = None  # type: ignore[assignment]  # only the panels are kept

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + (self.perm.nbytes if self.perm is not None else 0)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """W [N, K] read back from the panels (checkpoint column order)."""
        n, k, w, g = self.out_features, self.in_features, self.kernel.panel, self.groups
        panels = -(-n // w)
        at = panels * (k // 2) * w
        v = self.packed[:at].view(panels, k // 8, 2, 16, 4).long()  # [P, b, half, c, i]
        q = torch.stack((v & 15, v >> 4), dim=-2)  # [P, b, half, c, nibble, i]: 8b + 4 nib + i
        q = q.permute(0, 2, 3, 1, 4, 5).reshape(panels * w, k)
        sc, zp = (
            t.transpose(1, 2).reshape(panels * w, g)
            for t in _panel_groups(self.packed, at, panels, g, w)
        )
        wt = _affine(q, sc, zp, self.group_size)[:n]
        if self.perm is not None:
            wt = wt[:, torch.argsort(self.perm)]
        return wt.to(dtype)

    def alt(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, tiles=True)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = self._gather(x)
        tiles = self.alt_rows is not None and x.shape[0] >= self.alt_rows
        return self._run(x, tiles=tiles)

    def _run(self, x: torch.Tensor, *, tiles: bool) -> torch.Tensor:
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        return self.kernel.gemm_w4a8(
            x, self.packed, self.out_features, self.group_size, self.groups, self.bias32, out,
            tiles=tiles,
        )  # fmt: skip


class TorchInt4Linear(QuantLinearBase):
    """torch's packed int4 CPU kernel (``_weight_int4pack_mm_for_cpu``: bfloat16 / float16 x,
    ``w = (q - 8) * scale + zero`` per group); our integer zero point z becomes the float zero
    ``(8 - z) * scale``. The weight is repacked into torch's layout (ours is dropped)."""

    name = "torch-int4"

    def __init__(self, weight: QuantWeight, dtype: torch.dtype) -> None:
        super().__init__(weight)
        if weight.bits != 4 or weight.act is not None or dtype == torch.float32:
            raise KernelBuildError("torch's int4 kernel: 4-bit weights and half-precision x")
        if (
            weight.group_size not in (32, 64, 128, 256)
            or weight.out_features % 16
            or weight.in_features % weight.group_size
        ):
            raise KernelBuildError("torch's int4 kernel: groups of 32-256, rows a multiple of 16")
        values = weight.values().to(torch.int32)  # [N, K]
        z = weight.zeros.float() if weight.zeros is not None else torch.zeros_like(weight.scales)
        zero = (8.0 - z) * weight.scales  # [N, G]
        self.packed = torch._convert_weight_to_int4pack_for_cpu(values, 2)
        self.scale_zeros = (
            torch.stack((weight.scales, zero), dim=-1).transpose(0, 1).contiguous().to(dtype)
        )  # [G, N, 2]
        self.group_size = weight.group_size
        self._nbytes = self.packed.nbytes + self.scale_zeros.nbytes
        self.quant = None  # type: ignore[assignment]  # only torch's packed copy is kept

    @property
    def nbytes(self) -> int:
        return self._nbytes + (self.perm.nbytes if self.perm is not None else 0)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """Read back through the kernel: x = I gives W^T, each output one product."""
        eye = torch.eye(self.in_features, dtype=self.scale_zeros.dtype)
        wt = torch._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size, self.scale_zeros)
        w = wt.t()
        if self.perm is not None:
            w = w[:, torch.argsort(self.perm)]
        return w.to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int4pack_mm_for_cpu(
            self._gather(x).contiguous(), self.packed, self.group_size, self.scale_zeros
        )
        return self._add_bias(y)


class TorchInt8Linear(QuantLinearBase):
    """torch's int8 weight-only CPU kernel (``_weight_int8pack_mm``): per-channel symmetric
    weights, half-precision x."""

    name = "torch-int8"

    def __init__(self, weight: QuantWeight, dtype: torch.dtype) -> None:
        super().__init__(weight)
        per_channel = weight.group_size == weight.in_features and weight.zeros is None
        if weight.bits != 8 or not per_channel or weight.act is not None or dtype == torch.float32:
            raise KernelBuildError("torch's int8 kernel: per-channel symmetric int8, half x")
        self.scales = weight.scales[:, 0].to(dtype).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        q = self.quant
        assert isinstance(q, QuantWeight)
        return self._add_bias(
            torch._weight_int8pack_mm(self._gather(x).contiguous(), q.q, self.scales)
        )


@functools.cache
def int_mm_is_exact() -> bool:
    """Whether ``torch._int_mm`` computes int8 x int8 -> int32 exactly here. Under oneDNN's
    AVX2 code (an AVX2-only CPU, or ``ONEDNN_MAX_CPU_ISA=AVX2``) it saturates: its u8 x s8
    pair products sum into int16 (``vpmaddubsw``), off by up to ~250,000 on full-range
    operands; checked once on full-range values against an int64 product."""
    if not hasattr(torch, "_int_mm"):
        return False
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 128, (17, 256), dtype=torch.int8, generator=g)
    b = torch.randint(-128, 128, (256, 40), dtype=torch.int8, generator=g)
    a[0], b[:, 0] = 127, 127  # the largest pair sums
    try:
        return bool(torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long()))
    except RuntimeError:
        return False


class W8A8Int8Linear(QuantLinearBase):
    """W8A8 int8: x quantized per token (dynamic, symmetric, vLLM's ``absmax / 127``), int8 x
    int8 -> int32 with ``torch._int_mm`` where that is exact (:func:`int_mm_is_exact`), both
    scales applied after; elsewhere the same product from the dequantized int8 activations on
    the C kernel's int8 weights (float32 sums of the same products). LoRA reads the
    unquantized x (module docstring)."""

    name = "w8a8-int8"

    def __init__(self, weight: QuantWeight, kernel: object | None = None) -> None:
        super().__init__(weight)
        per_channel = weight.group_size == weight.in_features and weight.zeros is None
        if weight.bits != 8 or not per_channel or weight.act != ActQuant("int8"):
            raise KernelBuildError("W8A8 int8: per-channel symmetric int8 weights")
        self.w_scale = weight.scales[:, 0].contiguous()  # [N] float32
        self.exact = int_mm_is_exact()
        self.kernel = kernel
        self.wt = weight.q.t().contiguous() if self.exact else None  # [K, N] for _int_mm
        self.name = "w8a8-int8" if self.exact else "w8a8-int8-emulated"

    @property
    def nbytes(self) -> int:
        w = self.wt if self.wt is not None else self.quant.q  # type: ignore[union-attr]
        return w.nbytes + self.w_scale.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = self._gather(x).float()
        s = (xf.abs().amax(-1, keepdim=True) / 127.0).clamp(min=1e-10)  # [T, 1]
        xq = torch.round(xf / s).clamp(-128, 127)
        if self.wt is not None:
            acc = torch._int_mm(xq.to(torch.int8), self.wt)  # [T, N] int32, exact
            return self._add_bias((acc.float() * s * self.w_scale).to(x.dtype))
        q = self.quant
        assert isinstance(q, QuantWeight)
        xd = (xq * s).contiguous()  # the quantized activations, as float32
        if self.kernel is not None:
            out = torch.empty(xd.shape[0], self.out_features)
            self.kernel.gemm(xd, q.q, 8, q.scales, None, q.group_size, None, out)  # type: ignore[attr-defined]
        else:
            out = F.linear(xd, q.dequantize(torch.float32))
        return self._add_bias(out.to(x.dtype))


class FP8Linear(QuantLinearBase):
    """float8 e4m3 weights: the weight is widened block by block into x's dtype (CPUs have no
    float8 GEMM); with an activation scheme x is quantized to float8 first (static per-tensor
    or dynamic per-token scale), the base product of an FP8 W8A8 checkpoint. LoRA reads the
    unquantized x (module docstring)."""

    name = "fp8-dequant"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.quant
        assert isinstance(w, FP8Weight)
        if w.act is not None:
            xq = quantize_activation(x, w.act)
            return self._add_bias(F.linear(xq, w.dequantize(torch.float32)).to(x.dtype))
        return self._add_bias(F.linear(x, w.dequantize(x.dtype)))


@dataclass(frozen=True)
class KernelChoice:
    """The kernel picked for one weight kind, the times it was picked by, and from how many
    rows its second path runs (``alt_rows``; None: never)."""

    name: str
    times_ms: dict[str, float]
    alt_rows: int | None = None
    alt_name: str | None = None


QuantLinearFactory = Callable[[QuantWeight | FP8Weight], QuantLinearBase]

DECODE_ROWS = (1, 16)
"""The rows of x the start-up timing runs (decode steps: one sequence, and a batch of 16). Each
candidate runs its faster path at each of them (a weight stored once serves both); the sum of
those times decides between candidates, so neither end is given up for the other."""
PROBE_ROWS = 4096
"""Output rows of the random weight the candidates are timed on (at most: a kernel's time per
row does not depend on the row count, and a vocabulary-sized probe would cost seconds)."""
PROMPT_ROWS = 256
"""The rows of a prompt chunk a second path is timed at where it lost at every decode size."""
PROMPT_ALT_ROWS = 64
"""From how many rows a second path runs that won only at :data:`PROMPT_ROWS`."""


def _candidates(
    weight: QuantWeight, dtype: torch.dtype, kernel: object | None
) -> list[QuantLinearBase]:
    out: list[QuantLinearBase] = []
    if kernel is not None:
        out.append(CKernelLinear(weight, kernel))
    panel = usable_quant_panels()
    if panel is not None:
        try:
            out.append(PanelQuantLinear(weight, dtype, panel))
        except KernelBuildError:
            pass  # not a 4- or 8-bit weight, not bf16 x, or no AVX512-BF16 here
    for cls in (TorchInt4Linear, TorchInt8Linear):
        try:
            out.append(cls(weight, dtype))
        except (KernelBuildError, RuntimeError):
            continue  # this kernel does not take this weight or dtype
    return out


def _time_ms(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def _self_check(lin: QuantLinearBase, weight: QuantWeight, dtype: torch.dtype) -> bool:
    """The candidate agrees with the dequantized reference on a few rows of x."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, weight.in_features, generator=g).to(dtype)
    want = x.double() @ weight.dequantize(torch.float64).T
    if weight.bias is not None:
        want = want + weight.bias.double()
    got = lin(x).double()
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    return bool(torch.allclose(got, want, atol=tol * (want.abs().max().item() + 1), rtol=tol))


def _alt_from(
    lin: QuantLinearBase, xs: dict[int, torch.Tensor], direct: dict[int, float],
    times: dict[str, float],
) -> int | None:  # fmt: skip
    """From how many rows ``lin``'s second path should run: the fewest decode rows from which
    it was faster at every larger decode size (timed from the largest down, stopping where it
    loses), else :data:`PROMPT_ALT_ROWS` where it was faster on a prompt chunk, else None.
    Lowers ``direct`` to the path taken at each size."""
    alt: dict[int, float] = {}
    rows = None
    for t in sorted(xs, reverse=True):
        alt[t] = times[f"{lin.alt_name}@{t}"] = _time_ms(lambda x=xs[t]: lin.alt(x))
        if alt[t] >= direct[t]:
            break
        rows = t
    if rows is not None:
        for t in xs:
            if t >= rows:
                direct[t] = alt[t]
        return rows
    x = torch.randn(PROMPT_ROWS, lin.in_features).to(next(iter(xs.values())).dtype)
    on_direct = _time_ms(lambda: lin(x), repeats=2)
    on_alt = _time_ms(lambda: lin.alt(x), repeats=2)
    times[f"{lin.name}@prompt"], times[f"{lin.alt_name}@prompt"] = on_direct, on_alt
    return PROMPT_ALT_ROWS if on_alt < on_direct else None


def _probe(weight: QuantWeight) -> QuantWeight:
    """A random weight of ``weight``'s kind and shape (at most :data:`PROBE_ROWS` rows) to time
    kernels on: only the layout matters for speed."""
    from dataclasses import replace

    probe = QuantWeight.random(
        min(weight.out_features, PROBE_ROWS),
        weight.in_features,
        weight.bits,
        weight.group_size,
        asymmetric=weight.zeros is not None,
        generator=torch.Generator().manual_seed(0),
    )
    return replace(probe, act=weight.act)


def choose_alt_rows(
    lin: QuantLinearBase, dtype: torch.dtype
) -> tuple[int | None, dict[str, float]]:
    """For a Linear built by its weight's kind that has a second path (W4A8 on AMX-INT8 tiles,
    checked bit-equal to the first when the kernel loaded): from how many rows it runs, timed
    as :func:`choose_kernel` times a candidate's paths, and the times."""
    xs = {t: torch.randn(t, lin.in_features).to(dtype) for t in DECODE_ROWS}
    times = {f"{lin.name}@{t}": _time_ms(lambda x=x: lin(x)) for t, x in xs.items()}
    direct = {t: times[f"{lin.name}@{t}"] for t in xs}
    rows = _alt_from(lin, xs, direct, times)
    return rows, {k: round(v, 4) for k, v in times.items()}


def choose_kernel(weight: QuantWeight, dtype: torch.dtype, kernel: object | None) -> KernelChoice:
    """Time every candidate that passes its self-check on a weight of this shape and kind
    (random values: only the layout matters for speed), each at every decode size on the
    faster of its paths, and return the fastest over the decode sizes together."""
    probe = _probe(weight)
    times: dict[str, float] = {}
    best: tuple[float, QuantLinearBase, int | None] | None = None
    for lin in _candidates(probe, dtype, kernel):
        if not _self_check(lin, probe, dtype):
            log.warning("quantized kernel %s failed its self-check; not used", lin.name)
            continue
        xs = {t: torch.randn(t, probe.in_features).to(dtype) for t in DECODE_ROWS}
        per_rows = {t: _time_ms(lambda x=x, lin=lin: lin(x)) for t, x in xs.items()}
        for t, ms in per_rows.items():
            times[f"{lin.name}@{t}"] = ms
        rows_alt = None
        if lin.alt_name is not None:  # checked when its kernel loaded (its dequantization,
            rows_alt = _alt_from(lin, xs, per_rows, times)  # the tiles against float64)
        ms = sum(per_rows.values())
        times[lin.name] = ms
        if best is None or ms < best[0]:
            best = (ms, lin, rows_alt)
    times = {k: round(v, 4) for k, v in times.items()}
    if best is None:
        return KernelChoice("dequant", times)
    return KernelChoice(best[1].name, times, best[2], best[1].alt_name if best[2] else None)


def build_quant_linear(
    weight: QuantWeight | FP8Weight, dtype: torch.dtype, device: torch.device,
    choice: KernelChoice | None, kernel: object | None,
) -> QuantLinearBase:  # fmt: skip
    """The Linear for ``weight``: a W8A8 or float8 one by its kind, else the ``choice``'s."""
    if isinstance(weight, FP8Weight):
        return FP8Linear(weight)
    if weight.act is not None:
        if device.type == "cpu":
            for make in (
                lambda: W8A8Int8Linear(weight, kernel),
                lambda: PanelW4A8Linear(weight, usable_quant_panels()),
            ):
                try:
                    return make()
                except KernelBuildError:
                    continue  # not its weight kind, or not this CPU
        return DequantLinear(weight)  # the same product, emulated: every device and format
    name = choice.name if choice is not None else "dequant"
    lin: QuantLinearBase
    if name == "c-kernel":
        lin = CKernelLinear(weight, kernel)
    elif name == "torch-int4":
        lin = TorchInt4Linear(weight, dtype)
    elif name in ("panel-int4", "panel-int8"):
        lin = PanelQuantLinear(weight, dtype, usable_quant_panels())
    elif name == "torch-int8":
        lin = TorchInt8Linear(weight, dtype)
    else:
        lin = DequantLinear(weight)
    if choice is not None and lin.alt_name is not None:
        lin.alt_rows = choice.alt_rows
    return lin


class QuantKernels:
    """The quantized-Linear factory of one model: loads the C kernel once (CPU), picks a
    kernel once per distinct weight kind (shape, bits, group size, zero points) by timing the
    candidates, and builds every projection's Linear with it."""

    def __init__(self, device: torch.device, dtype: torch.dtype, *, measure: bool = True) -> None:
        self.device, self.dtype, self.measure = device, dtype, measure
        self.kernel: object | None = None
        self.choices: dict[tuple[int, int, int, int, bool], KernelChoice] = {}
        self.by_kind: dict[str, str] = {}  # weight kind -> the Linear built for it by kind
        # (kind, N, K, zero points) -> a by-kind Linear's second path: from rows, its times
        self.alt_rows: dict[tuple[str, int, int, bool], tuple[int | None, dict[str, float]]] = {}
        if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
            try:
                self.kernel = load_qgemm()
            except KernelBuildError as e:
                log.warning("quantized GEMM C kernel unavailable (%s); torch kernels only", e)

    def __call__(self, weight: QuantWeight | FP8Weight) -> QuantLinearBase:
        weight = weight.to(self.device)  # checkpoints unpack on the host
        if self.device.type == "cuda" and isinstance(weight, QuantWeight) and weight.act is None:
            triton_linear = self._triton(weight)
            if triton_linear is not None:
                return triton_linear  # type: ignore[return-value]
        choice = None
        if isinstance(weight, QuantWeight) and weight.act is None and self.device.type == "cpu":
            key = (
                weight.out_features,
                weight.in_features,
                weight.bits,
                weight.group_size,
                weight.zeros is not None,
            )
            choice = self.choices.get(key)
            if choice is None:
                if self.measure:
                    choice = choose_kernel(weight, self.dtype, self.kernel)
                else:
                    name = "c-kernel" if self.kernel is not None else "dequant"
                    choice = KernelChoice(name, {})
                self.choices[key] = choice
        lin = build_quant_linear(weight, self.dtype, self.device, choice, self.kernel)
        if choice is None:  # built by its kind (W8A8, W4A8, float8)
            kind = _kind(weight)
            self.by_kind[kind] = lin.name
            if lin.alt_name is not None and self.measure and isinstance(weight, QuantWeight):
                self._second_path(lin, weight, kind)
        return lin

    def _second_path(self, lin: QuantLinearBase, weight: QuantWeight, kind: str) -> None:
        """Set from how many rows ``lin``'s second path runs: timed once per kind and shape on
        a probe weight (:func:`choose_alt_rows`)."""
        key = (kind, weight.out_features, weight.in_features, weight.zeros is not None)
        if key not in self.alt_rows:
            probe = build_quant_linear(_probe(weight), self.dtype, self.device, None, self.kernel)
            self.alt_rows[key] = choose_alt_rows(probe, self.dtype)
        rows, times = self.alt_rows[key]
        lin.alt_rows = rows
        timed = ", ".join(f"{name} {ms:.3f} ms" for name, ms in times.items())
        on = f" + {lin.alt_name} from {rows} rows" if rows is not None else ""
        self.by_kind[kind] = f"{lin.name}{on} ({timed})"

    def _triton(self, weight: QuantWeight) -> object | None:
        """The Triton kernel for ``weight`` on CUDA, or None (no Triton: the dequantizing
        Linear serves it, with one warning)."""
        try:
            from loraplex.model.quant.triton_gemm import TritonQuantLinear
        except ImportError as e:
            if not self.choices:
                log.warning("Triton unavailable (%s): quantized weights dequantize per call", e)
            return None
        return TritonQuantLinear(weight)

    def summary(self) -> str:
        """One line per weight kind: the kernel picked and the times it was picked by."""
        lines = []
        for (n, k, bits, gs, zp), c in self.choices.items():
            times = ", ".join(f"{name} {ms:.3f} ms" for name, ms in c.times_ms.items())
            g = "channel" if gs == k else f"g{gs}"
            name = c.name
            if c.alt_rows is not None:
                name += f" + {c.alt_name} from {c.alt_rows} rows"
            lines.append(f"int{bits} {g}{' zp' if zp else ''} [{n}, {k}]: {name} ({times})")
        lines += [f"{kind}: {name}" for kind, name in self.by_kind.items()]
        return "; ".join(lines)


def _kind(weight: QuantWeight | FP8Weight) -> str:
    """A weight's kind as a summary names it: ``w4a8 g128``, ``w8a8 channel``, ``fp8``."""
    if isinstance(weight, FP8Weight):
        return "fp8" + ("" if weight.act is None else f" a{weight.act.kind}")
    g = "channel" if weight.group_size == weight.in_features else f"g{weight.group_size}"
    act = "16" if weight.act is None else "8"
    return f"w{weight.bits}a{act} {g}"
