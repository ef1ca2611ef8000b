"""The C layer ops (``loraplex.model.layer_ops``: residual + RMSNorm, rotary, the gated
activation, decode attention) against the torch ops and float64, on every build this CPU
can run (``native``, ``avx2``, ``portable``), and how the model chooses them.

Tolerances come from the arithmetic: the residual add and rotary are the same float32 / bf16
operations in the same order as torch's, so they are equal bit for bit; the norm's statistic
sums in another order (float32: a few ulp; bf16: the rounded result at most one bf16 ulp
away); exp / tanh are polynomials within a few float32 ulp of the true value; attention sums
scores and values over at most 64 positions in float32.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch

from loraplex.kv.cache import PagedKVCache
from loraplex.model import layer_ops
from loraplex.model.attention import (
    AttentionMetadata,
    WindowMasks,
    decode_mask,
    sdpa_attend,
    softcap_attend,
)
from loraplex.model.layer_ops import (
    ACTIVATION_CODES,
    CLayerOps,
    TorchLayerOps,
    load_layer_ops,
    select_layer_ops,
)
from loraplex.model.layers import GemmaRMSNorm, RMSNorm
from loraplex.model.norms import Float32ScaleRMSNorm
from loraplex.native.build import KERNEL_ISAS, KernelBuildError
from loraplex.testing.kernels import runnable_build

DTYPES = (torch.float32, torch.bfloat16)
F32_EPS = torch.finfo(torch.float32).eps
BF16_ULP = 2.0**-7  # a bf16 value's spacing relative to its magnitude is at most 2^-7
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=list(KERNEL_ISAS))
def ops(request: pytest.FixtureRequest) -> CLayerOps:
    """The C ops of each build this CPU can run (each test runs once per build)."""
    return CLayerOps(runnable_build(load_layer_ops, request.param))


REF = TorchLayerOps()


def _within_one_bf16_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    diff = (got.float() - want.float()).abs()
    assert bool((diff <= BF16_ULP * want.float().abs()).all()), diff.max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_cls", [RMSNorm, GemmaRMSNorm, Float32ScaleRMSNorm])
def test_residual_and_norm(ops, dtype, norm_cls):
    g = torch.Generator().manual_seed(3)
    h = (torch.randn(33, 1000, generator=g) * 4).to(dtype)
    delta = torch.randn(33, 1000, generator=g).to(dtype)
    norm = norm_cls((torch.randn(1000, generator=g) * 0.5 + 1).to(dtype), 1e-6)
    got_h, got = ops.add_norm(h.clone(), delta, norm)
    want_h, want = REF.add_norm(h.clone(), delta, norm)
    assert torch.equal(got_h, want_h)  # the same rounded add
    if dtype == torch.float32:  # another summation order of the statistic
        torch.testing.assert_close(got, want, rtol=8 * F32_EPS, atol=0)
    else:
        _within_one_bf16_ulp(got, want)
    # without a residual: the norm of h, h untouched
    h2 = h.clone()
    same, normed = ops.add_norm(h2, None, norm)
    assert same is h2 and torch.equal(h2, h)
    if dtype == torch.float32:
        torch.testing.assert_close(normed, norm(h), rtol=8 * F32_EPS, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hd", "rd"), [(64, 64), (96, 64), (18, 18)])
def test_rotary_in_place_is_torch_bit_for_bit(ops, dtype, hd, rd):
    """On q/k heads that are a strided view of the fused q/k/v output, partial rotary too."""
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(21, 7 * hd, generator=g).to(dtype)
    qk = qkv[:, : 5 * hd].view(21, 5, hd)  # row stride 7 hd
    ang = torch.randn(21, 1, rd // 2, generator=g) * 20
    cos, sin = (torch.cat((f(ang), f(ang)), -1).to(dtype) for f in (torch.cos, torch.sin))
    want = REF.rotary(qk.clone(), cos, sin)
    v_before = qkv[:, 5 * hd :].clone()
    got = ops.rotary(qk, cos, sin)
    assert got.data_ptr() == qkv.data_ptr()  # in place
    assert torch.equal(got, want)
    assert torch.equal(qkv[:, 5 * hd :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", list(ACTIVATION_CODES))
def test_gated_activation(ops, dtype, act):
    g = torch.Generator().manual_seed(5)
    gu = (torch.randn(17, 2 * 777, generator=g) * 6).to(dtype)
    got, want = ops.gated(gu, 777, act), REF.gated(gu, 777, act)
    # a few float32 ulp of exp / tanh, scaled by the terms they multiply (gelu's 0.5 x (1 + t)
    # cancels for large negative x: that error is relative to |x up|, not to the result); in
    # bf16 that float32 difference may move the rounding by one bf16 ulp
    x, up = gu[:, :777].double(), gu[:, 777:].double()
    bound = 8 * F32_EPS * (x.abs() * up.abs() + want.double().abs())
    if dtype == torch.bfloat16:
        bound = bound + BF16_ULP * want.double().abs()
    assert bool(((got.double() - want.double()).abs() <= bound).all())


def _attention_case(dtype: torch.dtype, g: torch.Generator):
    """Five decode rows of a step of seven tokens (rows 0, 2, 3, 5, 6), contexts of 1 to 64
    positions over blocks in any order, GQA with 8 query heads on 2 KV heads, hd 40 (not a
    multiple of the vector width: every tail runs)."""
    bs, hd, kvh, heads = 16, 40, 2, 8
    cache = PagedKVCache(1, 24, bs, kvh, hd, dtype, CPU)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    lens = torch.tensor([1, 17, 64, 33, 48])
    blocks = torch.randperm(24, generator=g)[:20].view(5, 4)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(7, dtype=torch.long),
        decode_tokens=torch.tensor([0, 2, 3, 5, 6]),
        decode_block_table=blocks,
        decode_mask=decode_mask(lens, 4 * bs),
        decode_lens=lens,
    )
    q = torch.randn(7, heads, hd, generator=g).to(dtype)
    return cache, meta, q, lens, blocks, bs


def _float64_attention(q, cache, lens, blocks, bs, scale, window=None, cap=None, sinks=None):
    """softmax(q k^T * scale) v per decode row, in float64 from the cache's slots (each head's
    sink logit joining its softmax, then dropped)."""
    heads, kvh = q.shape[1], cache.k.shape[2]
    out = []
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        if window is not None:
            pos = pos[pos >= n - window]
        slots = blocks[b][pos // bs] * bs + pos % bs
        k = cache.k[0][slots].double().repeat_interleave(heads // kvh, dim=1)  # [L, H, hd]
        v = cache.v[0][slots].double().repeat_interleave(heads // kvh, dim=1)
        s = torch.einsum("hd,lhd->hl", q[b].double(), k) * scale
        if cap is not None:
            s = torch.tanh(s / cap) * cap
        if sinks is not None:
            s = torch.cat((s, sinks.double()[:, None]), -1)
        p = torch.softmax(s, -1)[:, : v.shape[0]]
        out.append(torch.einsum("hl,lhd->hd", p, v))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("window", "cap", "sink"), [(None, None, 0), (20, None, 0), (None, 3.0, 0), (20, None, 1)]
)
def test_decode_attention_reads_the_blocks(ops, dtype, window, cap, sink):
    g = torch.Generator().manual_seed(6)
    cache, meta, q, lens, blocks, bs = _attention_case(dtype, g)
    sinks = (torch.randn(8, generator=g) * 3).to(dtype) if sink else None  # GPT-OSS's
    masks = None
    if window is not None:
        masks = WindowMasks(decode=decode_mask(lens, 4 * bs, window), size=window)
    attend = sdpa_attend if cap is None else functools.partial(softcap_attend, cap=cap)
    # rows that are not decode rows keep what they had
    args = (0, cache, meta, 0.2, masks, attend, cap, sinks)
    got = ops.decode_attention(q, torch.full_like(q, 7.0), *args)
    want = REF.decode_attention(q, torch.full_like(q, 7.0), *args)
    rows = meta.decode_tokens
    assert bool((got[[1, 4]] == 7.0).all())
    exact = _float64_attention(q[rows], cache, lens, blocks, bs, 0.2, window, cap, sinks)
    if dtype == torch.float32:  # sums of at most 64 terms in float32
        torch.testing.assert_close(got[rows].double(), exact, atol=64 * F32_EPS, rtol=0)
    else:  # float32 inside, one rounding to bf16 at the end
        diff = (got[rows].double() - exact).abs()
        assert bool((diff <= BF16_ULP / 2 * exact.abs() + 64 * F32_EPS).all()), diff.max()
        # the torch path (SDPA rounds its weights to bf16) is no closer to the exact values
        assert diff.max() <= (want[rows].double() - exact).abs().max() + 1e-6
    assert torch.equal(got[[1, 4]], want[[1, 4]])


def test_decode_attention_all_rows_and_single_position(ops):
    """``decode_all`` (no row index) and a context of one position (softmax of one score)."""
    g = torch.Generator().manual_seed(7)
    cache = PagedKVCache(1, 4, 16, 1, 64, torch.float32, CPU)
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(2, dtype=torch.long),
        decode_tokens=torch.arange(2),
        decode_all=True,
        decode_block_table=torch.tensor([[2], [3]]),
        decode_mask=decode_mask(torch.tensor([1, 1]), 16),
        decode_lens=torch.tensor([1, 1]),
    )
    q = torch.randn(2, 4, 64, generator=g)
    want = cache.v[0][[32, 48]].expand(2, 4, 64)  # [2, 4 query heads on 1 KV head, 64]
    for impl in (ops, REF):
        out = impl.decode_attention(
            q, torch.empty_like(q), 0, cache, meta, 0.125, None, sdpa_attend, None
        )
        torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_what_the_kernel_does_not_read_goes_to_torch(ops):
    """float16, a norm without a kernel mode, a non-unit inner stride and metadata without
    lengths: the torch ops' results."""
    g = torch.Generator().manual_seed(8)
    h = torch.randn(4, 32, generator=g).half()
    norm = RMSNorm(torch.ones(32).half(), 1e-6)
    assert torch.equal(ops.add_norm(h, h, norm)[1], REF.add_norm(h, h, norm)[1])

    class PlainNorm(RMSNorm):
        kernel_mode = None

    x = torch.randn(4, 32, generator=g)
    plain = PlainNorm(torch.ones(32), 1e-6)
    assert torch.equal(ops.add_norm(x, None, plain)[1], plain(x))
    gu = torch.randn(4, 8, generator=g).t()  # [8, 4], inner stride 8
    assert torch.equal(ops.gated(gu, 2, "silu"), REF.gated(gu, 2, "silu"))
    cache, meta, q, *_ = _attention_case(torch.float32, g)
    meta.decode_lens = None
    got = ops.decode_attention(q, torch.zeros_like(q), 0, cache, meta, 0.2, None, sdpa_attend, None)
    want = REF.decode_attention(
        q, torch.zeros_like(q), 0, cache, meta, 0.2, None, sdpa_attend, None
    )
    assert torch.equal(got, want)


def test_the_model_chooses_the_kernel_on_cpu_and_torch_elsewhere(monkeypatch, caplog):
    assert isinstance(select_layer_ops(torch.float32, CPU), CLayerOps)
    assert isinstance(select_layer_ops(torch.bfloat16, CPU), CLayerOps)
    assert isinstance(select_layer_ops(torch.float16, CPU), TorchLayerOps)
    assert isinstance(select_layer_ops(torch.float32, torch.device("meta")), TorchLayerOps)
    monkeypatch.setenv("LORAPLEX_LAYER_CPU_KERNEL", "0")
    assert isinstance(select_layer_ops(torch.float32, CPU), TorchLayerOps)
    monkeypatch.delenv("LORAPLEX_LAYER_CPU_KERNEL")

    def broken(*args: object, **kwargs: object) -> None:
        raise KernelBuildError("no C compiler found")

    monkeypatch.setattr(layer_ops, "load_layer_ops", broken)
    layer_ops._warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="loraplex.model.layer_ops"):
        assert isinstance(select_layer_ops(torch.float32, CPU), TorchLayerOps)
    assert "no C compiler found" in caplog.text and "using torch ops" in caplog.text
