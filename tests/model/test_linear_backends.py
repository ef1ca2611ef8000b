"""Base linear implementations: which one a CPU gets, and the bfloat16-on-a-plain-CPU path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from loraplex import LLM, SamplingParams
from loraplex.model import linear
from loraplex.model.linear import DenseLinear, UpcastCPULinear, select_linear_factory
from loraplex.requests import LoRARequest
from loraplex.testing import load_merged_reference, make_random_adapter, reference_greedy

CPU = torch.device("cpu")


def test_selection_follows_the_cpu_and_dtype() -> None:
    name, make = select_linear_factory(CPU, torch.bfloat16, native_bf16=False)
    assert (name, make) == ("upcast-f32", UpcastCPULinear)
    assert select_linear_factory(CPU, torch.bfloat16, native_bf16=True)[0] != "upcast-f32"
    for native in (True, False):  # float32 never widens
        assert select_linear_factory(CPU, torch.float32, native_bf16=native)[0] != "upcast-f32"


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


def _first_logprobs(llm: LLM, ids: list[int], lora: LoRARequest) -> dict[int, float]:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=5)
    out = llm.generate({"prompt_token_ids": ids}, params, lora_request=lora)
    return out[0].outputs[0].logprobs[0].top


def test_bf16_engine_on_the_upcast_path_matches_the_merged_reference(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bfloat16 engine on a CPU without native bf16 (forced here, whatever CPU runs the test):
    a prompt long enough to take the float32 path gives the merged reference's logprobs, as
    the bf16 kernels do, and the same top tokens as the native path."""
    adapter = make_random_adapter(tiny_model, tmp_path / "a", r=8, seed=3)
    lora = LoRARequest("a", str(adapter))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 200, (UpcastCPULinear.UPCAST_MIN_ROWS + 16,), generator=g).tolist()
    ref = load_merged_reference(tiny_model, adapter)
    _, ref_lp = reference_greedy(ref, ids, 1)
    tops = {}
    for native in (False, True):
        monkeypatch.setattr(linear, "cpu_has_fast_bf16", lambda native=native: native)
        llm = LLM(str(tiny_model), dtype="bfloat16", max_lora_rank=8, max_loras=1)
        assert (llm.engine.model.linear_impl == "upcast-f32") is not native
        tops[native] = _first_logprobs(llm, ids, lora)
        for tid, val in tops[native].items():
            assert abs(val - float(ref_lp[0, tid])) < 0.1
    assert max(tops[False], key=tops[False].get) == max(tops[True], key=tops[True].get)
