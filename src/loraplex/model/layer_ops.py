"""A decoder layer's small ops behind one protocol: the residual add with the next RMSNorm,
rotary on q and k, the gated activation, and decode attention over the paged cache.

At decode sizes these are many torch ops of a few microseconds of arithmetic and more of
dispatch each (a bf16 RMSNorm alone is a conversion, the norm, a cast and a multiply), plus the
decode attention's gather of every context block into a padded copy before SDPA. On a thin
model whose GEMMs read a few MiB per layer they cost as much as the GEMMs (docs/benchmarks.md,
"The rest of the step"). ``CLayerOps`` does each in one C call (``native/layer_ops.c``: semantics
there, HF's rounding steps kept in bf16) and attends straight from the cache's blocks;
``TorchLayerOps`` is the same arithmetic in torch ops, for every other device and dtype, and
the reference the C ops are checked against at load.

``select_layer_ops`` chooses once per model (the decoder's blocks hold the choice): the C ops
on CPU in float32 or bfloat16 where the kernel builds and passes its self-check, else torch.
Per call the C ops check only what they read (dtypes, unit inner strides) and hand anything
else to the torch ops.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from loraplex.config import layer_cpu_kernel_enabled
from loraplex.model.attention import gathered_decode, sink_attend
from loraplex.model.rotary import apply_rotary
from loraplex.native.build import (
    ELEMENT_TYPES,
    SOURCE_DIR,
    KernelBuildError,
    load_checked,
    open_kernel,
)

if TYPE_CHECKING:
    from loraplex.kv.cache import PagedKVCache
    from loraplex.model.attention import AttendFn, AttentionMetadata, WindowMasks
    from loraplex.model.norms import RMSNorm

log = logging.getLogger(__name__)

SOURCE = SOURCE_DIR / "layer_ops.c"

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}
"""``hidden_act`` -> the gated MLP's activation (transformers' ``ACT2FN`` of the same name)."""
ACTIVATION_CODES = {"silu": 0, "gelu_pytorch_tanh": 1}
"""The C kernel's ``act`` code of each of ``ACTIVATIONS``."""

PARALLEL_ELEMENTS = 16384
"""Elementwise calls on fewer values than this run on one thread: at decode sizes an OpenMP
fork and barrier cost more than the arithmetic (a residual add and norm of 16 rows of 576 values
is about 5 us on one Zen 4 core; on two cores that another process also runs on, 20 us)."""


class LayerOps(Protocol):
    """What a decoder layer computes outside its GEMMs (one implementation per model)."""

    name: str

    def add_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``h = h + delta`` (delta None: h as it is), then ``(h, norm(h))``; h: [T, D]. The
        residual may be updated in place: the caller owns ``h`` and uses only what is returned."""
        ...

    def rotary(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``apply_rotary(qk, cos, sin)`` (qk [T, heads, hd]; cos, sin [T, 1, rd]), possibly
        in place in ``qk``."""
        ...

    def gated(self, gu: torch.Tensor, inter: int, act: str) -> torch.Tensor:
        """``ACTIVATIONS[act](gu[:, :inter]) * gu[:, inter:]``: [T, 2 I] -> [T, I]."""
        ...

    def decode_attention(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        layer: int,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        scale: float,
        masks: WindowMasks | None,
        attend: AttendFn,
        softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The step's attention output [T, H, hd] with its decode rows filled (q: [T, H, hd];
        the step's K/V already written): each decode row over its context in the cache, under
        the layer's window masks (``masks``, None: global), scores soft-capped at ``softcap``
        if given, with one sink logit per query head in each softmax if ``sinks [H]`` is given
        (``attention.sink_attend``'s semantics). Written into ``out`` ([T, H, hd], the caller
        fills the other rows) and returned, or, when every token is a decode row, returned in a
        tensor of its own (no copy). ``attend`` is the block's attention function (what the
        gathered path calls)."""
        ...


class TorchLayerOps:
    """The layer ops as torch ops (any device and dtype); decode attention gathers each row's
    blocks into a padded copy and attends through the block's ``attend`` with the mask."""

    name = "torch"

    def add_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if delta is not None:
            h = h + delta
        return h, norm(h)

    def rotary(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary(qk, cos, sin)

    def gated(self, gu: torch.Tensor, inter: int, act: str) -> torch.Tensor:
        return ACTIVATIONS[act](gu[:, :inter]) * gu[:, inter:]

    def decode_attention(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        layer: int,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        scale: float,
        masks: WindowMasks | None,
        attend: AttendFn,
        softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if sinks is not None:  # per-head sinks: the heads stay heads (not G queries of one)
            attend = functools.partial(sink_attend, sinks=sinks)
        return gathered_decode(
            q, out, layer, cache, meta, scale, masks, attend, fold_gqa=sinks is None
        )


class LayerOpsKernel:
    """The loaded ``layer_ops.c`` functions with their argument types (ctypes releases the GIL
    while they run)."""

    def __init__(self, library: Path) -> None:
        lib, (norm, rot, act, attn), self.shared_threads = open_kernel(
            library, "loraplex_add_rms_norm", "loraplex_rotary", "loraplex_gated_act",
            "loraplex_decode_attention",
        )  # fmt: skip
        i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
        norm.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, f32, i32, ptr, i64, i32, i32]
        rot.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, i64, i32, i32]
        act.argtypes = [ptr, i64, i64, i64, i32, ptr, i64, i32, i32]
        attn.argtypes = [
            ptr, i64, ptr, i64, i64, i64, i64, ptr, ptr, ptr, i64, ptr, i64, f32, f32, i64, ptr,
            i64, i32, i32, ptr,
        ]  # fmt: skip
        for fn in (norm, rot, act, attn):
            fn.restype = i32
        self.add_rms_norm, self.rotary, self.gated_act, self.decode_attention = (
            norm, rot, act, attn
        )  # fmt: skip
        self._lib = lib
        self.library = library

    def threads(self, elements: int) -> int:
        if not self.shared_threads or elements < PARALLEL_ELEMENTS:
            return 1
        return torch.get_num_threads()


def _rows(t: torch.Tensor) -> bool:
    """Rows of unit inner stride (the kernel's ``[T, n]`` with a row stride)."""
    return t.dim() == 2 and t.stride(1) == 1


class CLayerOps:
    """The layer ops as one C call each (``layer_ops.c``) for float32 / bfloat16 on CPU; what
    the kernel does not read goes to ``fallback``."""

    name = "cpu-kernel"

    def __init__(self, kernel: LayerOpsKernel, fallback: TorchLayerOps | None = None) -> None:
        self.kernel = kernel
        self.fallback = fallback or TorchLayerOps()

    def add_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        e = ELEMENT_TYPES.get(h.dtype)
        w = norm.weight
        mode = norm.kernel_mode
        if (
            e is None
            or mode is None
            or w.dim() != 1
            or w.dtype != h.dtype
            or not _rows(h)
            or h.shape[1] != w.shape[0]
            or not h.is_cpu
            or (delta is not None and (delta.dtype != h.dtype or not _rows(delta)))
        ):
            return self.fallback.add_norm(h, delta, norm)
        t, d = h.shape
        out = torch.empty_like(h, memory_format=torch.contiguous_format)
        self.kernel.add_rms_norm(
            h.data_ptr(), h.stride(0), 0 if delta is None else delta.data_ptr(),
            0 if delta is None else delta.stride(0), w.data_ptr(), t, d, norm.eps, mode,
            out.data_ptr(), d, e, self.kernel.threads(t * d),
        )  # fmt: skip
        return h, out

    def rotary(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        e = ELEMENT_TYPES.get(qk.dtype)
        t, heads, hd = qk.shape
        rd = cos.shape[-1]
        if (
            e is None
            or cos.dtype != qk.dtype
            or sin.dtype != qk.dtype
            or qk.stride(2) != 1
            or qk.stride(1) != hd
            or cos.stride(-1) != 1
            or sin.stride() != cos.stride()
            or rd % 2
            or rd > hd
            or not qk.is_cpu
        ):
            return self.fallback.rotary(qk, cos, sin)
        self.kernel.rotary(
            qk.data_ptr(), qk.stride(0), t, heads, hd, rd, cos.data_ptr(), sin.data_ptr(),
            cos.stride(0), e, self.kernel.threads(qk.numel()),
        )  # fmt: skip
        return qk

    def gated(self, gu: torch.Tensor, inter: int, act: str) -> torch.Tensor:
        e = ELEMENT_TYPES.get(gu.dtype)
        code = ACTIVATION_CODES.get(act)
        if e is None or code is None or not _rows(gu) or gu.shape[1] != 2 * inter or not gu.is_cpu:
            return self.fallback.gated(gu, inter, act)
        t = gu.shape[0]
        out = torch.empty(t, inter, dtype=gu.dtype)
        self.kernel.gated_act(
            gu.data_ptr(), gu.stride(0), t, inter, code, out.data_ptr(), inter, e,
            self.kernel.threads(t * inter),
        )  # fmt: skip
        return out

    def decode_attention(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        layer: int,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        scale: float,
        masks: WindowMasks | None,
        attend: AttendFn,
        softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kc, vc = cache.layer_kv(layer)  # [slots, KVH, hd]
        e = ELEMENT_TYPES.get(q.dtype)
        lens, table = meta.decode_lens, meta.decode_block_table
        window = 0 if masks is None else masks.size
        if (
            e is None
            or lens is None
            or window is None
            or kc.dtype != q.dtype
            or out.dtype != q.dtype
            or not (kc.is_cpu and kc.is_contiguous() and vc.is_contiguous())
            or q.stride(2) != 1
            or q.stride(1) != q.shape[2]
            or not out.is_contiguous()
            or table.dtype != torch.int64
            or not table.is_contiguous()
            or lens.dtype != torch.int64
            or not (meta.decode_all or meta.decode_tokens.dtype == torch.int64)
        ):
            return self.fallback.decode_attention(
                q, out, layer, cache, meta, scale, masks, attend, softcap, sinks
            )
        if sinks is not None:
            sinks = sinks.to(torch.float32).contiguous()  # [H], what the kernel reads
        bd, nblk = table.shape
        _, heads, hd = q.shape
        rows = meta.decode_tokens
        rc = self.kernel.decode_attention(
            q.data_ptr(), q.stride(0), 0 if meta.decode_all else rows.data_ptr(), bd, heads,
            kc.shape[1], hd, kc.data_ptr(), vc.data_ptr(), table.data_ptr(), nblk,
            lens.data_ptr(), cache.block_size, scale, softcap or 0.0, window, out.data_ptr(),
            heads * hd, e, torch.get_num_threads() if self.kernel.shared_threads else 1,
            0 if sinks is None else sinks.data_ptr(),
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("decode attention kernel: cannot allocate its scratch")
        return out


def load_layer_ops(cache_dir: Path | None = None, *, isa: str | None = None) -> LayerOpsKernel:
    """Build (once per cache key), load and check the kernel; ``KernelBuildError`` if any step
    fails. Memoised per process and instruction set."""
    return load_checked(LayerOpsKernel, _check_kernel, SOURCE, "layer_ops", cache_dir, isa)


def _check_kernel(kernel: LayerOpsKernel) -> None:
    self_check(CLayerOps(kernel))


def select_layer_ops(dtype: torch.dtype, device: torch.device) -> LayerOps:
    """The C ops on CPU in float32 / bfloat16 where the kernel builds and checks (and
    ``$LORAPLEX_LAYER_CPU_KERNEL`` is not ``0``), else torch's (with a warning naming why the
    kernel failed, once per process)."""
    if device.type != "cpu" or dtype not in ELEMENT_TYPES or not layer_cpu_kernel_enabled():
        return TorchLayerOps()
    try:
        return CLayerOps(load_layer_ops())
    except KernelBuildError as e:
        _warn_once(str(e))
        return TorchLayerOps()


@functools.cache
def _warn_once(reason: str) -> None:
    log.warning("layer ops: the C kernel is unavailable (%s); using torch ops", reason)


def self_check(ops: CLayerOps) -> None:
    """Every op in both dtypes against ``TorchLayerOps`` on odd sizes (every vector loop's
    tail, strided q/k rows, partial rotary, GQA, blocks out of order, a window, a chunk and a
    soft cap);
    ``KernelBuildError`` on a mismatch. Tolerances: float32's own rounding (sums in another
    order, exp within a few ulp) and, in bf16, about one unit in the last place."""
    from loraplex.kv.cache import PagedKVCache
    from loraplex.kv.groups import Chunked
    from loraplex.model.attention import (
        AttentionMetadata,
        WindowMasks,
        decode_mask,
        sdpa_attend,
        softcap_attend,
    )
    from loraplex.model.norms import Float32ScaleRMSNorm, GemmaRMSNorm, RMSNorm

    ref = TorchLayerOps()
    g = torch.Generator().manual_seed(0)

    def check(what: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
        tol = 2e-5 if dtype == torch.float32 else 1.6e-2
        if not torch.allclose(got.float(), want.float(), atol=tol, rtol=tol):
            diff = (got.float() - want.float()).abs().max().item()
            raise KernelBuildError(
                f"layer ops kernel: {what} disagrees with torch in {dtype} (max diff {diff:.3g})"
            )

    bs, hd = 4, 20
    table = torch.tensor([[3, 1, 7], [0, 5, 0], [8, 2, 4]])  # 3 decode rows, blocks out of order
    lens = torch.tensor([11, 5, 12])
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(5, dtype=torch.long),
        decode_tokens=torch.tensor([0, 2, 4]),  # of the step's 5 tokens
        decode_block_table=table,
        decode_mask=decode_mask(lens, 3 * bs),
        decode_lens=lens,
    )
    window = WindowMasks(decode=decode_mask(lens, 3 * bs, 5), size=5)
    chunked = WindowMasks(decode=decode_mask(lens, 3 * bs, Chunked(4)), size=-4)
    sinks = torch.randn(6, generator=g) * 2
    attends = (
        (None, sdpa_attend, None, None),
        (window, sdpa_attend, None, None),
        (chunked, sdpa_attend, None, None),
        (None, functools.partial(softcap_attend, cap=2.0), 2.0, None),
        (window, sdpa_attend, None, sinks),
    )
    for dtype in ELEMENT_TYPES:
        h = torch.randn(5, 37, generator=g).to(dtype)
        delta = torch.randn(5, 37, generator=g).to(dtype)
        for cls in (RMSNorm, GemmaRMSNorm, Float32ScaleRMSNorm):
            norm = cls((torch.randn(37, generator=g) * 0.5 + 1).to(dtype), 1e-6)
            gh, gn = ops.add_norm(h.clone(), delta, norm)
            wh, wn = ref.add_norm(h.clone(), delta, norm)
            check(f"{cls.__name__} residual", gh, wh, dtype)
            check(cls.__name__, gn, wn, dtype)
        for rhd, rd in ((18, 18), (24, 16)):
            fused = torch.randn(5, 4 * rhd, generator=g).to(dtype)  # rows of q, k and v
            qk = fused[:, : 3 * rhd].view(5, 3, rhd)  # [5, 3, hd], row stride 4 hd
            ang = torch.randn(5, 1, rd // 2, generator=g)
            cos, sin = (torch.cat((f(ang), f(ang)), -1).to(dtype) for f in (torch.cos, torch.sin))
            want = ref.rotary(qk.clone(), cos, sin)
            check(f"rotary ({rd} of {rhd} dims)", ops.rotary(qk, cos, sin), want, dtype)
        gu = (torch.randn(5, 2 * 41, generator=g) * 3).to(dtype)
        for act in ACTIVATION_CODES:
            check(act, ops.gated(gu, 41, act), ref.gated(gu, 41, act), dtype)
        cache = PagedKVCache(1, 9, bs, 2, hd, dtype, torch.device("cpu"))  # GQA: 6 q on 2 kv
        for t in cache.layer_kv(0):
            t.copy_(torch.randn(t.shape, generator=g))
        q = torch.randn(5, 6, hd, generator=g).to(dtype)
        for masks, attend, cap, sk in attends:
            sk = None if sk is None else sk.to(dtype)
            got = ops.decode_attention(
                q, torch.zeros_like(q), 0, cache, meta, 0.3, masks, attend, cap, sk
            )
            want = ref.decode_attention(
                q, torch.zeros_like(q), 0, cache, meta, 0.3, masks, attend, cap, sk
            )
            size = None if masks is None else masks.size
            what = f"decode attention (window {size}, cap {cap}, sinks {sk is not None})"
            check(what, got, want, dtype)
