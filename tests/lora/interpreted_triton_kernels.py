"""Triton LoRA kernels vs the torch reference, run by Triton's CPU interpreter (no GPU needed).

Not collected by the suite itself: Triton reads ``TRITON_INTERPRET`` when it is imported, so
``tests/lora/test_triton_kernels.py`` runs this file in its own pytest process with the variable set,
and no other test of the run sees it.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/lora/test_triton_kernels.py"
pytest.importorskip("triton")

from loraplex.lora.ops import TorchReferenceOps  # noqa: E402
from loraplex.lora.plan import plan_lora_batch  # noqa: E402
from loraplex.lora.triton_ops import TritonLoRAOps  # noqa: E402


def _seed(*parts: object) -> int:
    """A seed that is the same in every process (``hash()`` of a str is salted per process)."""
    return zlib.crc32(repr(parts).encode())


CASES = {
    # name: (num_tokens, segments (tok_start, tok_end, row_start, row_end), capacity rows)
    "decode": (6, [(0, 1, 0, 8), (1, 2, 8, 24), (2, 3, 24, 28), (4, 5, 40, 104)], 128),
    "prefill": (70, [(3, 40, 0, 16), (40, 41, 16, 17), (45, 70, 64, 128)], 128),
    "base-only": (4, [], 32),
    "empty-segments": (8, [(0, 0, 0, 8), (2, 6, 8, 16), (6, 6, 16, 24)], 32),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d_in,d_out", [(32, 48), (80, 20)])
def test_triton_matches_reference(case: str, dtype: torch.dtype, d_in: int, d_out: int) -> None:
    T, segs, cap = CASES[case]
    g = torch.Generator().manual_seed(_seed(case, d_in))
    x = torch.randn(T, d_in, generator=g).to(dtype)
    a = (0.3 * torch.randn(cap, d_in, generator=g)).to(dtype)
    bt = (0.3 * torch.randn(cap, d_out, generator=g)).to(dtype)
    base = torch.randn(T, 2 * d_out, generator=g).to(dtype)
    plan = plan_lora_batch(T, segs, dtype, "cpu")
    ops, ref = TritonLoRAOps(), TorchReferenceOps()
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.03)
    torch.testing.assert_close(
        ops.shrink(x, a, plan).float(), ref.shrink(x, a, plan).float(), **tol
    )
    got, want = base.clone(), base.clone()
    ops.apply(x, a, bt, got[:, d_out:], plan)  # a column slice of a wider output, as in the model
    ref.apply(x, a, bt, want[:, d_out:], plan)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    assert torch.equal(got[:, :d_out], base[:, :d_out])  # the other columns are untouched
    untouched = [t for t in range(T) if not any(s <= t < e for s, e, _, _ in segs)]
    assert torch.equal(got[untouched], base[untouched])  # base-model tokens get no delta


def test_segment_table_is_built_once_per_plan() -> None:
    ops = TritonLoRAOps()
    plan = plan_lora_batch(2, [(0, 2, 0, 4)], torch.float32, "cpu")
    first = ops._segments(plan, torch.device("cpu"))[0]
    assert ops._segments(plan, torch.device("cpu"))[0] is first
    other = plan_lora_batch(2, [(0, 1, 0, 4)], torch.float32, "cpu")
    assert ops._segments(other, torch.device("cpu"))[0] is not first


def test_startup_self_check_and_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    from loraplex.lora import backends as ops_mod

    cpu = torch.device("cpu")
    assert isinstance(ops_mod._create_triton_ops(cpu), TritonLoRAOps)  # passes its self-check

    def broken(self, x, a, bt, out, plan) -> None:
        out.add_(1.0)  # wrong numbers: must not be served

    monkeypatch.setattr(TritonLoRAOps, "apply", broken)
    with pytest.warns(UserWarning, match="using the torch path"):
        fallback = ops_mod._create_triton_ops(cpu)
    assert not isinstance(fallback, TritonLoRAOps)
    # on CPU the default choice never picks Triton
    assert ops_mod.select_lora_ops(cpu).name in ("cpu-kernel", "torch-upcast")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_embedding_lora_gathers_a_by_token_id(dtype: torch.dtype) -> None:
    """``embed``: the expand kernel reading y's rows at the token ids of a transposed table."""
    vocab, d, cap = 53, 40, 128
    T, segs, _ = CASES["prefill"]
    g = torch.Generator().manual_seed(_seed("embed", str(dtype)))
    ids = torch.randint(0, vocab, (T,), generator=g)  # [T]
    at = (0.3 * torch.randn(vocab, cap, generator=g)).to(dtype)  # [vocab, capacity]
    bt = (0.3 * torch.randn(cap, d, generator=g)).to(dtype)  # [capacity, d]
    base = torch.randn(T, d, generator=g).to(dtype)
    plan = plan_lora_batch(T, segs, dtype, "cpu")
    got, want = base.clone(), base.clone()
    TritonLoRAOps().embed(ids, at, bt, got, plan)
    TorchReferenceOps().embed(ids, at, bt, want, plan)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.03)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    untouched = [t for t in range(T) if not any(s <= t < e for s, e, _, _ in segs)]
    assert torch.equal(got[untouched], base[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_lm_head_lora_over_the_logits_rows(dtype: torch.dtype) -> None:
    """The head's LoRA is ``apply`` over ``plan_rows`` of the step: a vocabulary-wide output in
    float32 (the logits) from rows of the model's dtype."""
    from loraplex.lora.plan import plan_rows

    vocab, d, cap = 300, 32, 128
    T, segs, _ = CASES["prefill"]
    g = torch.Generator().manual_seed(_seed("head", str(dtype)))
    rows = [0, 3, 39, 40, 44, 45, 69]
    x = torch.randn(len(rows), d, generator=g).to(dtype)
    a = (0.3 * torch.randn(cap, d, generator=g)).to(dtype)
    bt = (0.3 * torch.randn(cap, vocab, generator=g)).to(dtype)
    base = torch.randn(len(rows), vocab, generator=g)  # float32 logits
    plan = plan_rows(plan_lora_batch(T, segs, dtype, "cpu"), rows)
    got, want = base.clone(), base.clone()
    TritonLoRAOps().apply(x, a, bt, got, plan)
    TorchReferenceOps().apply(x, a, bt, want, plan)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.03)
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(got[[0, 4]], base[[0, 4]])  # base rows (tokens 0 and 44)
