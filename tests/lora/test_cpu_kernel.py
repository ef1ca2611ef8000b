"""The C LoRA kernel for CPU: against the float64 reference, its thread split, its rounding,
what it refuses, and how it is built and loaded (``loraplex.lora.cpu_ops`` over
``loraplex.native.build``).

Every numeric test runs on each build this CPU can run (``KERNEL_ISAS``): ``native``
(``-march=native``: on an AVX512-BF16 CPU the dot-product shrink, else the plain loops at this
CPU's vector width), ``avx2`` (AVX2 + FMA + F16C, no AVX-512: what an AVX2-only CPU runs, so an
AVX-512 or AMX machine tests that code too) and ``portable`` (the compiler's default target, the
fallback for a compiler without ``-march=native``)."""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import pytest
import torch

from loraplex.lora import cpu_ops
from loraplex.lora.backends import select_lora_ops
from loraplex.lora.cpu_ops import (
    CPUKernelLoRAOps,
    KernelSegments,
    PreparedModules,
    build_kernel,
    load_kernel,
)
from loraplex.lora.ops import NATIVE_RUN_TOKENS, TorchLoRAOps, TorchReferenceOps
from loraplex.lora.plan import plan_lora_batch
from loraplex.native import build
from loraplex.native.build import (
    AVX2_CPU_FLAGS,
    KERNEL_ISAS,
    KernelBuildError,
    cpu_flags,
    default_kernel_isa,
)
from loraplex.testing.kernels import runnable_build

LOWP = (torch.bfloat16, torch.float16)
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _runnable_kernel(isa: str) -> cpu_ops.LoRAKernel:
    """The verified kernel built for ``isa`` (skipped where this CPU cannot run that build)."""
    return runnable_build(load_kernel, isa)


@pytest.fixture(scope="module", params=list(KERNEL_ISAS))
def isa(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def ops(isa: str) -> CPUKernelLoRAOps:
    """The kernel ops over each build this CPU can run (the test runs once per build)."""
    return CPUKernelLoRAOps(_runnable_kernel(isa), TorchLoRAOps(upcast=LOWP, native_runs=LOWP))


def _compiler_accepts(flag: str) -> bool:
    cc = build.find_compiler()
    if cc is None:
        return False
    done = subprocess.run(
        [cc, flag, "-E", "-x", "c", os.devnull], capture_output=True, timeout=60, check=False
    )
    return done.returncode == 0


def test_each_build_targets_its_instruction_set(ops, isa):
    """What each build was compiled for: ``avx2`` AVX2, FMA and F16C and nothing of AVX-512,
    whichever CPU built it; ``native`` on a CPU with AVX512-BF16 (and a compiler that knows it)
    the dot-product shrink; ``portable`` no AVX-512."""
    features = ops.kernel.features
    if isa == "avx2":
        assert features == {"avx2", "fma", "f16c"}
    elif isa == "portable":
        assert "avx512f" not in features
    else:
        flags = cpu_flags() or frozenset()
        if {"avx512bw", "avx512_bf16"} <= flags and _compiler_accepts("-mavx512bf16"):
            assert {"avx512f", "avx512bf16-dot"} <= features


def test_the_default_build_follows_torchs_cpu_capability():
    """The engine builds for AVX2 where torch's own kernels run at AVX2 (an AVX2-only CPU, or
    ``ATEN_CPU_CAPABILITY=avx2``), else natively; an unknown instruction set is refused."""
    avx2 = torch.backends.cpu.get_cpu_capability() == "AVX2" and (cpu_flags() or set()) >= set(
        AVX2_CPU_FLAGS
    )
    assert default_kernel_isa() == ("avx2" if avx2 else "native")
    with pytest.raises(ValueError, match="unknown kernel instruction set"):
        build_kernel(isa="avx9000")


def _modules(g: torch.Generator, rows: int, d_in: int, widths, cols, dtype: torch.dtype):
    """Random tables of one module per width, adding into the fused output at ``cols``."""
    return tuple(
        (
            (torch.randn(rows, d_in, generator=g) / d_in**0.5).to(dtype),
            (torch.randn(rows, w, generator=g) / 4).to(dtype),
            c,
            c + w,
        )
        for w, c in zip(widths, cols, strict=True)
    )


def _on_threads(ops, x, out, modules, plan, counts=(1, 2, 3)) -> list[torch.Tensor]:
    """``out`` after ``apply_many`` with torch (and so the kernel) on each thread count."""
    before = torch.get_num_threads()
    results = []
    try:
        for n in counts:
            torch.set_num_threads(n)
            got = out.clone()
            ops.apply_many(x, got, modules, plan)
            results.append(got)
    finally:
        torch.set_num_threads(before)
    return results


def _group_case(seed: int, x_dtype: torch.dtype, w_dtype: torch.dtype, long: bool = False):
    """Three modules (one left out of the fused output's middle) over random segments with
    base tokens, gap rows, ranks 1..24 and odd widths (the tails of every vector loop)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    segs, t, r = [], rng.randint(0, 2), 0
    for _ in range(rng.randint(1, 9)):
        n = rng.randint(NATIVE_RUN_TOKENS + 1, NATIVE_RUN_TOKENS + 9) if long else rng.randint(1, 5)
        rank = rng.randint(1, 24)
        r += rng.randint(0, 3)  # gap rows: a resident slot not in this step
        segs.append((t, t + n, r, r + rank))
        t, r = t + n + rng.randint(0, 2), r + rank  # base tokens between segments
    rows, d_in = r + rng.randint(0, 4), rng.choice([7, 33, 64, 129])
    widths = [rng.choice([5, 16, 31, 48]) for _ in range(3)]
    cols = [0, widths[0] + 3, widths[0] + 3 + widths[1]]  # 3 columns no module adds into
    modules = _modules(g, rows, d_in, widths, cols, w_dtype)
    x = torch.randn(t, d_in, generator=g).to(x_dtype)
    out = torch.randn(t, cols[-1] + widths[-1] + 2, generator=g).to(x_dtype)
    plan = plan_lora_batch(t, segs, torch.float32, "cpu")
    return x, out, modules, plan


DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.bfloat16),
]


@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES, ids=["f32", "bf16", "bf16-x", "bf16-w"])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("long", [False, True], ids=["short", "long"])
def test_apply_many_matches_reference(ops, x_dtype, w_dtype, seed, long):
    """Every module's columns get its delta, the columns between them nothing; segments past
    NATIVE_RUN_TOKENS go to the torch fallback inside the same call."""
    x, out, modules, plan = _group_case(seed, x_dtype, w_dtype, long)
    expected, got = out.clone(), out.clone()
    TorchReferenceOps().apply_many(x, expected, modules, plan)
    ops.apply_many(x, got, modules, plan)
    torch.testing.assert_close(got, expected, **TOL[x_dtype])
    gap = slice(modules[0][3], modules[1][2])
    assert torch.equal(got[:, gap], out[:, gap])  # no module's column: untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_thread_split_is_exact(ops, dtype):
    """Each token is computed whole by one thread in a fixed order: one thread or two, the
    same bits. (torch's CPU wheel runs on libgomp, which the kernel binds to: it may use
    torch's threads; with any other runtime it would keep to one.)"""
    assert ops.kernel.shared_threads
    x, out, modules, plan = _group_case(11, dtype, dtype)
    results = _on_threads(ops, x, out, modules, plan)
    assert all(torch.equal(r, results[0]) for r in results)


def test_bf16_output_rounds_to_nearest_even(ops):
    """A delta of exactly half a bf16 ulp: ties go to the even mantissa, as torch rounds."""
    x = torch.zeros(4, 8)
    x[:, 0] = 1.0  # y = a[:, 0] exactly
    a = torch.zeros(1, 8)
    a[0, 0] = 1.0
    half_ulp = 2.0**-8  # ulp of bf16 at 1.0 is 2^-7
    bt = torch.full((1, 2), half_ulp)
    base = torch.tensor([1.0, 1.0 + 2.0**-7, -1.0, 3.0]).repeat(2, 1).T.contiguous()  # [4, 2]
    out = base.bfloat16()
    plan = plan_lora_batch(4, [(0, 4, 0, 1)], torch.float32, "cpu")
    ops.apply_many(x, out, ((a, bt, 0, 2),), plan)
    want = (base + half_ulp).bfloat16()  # float32 sums are exact here; torch rounds to even
    assert torch.equal(out, want)
    assert out[0, 0].item() == 1.0 and out[1, 0].item() == 1.0 + 2.0**-6  # both ties


def test_what_the_kernel_does_not_read_goes_to_the_fallback(ops):
    """float16, a strided x, tables of mixed dtypes: the torch path, still the right numbers."""
    g = torch.Generator().manual_seed(3)
    plan = plan_lora_batch(3, [(0, 1, 0, 4), (1, 3, 4, 8)], torch.float32, "cpu")
    a, bt = torch.randn(8, 16, generator=g), torch.randn(8, 12, generator=g)
    cases = {
        "fp16": (torch.randn(3, 16, generator=g).half(), ((a, bt, 0, 12),), torch.float16),
        "strided-x": (torch.randn(16, 3, generator=g).T, ((a, bt, 0, 12),), torch.float32),
        "mixed-tables": (
            torch.randn(3, 16, generator=g),
            ((a, bt, 0, 12), (a.bfloat16(), bt.bfloat16(), 12, 24)),
            torch.float32,
        ),
    }
    for name, (x, modules, dtype) in cases.items():
        out = torch.randn(3, 24, generator=g).to(dtype)
        expected, got = out.clone(), out.clone()
        TorchReferenceOps().apply_many(x, expected, modules, plan)
        ops.apply_many(x, got, modules, plan)
        torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2, msg=name)


def test_shapes_that_disagree_raise_before_the_kernel_runs(ops):
    """The kernel trusts its bounds, so every one of them is checked first."""
    a, bt = torch.randn(8, 16), torch.randn(8, 12)
    plan = plan_lora_batch(3, [(0, 3, 0, 8)], torch.float32, "cpu")
    good_x, good_out = torch.randn(3, 16), torch.zeros(3, 12)
    with pytest.raises(ValueError):
        ops.apply_many(torch.randn(3, 15), good_out, ((a, bt, 0, 12),), plan)  # d_in
    with pytest.raises(ValueError):
        ops.apply_many(good_x, torch.zeros(3, 11), ((a, bt, 0, 12),), plan)  # too narrow
    with pytest.raises(ValueError):
        ops.apply_many(torch.randn(2, 16), good_out, ((a, bt, 0, 12),), plan)  # tokens
    too_many_rows = plan_lora_batch(3, [(0, 3, 0, 9)], torch.float32, "cpu")
    with pytest.raises(ValueError):
        ops.apply_many(good_x, good_out, ((a, bt, 0, 12),), too_many_rows)
    with pytest.raises(ValueError):
        PreparedModules(((a, bt, 0, 11),))  # columns of the wrong width
    with pytest.raises(ValueError):
        PreparedModules(((a, torch.randn(7, 12), 0, 12),))  # A and B.T rows disagree
    assert torch.equal(good_out, torch.zeros(3, 12))


def test_engine_defaults_to_the_kernel_and_matches_the_torch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """An engine on the kernel (the CPU default) and one on the torch path give the same greedy
    tokens for a mixed batch: decode steps of one token per adapter, a prefill segment longer
    than NATIVE_RUN_TOKENS, base requests; ``LORAPLEX_LORA_CPU_KERNEL=0`` turns it off."""
    from loraplex.engine.llm_engine import EngineConfig, LLMEngine
    from loraplex.requests import LoRARequest, SamplingParams
    from loraplex.testing import make_random_adapter, make_random_model

    model = make_random_model(tmp_path / "m", dtype=torch.float32, seed=1)
    adapters = [
        make_random_adapter(model, tmp_path / f"a{i}", r=4 + 4 * i, seed=20 + i, std=0.2)
        for i in range(3)
    ]
    prompts = [[5 + i, 9, 13, 2 + i] * (20 if i == 0 else 2) for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for name in ("cpu-kernel", "torch"):
        monkeypatch.setenv("LORAPLEX_LORA_CPU_KERNEL", "1" if name == "cpu-kernel" else "0")
        cfg = EngineConfig(model=str(model), dtype="float32", max_loras=3, max_lora_rank=16)
        engine = LLMEngine(cfg)
        assert engine.model.lora is not None
        assert engine.model.lora.ops.name.startswith(name)
        for i, p in enumerate(prompts):
            lr = None if i == 3 else LoRARequest(f"a{i}", str(adapters[i]))
            engine.add_request(f"r{i}", p, sp, lr)
        done = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
        outs[name] = done
    assert outs["cpu-kernel"] == outs["torch"]


# ------------------------------------------------------------------------------- build and load


def test_build_is_cached_privately(tmp_path: Path):
    first = build_kernel(tmp_path)
    assert first.parent == tmp_path / "kernels" and first.is_file()
    assert (tmp_path / "kernels").stat().st_mode & 0o077 == 0  # only this user
    mtime = first.stat().st_mtime_ns
    assert build_kernel(tmp_path) == first and first.stat().st_mtime_ns == mtime  # reused


def test_a_library_in_a_directory_others_can_write_is_never_loaded(tmp_path: Path):
    """Someone who can write the cache directory could plant code there: the build goes to a
    fresh private directory instead, and what was planted is not read."""
    shared = tmp_path / "kernels"
    shared.mkdir()
    planted = build_kernel(tmp_path)  # a real library with the right name...
    os.chmod(shared, 0o777)  # ...in a directory anyone may write
    got = build_kernel(tmp_path)
    assert got != planted and not got.is_relative_to(shared)
    assert got.stat().st_mode & 0o022 == 0
    cpu_ops.LoRAKernel(got)  # loads


def test_no_compiler_means_the_torch_path_with_a_warning(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(KernelBuildError, match="no C compiler"):
        build_kernel()
    monkeypatch.setattr(cpu_ops, "load_kernel", lambda: build_kernel())
    with pytest.warns(UserWarning, match="using the torch path"):
        fallback = select_lora_ops("cpu")
    assert isinstance(fallback, TorchLoRAOps)


def test_a_compiler_that_fails_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: internal error' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    with pytest.raises(KernelBuildError, match="internal error"):
        build_kernel(tmp_path / "cache")


def test_a_wrong_kernel_fails_its_self_check(monkeypatch: pytest.MonkeyPatch):
    kernel = load_kernel()

    def wrong(x, out, group, segments: KernelSegments) -> None:
        out.add_(1.0)

    monkeypatch.setattr(type(kernel), "__call__", lambda self, *a: wrong(*a))
    with pytest.raises(KernelBuildError, match="disagrees"):
        cpu_ops._self_check(kernel)


def test_old_builds_are_pruned(tmp_path: Path):
    kernels = tmp_path / "kernels"
    kernels.mkdir(mode=0o700)
    for i in range(build.KEEP_BUILDS + 3):
        old = kernels / f"lora_cpu-old{i:02d}.so"
        old.write_bytes(b"")
        os.utime(old, (1_000_000 + i, 1_000_000 + i))
    os.chmod(kernels, 0o700)
    got = build_kernel(tmp_path)
    left = sorted(p.name for p in kernels.glob("lora_cpu-*.so"))
    assert got.name in left and len(left) == build.KEEP_BUILDS
    assert "lora_cpu-old00.so" not in left  # the oldest went first


def _composed_case(seed: int, dtype: torch.dtype):
    """Three modules over a composed step (``tests.lora.test_composed_ops``' random
    compositions: up to 4 layers, weights negative, 0 and 1, single and base tokens), large
    enough that the kernel splits it over threads."""
    from tests.lora.test_composed_ops import _random_composition

    t, segs, weights, extra, rows = _random_composition(seed)
    g = torch.Generator().manual_seed(seed)
    d_in, widths, cols = 385, (48, 31, 16), (0, 51, 82)  # >= PARALLEL_MIN_MACS: threads split
    modules = _modules(g, rows, d_in, widths, cols, dtype)
    x = torch.randn(t, d_in, generator=g).to(dtype)
    out = torch.randn(t, cols[-1] + widths[-1], generator=g).to(dtype)
    plan = plan_lora_batch(t, segs, torch.float32, "cpu", weights=weights, extra=extra)
    return x, out, modules, plan


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("seed", range(8))
def test_composed_layers_in_one_call_match_reference_on_any_threads(ops, dtype, seed):
    """Every layer of a composed plan goes to the kernel in one call (tokens in several
    segments): each token adds each component with its weight, equal to the float64
    reference, and the same bits on one, two or three threads (a token's segments are one
    thread's, summed in a fixed order)."""
    x, out, modules, plan = _composed_case(seed, dtype)
    assert len(plan.layers) > 1
    short, long_plan = ops._split(plan)
    assert short is not None and short.count == len(plan.segments) and long_plan is None
    expected = out.clone()
    TorchReferenceOps().apply_many(x, expected, modules, plan)
    results = _on_threads(ops, x, out, modules, plan)
    torch.testing.assert_close(results[0], expected, **TOL[dtype])
    assert all(torch.equal(r, results[0]) for r in results)


def test_more_layers_than_the_kernel_takes_run_on_the_fallback(ops):
    """A token in more segments than ``MAX_TOKEN_SEGMENTS`` (layers of a plan): the plan runs
    on the torch path, still exact."""
    n = cpu_ops.MAX_TOKEN_SEGMENTS + 1
    extra = [(0, 2, 4 * k, 4 * k + 4, 0.5 + k) for k in range(1, n)]
    plan = plan_lora_batch(2, [(0, 2, 0, 4)], torch.float32, "cpu", extra=extra)
    assert len(plan.layers) == n
    assert ops._split(plan) == (None, plan)
    g = torch.Generator().manual_seed(3)
    x, a, bt = (torch.randn(2, 8, generator=g), torch.randn(4 * n, 8, generator=g),
                torch.randn(4 * n, 5, generator=g))  # fmt: skip
    got, want = torch.zeros(2, 5), torch.zeros(2, 5)
    ops.apply(x, a, bt, got, plan)
    TorchReferenceOps().apply(x, a, bt, want, plan)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
