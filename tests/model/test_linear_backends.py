"""Base linear implementations: which one a CPU gets, and the bfloat16-on-a-plain-CPU path."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from loraplex import LLM, SamplingParams
from loraplex.lora import backends
from loraplex.model import linear
from loraplex.model.linear import DenseLinear, UpcastCPULinear, select_linear_factory
from loraplex.requests import LoRARequest
from loraplex.testing import load_merged_reference, make_random_adapter

CPU = torch.device("cpu")


def test_selection_follows_the_cpu_and_dtype() -> None:
    name, make = select_linear_factory(CPU, torch.bfloat16, native_bf16=False)
    assert (name, make) == ("upcast-f32", UpcastCPULinear)
    assert select_linear_factory(CPU, torch.bfloat16, native_bf16=True)[0] != "upcast-f32"
    for native in (True, False):  # float32 never widens
        assert select_linear_factory(CPU, torch.float32, native_bf16=native)[0] != "upcast-f32"


def test_native_bf16_needs_the_cpu_and_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Native bf16 means dot products oneDNN may use: held below them (``ONEDNN_MAX_CPU_ISA``),
    an AMX CPU's bf16 GEMMs are as slow as an AVX2 CPU's."""
    monkeypatch.setattr(linear, "_onednn_bf16", lambda: False)
    assert not linear.cpu_has_fast_bf16()
    assert select_linear_factory(CPU, torch.bfloat16)[0] == "upcast-f32"


@pytest.mark.parametrize("bias", [False, True])
def test_upcast_rows_compute_in_float32_and_few_rows_stay_bf16(bias: bool) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=g).to(torch.bfloat16)
    b = torch.randn(48, generator=g).to(torch.bfloat16) if bias else None
    lin = UpcastCPULinear(w, b)
    assert isinstance(lin, DenseLinear) and lin.nbytes == w.nbytes + (b.nbytes if bias else 0)
    n = UpcastCPULinear.UPCAST_MIN_ROWS
    many = torch.randn(n + 3, 40, generator=g).to(torch.bfloat16)
    got = lin(many)
    bf = b.float() if b is not None else None
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, F.linear(many.float(), w.float(), bf).to(torch.bfloat16))
    # the widened product is the exact one rounded once: within half a bf16 ulp of float64
    exact = F.linear(many.double(), w.double(), b.double() if b is not None else None)
    assert torch.allclose(got.double(), exact, rtol=2**-8, atol=1e-6)
    few = many[: n - 1]
    assert torch.equal(lin(few), F.linear(few, w, b))


BF16_UNIT_ROUNDOFF = 2.0**-8
"""bfloat16 keeps 8 significant bits and rounds to nearest: ``|fl(x) - x| <= u |x|``."""


def bf16_rounding_points(num_layers: int) -> int:
    """Roundings to bf16 on the path from an embedding row to a logit in the engine's bf16
    forward: 24 per decoder layer and 5 outside them (the list is in the test below)."""
    return 24 * num_layers + 5


def bf16_logprob_bound(num_layers: int, logit_scale: float, lam: float = 3.0) -> float:
    """``2 lam sqrt(k) u M``: how far bf16 may move a logprob, or the gap between two logits,
    from its float32 value (derived in the test below)."""
    k = bf16_rounding_points(num_layers)
    return 2 * lam * math.sqrt(k) * BF16_UNIT_ROUNDOFF * logit_scale


def _first_logprobs(llm: LLM, ids: list[int], lora: LoRARequest) -> dict[int, float]:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=20)
    out = llm.generate({"prompt_token_ids": ids}, params, lora_request=lora)
    return out[0].outputs[0].logprobs[0].top


@torch.no_grad()
def _last_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0, -1].double()  # [vocab]


def test_bf16_engine_on_the_upcast_path_matches_the_merged_reference(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bfloat16 engine making an AVX2 CPU's choices (the upcast linears; prefill LoRA runs
    in float32) and one making a native-bf16 CPU's (packed or plain bf16 GEMMs; prefill LoRA
    runs in bf16), whatever CPU runs the test: prompts long enough for the upcast path's float32
    GEMMs give the float32 merged reference's logprobs within what bf16 guarantees, both ways.

    What bf16 guarantees is the same on every CPU: each rounding to bf16 is within u = 2^-8 of
    its value, relatively. The native kernels (AMX, AVX512-BF16), ATen's bf16 GEMM on AVX2 and
    the upcast path all accumulate in float32 and round at the same points; the bits differ
    with the CPU (summation order, and whether a prefill LoRA run rounds its shrink to bf16),
    so one prompt lands at different distances from float32 on AMX and on AVX2. A fixed 0.1 is
    no property of bf16: transformers' own bf16 forward of the merged model misses its float32
    logprobs by as much as the engine does.

    The bound, from the rounding points and the logits:

    * k = 24 L + 5 roundings from an embedding row to a logit (L layers). Attention block 13:
      norm 2 (normalised, times its weight), q/k/v GEMM 2 (weight, output), LoRA add 1, rotary
      3 (cos/sin, a product, the sum), attention output 1 (float32 inside), o_proj 2, LoRA add
      1, residual add 1. MLP block 11: norm 2, gate/up 2, LoRA add 1, SiLU 1, product 1, down 2,
      LoRA add 1, residual 1. Outside: embedding row 1, final norm 2, head 2. (A LoRA branch's
      own roundings scale with the adapter's small share of its module's output.)
    * Rounding errors act as independent mean-zero variables, so k of them compound to within
      about lam sqrt(k) u of 1 with probability >= 1 - 2 exp(-lam^2 (1 - u)^2 / 2) (Higham and
      Mary, "A new approach to probabilistic rounding error analysis", SIAM J. Sci. Comput.
      41(5), 2019), not the worst case k u (which would exceed the adapter's own effect here).
    * Every sublayer reads its input RMS-normalised, so errors travel as relative errors of
      normalised activations and reach the logits relative to their scale, M = max |z| of the
      float32 logits: |dz_j| <= lam sqrt(k) u M for every token j.
    * lp_t = z_t - logsumexp(z) moves by |dz_t - sum_j p_j dz_j| <= 2 lam sqrt(k) u M = tol;
      a gap z_a - z_b by |dz_a - dz_b| <= tol too. So each logprob is within tol of float32,
      every two tokens more than tol apart in float32 keep their order, and the greedy token is
      within tol of the float32 best (it is the float32 argmax where the margin exceeds tol).

    lam = 3 (>= 97.7 %), L = 3: tol = 6 sqrt(77) 2^-8 M, about 0.21 M. It still tells the
    adapter apart: the base model without it is further than tol from the reference (asserted),
    so an engine that dropped or mis-scaled the adapter fails."""
    adapter = make_random_adapter(tiny_model, tmp_path / "a", r=8, seed=3, std=0.1)
    lora = LoRARequest("a", str(adapter))
    g = torch.Generator().manual_seed(1)
    n = UpcastCPULinear.UPCAST_MIN_ROWS + 16
    prompts = [torch.randint(5, 200, (n,), generator=g).tolist() for _ in range(3)]
    ref = load_merged_reference(tiny_model, adapter)
    base = load_merged_reference(tiny_model, None)
    layers = ref.config.num_hidden_layers
    ref_lp, tols = [], []
    for ids in prompts:
        z = _last_logits(ref, ids)
        lp = torch.log_softmax(z, dim=-1)
        tol = bf16_logprob_bound(layers, float(z.abs().max()))
        no_adapter = torch.log_softmax(_last_logits(base, ids), dim=-1)
        assert float((no_adapter - lp)[lp.topk(20).indices].abs().max()) > tol
        ref_lp.append(lp)
        tols.append(tol)
    ordered_pairs = 0
    for native in (False, True):  # as on an AVX2 CPU, then as on one with native bf16
        monkeypatch.setattr(linear, "cpu_has_fast_bf16", lambda native=native: native)
        slow = () if native else (torch.bfloat16, torch.float16)
        monkeypatch.setattr(backends, "cpu_slow_matmul_dtypes", lambda slow=slow: slow)
        llm = LLM(str(tiny_model), dtype="bfloat16", max_lora_rank=8, max_loras=1)
        assert (llm.engine.model.linear_impl == "upcast-f32") is not native
        ops = llm.engine.model.lora.ops
        assert (torch.bfloat16 in getattr(ops, "fallback", ops).native_runs) is native
        for ids, lp, tol in zip(prompts, ref_lp, tols, strict=True):
            top = _first_logprobs(llm, ids, lora)  # the engine's 20 most likely tokens
            for t, got in top.items():
                assert abs(got - float(lp[t])) <= tol, (native, t, got, float(lp[t]), tol)
            for a, b in itertools.permutations(top, 2):
                if float(lp[a] - lp[b]) > tol:
                    assert top[a] > top[b], (native, a, b, tol)
                    ordered_pairs += 1
            greedy = max(top, key=top.__getitem__)
            assert float(lp[greedy]) >= float(lp.max()) - tol
    assert ordered_pairs > 0  # the order check is not empty
