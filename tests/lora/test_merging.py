"""Merging adapters into a new one (:mod:`loraplex.lora.merging`) equals PEFT's
``add_weighted_adapter`` on the same inputs, for every combination type: adapters of
different ranks and modules (rsLoRA, a rank pattern, the token embedding), non-zero B.

DARE draws random masks: loraplex seeds each module's generator with ``module_seed(seed,
module)``. PEFT draws from torch's global generator in the same order within a module, so the
reference re-seeds the global generator with that seed as PEFT starts each module (wrapping
PEFT's per-module method, not changing its arithmetic): the masks, hence the results, are then
the same, element for element."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplex.lora.adapter import read_adapter_files
from loraplex.lora.merging import merge_lora
from loraplex.lora.peft.errors import FormatError
from loraplex.lora.peft.merging import COMBINATION_TYPES, MergeSpec, module_seed
from loraplex.testing import ATTN_PROJ, MLP_PROJ, make_random_adapter

TOL = 1e-5  # float32 throughout: products of a few O(0.1) factors and sums of three of them

# (r, alpha, targets, extra): ranks 4, 8 and 16, one rsLoRA, one with a rank pattern, one on
# the token embedding
MIXED = {
    "m_attn_r4_rs": dict(r=4, lora_alpha=8, target_modules=ATTN_PROJ, use_rslora=True, seed=11),
    "m_all_r8_pat": dict(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"],
        rank_pattern={"up_proj": 6}, alpha_pattern={"v_proj": 4.0}, seed=12,
    ),
    "m_mlp_emb_r16": dict(r=16, lora_alpha=8, target_modules=[*MLP_PROJ, "embed_tokens"], seed=13),
}  # fmt: skip
# one rank for the factor-wise types (PEFT needs it), different modules and alphas
SAME = {
    "s_qv_r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], seed=21),
    "s_qo_r8": dict(r=8, lora_alpha=4, target_modules=["q_proj", "o_proj", "down_proj"], seed=22),
    "s_all_r8": dict(r=8, lora_alpha=8, target_modules=[*ATTN_PROJ, *MLP_PROJ], seed=23),
}
WEIGHTS = (1.0, -0.5, 0.7)

SVD_TYPES = tuple(t for t in COMBINATION_TYPES if t.endswith("svd"))
FACTOR_TYPES = ("linear", "ties", "dare_linear", "dare_ties", "magnitude_prune")


@pytest.fixture(scope="module")
def merge_adapters(tiny_model: Path, workdir: Path) -> dict[str, Path]:
    return {
        name: make_random_adapter(tiny_model, workdir / "merge_inputs" / name, **kw)
        for name, kw in {**MIXED, **SAME}.items()
    }


def _params(combination_type: str) -> dict[str, Any]:
    """The strategy parameters of one type (density and the sign method where used)."""
    out: dict[str, Any] = {}
    if combination_type.split("_")[0] in ("ties", "dare", "magnitude"):
        out["density"] = 0.6
    if combination_type in ("ties", "ties_svd", "dare_ties", "dare_ties_svd"):
        out["majority_sign_method"] = "frequency" if "svd" in combination_type else "total"
    if combination_type.startswith("dare"):
        out["seed"] = 1234
    return out


@pytest.fixture(scope="module")
def peft_model(tiny_model: Path, merge_adapters: dict[str, Path]) -> Iterator[Any]:
    """transformers + PEFT with every input adapter loaded under its name."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    names = list(merge_adapters)
    model = PeftModel.from_pretrained(base, str(merge_adapters[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(merge_adapters[name]), adapter_name=name)
    yield model


def _peft_merge(model: Any, names: list[str], spec: MergeSpec, out: str) -> dict[str, Any]:
    """PEFT's ``add_weighted_adapter`` into adapter ``out``: ``module -> (A, B)``, with torch's
    global generator seeded by ``module_seed`` as PEFT starts each module (DARE)."""
    lora = model.base_model
    module_names = {id(m): n for n, m in lora.model.named_modules()}

    def seeded(method: Any, target_at: int) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            torch.manual_seed(module_seed(spec.seed or 0, module_names[id(args[target_at])]))
            return method(*args, **kwargs)

        return run

    kwargs: dict[str, Any] = {}
    for k in ("density", "svd_rank", "svd_clamp", "svd_full_matrices"):
        if getattr(spec, k) is not None:
            kwargs[k] = getattr(spec, k)
    if spec.majority_sign_method is not None:
        kwargs["majority_sign_method"] = spec.majority_sign_method
    lora._generalized_task_arithmetic_weighted_adapter = seeded(
        lora._generalized_task_arithmetic_weighted_adapter, 3
    )
    lora._svd_generalized_task_arithmetic_weighted_adapter = seeded(
        lora._svd_generalized_task_arithmetic_weighted_adapter, 4
    )
    try:
        model.add_weighted_adapter(
            names, list(spec.weights), out, combination_type=spec.combination_type, **kwargs
        )
    finally:
        del lora._generalized_task_arithmetic_weighted_adapter
        del lora._svd_generalized_task_arithmetic_weighted_adapter
    got = {}
    for name, m in lora.model.named_modules():
        if hasattr(m, "lora_A") and out in m.lora_A:
            got[name] = (m.lora_A[out].weight.detach(), m.lora_B[out].weight.detach())
        elif hasattr(m, "lora_embedding_A") and out in m.lora_embedding_A:
            got[name] = (m.lora_embedding_A[out].detach(), m.lora_embedding_B[out].detach())
    model.delete_adapter(out)
    return got


def _ours(paths: list[Path], spec: MergeSpec) -> tuple[dict, dict[str, Any]]:
    config, tensors = merge_lora([read_adapter_files(p) for p in paths], spec, max_rank=64)
    by_module: dict[str, list[Any]] = {}
    for name, t in tensors.items():
        module = name.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
        ab = 0 if ".lora_A" in name or ".lora_embedding_A" in name else 1
        by_module.setdefault(module, [None, None])[ab] = t
    return config, by_module


def _check_equal(ours: dict[str, Any], ref: dict[str, Any], rank: int) -> None:
    assert set(ours) == set(ref)
    for module, (a_ref, b_ref) in ref.items():
        a, b = ours[module]
        assert a.shape == (rank, a_ref.shape[1]) and b.shape == (b_ref.shape[0], rank)
        k = a_ref.shape[0]  # PEFT's own rank of this module (ours is zero-padded above it)
        torch.testing.assert_close(a[:k], a_ref, atol=TOL, rtol=0, msg=f"{module} A")
        torch.testing.assert_close(b[:, :k], b_ref, atol=TOL, rtol=0, msg=f"{module} B")
        assert not a[k:].any() and not b[:, k:].any()
        assert b_ref.abs().sum() > 0  # a real comparison, not of zeros


@pytest.mark.parametrize("combination_type", ["cat", *SVD_TYPES])
def test_mixed_ranks_equal_peft(
    combination_type: str, merge_adapters: dict[str, Path], peft_model: Any
) -> None:
    names = list(MIXED)
    extra: dict[str, Any] = {}
    if combination_type == "svd":
        extra = {"svd_rank": 12, "svd_clamp": 0.99}
    if combination_type == "ties_svd":
        extra = {"svd_full_matrices": False}
    spec = MergeSpec(combination_type, WEIGHTS, **_params(combination_type), **extra)
    config, ours = _ours([merge_adapters[n] for n in names], spec)
    ref = _peft_merge(peft_model, names, spec, f"merged_{combination_type}")
    rank = {"cat": 4 + 8 + 16, "svd": 12}.get(combination_type, 16)
    assert config["r"] == config["lora_alpha"] == rank and not config["use_rslora"]
    _check_equal(ours, ref, rank)


@pytest.mark.parametrize("combination_type", FACTOR_TYPES)
def test_factorwise_equal_peft(
    combination_type: str, merge_adapters: dict[str, Path], peft_model: Any
) -> None:
    names = list(SAME)
    spec = MergeSpec(combination_type, WEIGHTS, **_params(combination_type))
    config, ours = _ours([merge_adapters[n] for n in names], spec)
    ref = _peft_merge(peft_model, names, spec, f"merged_{combination_type}")
    assert config["r"] == 8
    _check_equal(ours, ref, 8)


def test_cat_is_the_exact_weighted_sum(merge_adapters: dict[str, Path]) -> None:
    """``cat``'s product is sum_i w_i s_i B_i A_i on every module (the per-request sum)."""
    from loraplex.lora.peft.targets import LoraSettings

    names = list(MIXED)
    spec = MergeSpec("cat", WEIGHTS)
    _, ours = _ours([merge_adapters[n] for n in names], spec)
    inputs = [read_adapter_files(merge_adapters[n]) for n in names]
    for module, (a, b) in ours.items():
        want = torch.zeros(b.shape[0], a.shape[1])
        for w, (config, tensors) in zip(WEIGHTS, inputs, strict=True):
            pair = {
                "A" if ".lora_A" in n or ".lora_embedding_A" in n else "B": t
                for n, t in tensors.items()
                if f".{module}.lora_" in f".{n}"
            }
            if not pair:
                continue
            a_i, b_i = pair["A"], pair["B"]  # [r, d_in], [d_out, r]
            _, s = LoraSettings.of(config).rank_and_scale(module)
            delta = b_i @ a_i
            want += w * s * delta
        torch.testing.assert_close(b @ a, want, atol=TOL, rtol=0)


def test_dare_is_seeded_and_keeps_density(merge_adapters: dict[str, Path]) -> None:
    """Same seed, same result; another seed, other masks; about ``density`` of each factor kept,
    rescaled by ``1 / density``."""
    paths = [merge_adapters[n] for n in SAME]
    spec = MergeSpec("dare_linear", (1.0,) * 3, density=0.3, seed=7)
    _, one = _ours(paths, spec)
    _, again = _ours(paths, spec)
    _, other = _ours(paths, MergeSpec("dare_linear", (1.0,) * 3, density=0.3, seed=8))
    for module in one:
        assert torch.equal(one[module][0], again[module][0])
    assert any(not torch.equal(one[m][0], other[m][0]) for m in one)
    single = MergeSpec("dare_linear", (1.0, 0.0, 0.0), density=0.3, seed=7)
    _, pruned = _ours(paths, single)
    (config, tensors) = read_adapter_files(paths[0])
    scale = config["lora_alpha"] / config["r"]
    kept, total = 0, 0
    for name, a_in in tensors.items():
        if ".lora_A" not in name:
            continue
        module = name.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
        a = pruned[module][0]
        nz = a != 0
        kept, total = kept + int(nz.sum()), total + a.numel()
        # a kept element is the input's, times sqrt(scale) / density
        torch.testing.assert_close(a[nz], a_in[nz] * scale**0.5 / 0.3, atol=TOL, rtol=1e-5)
    assert abs(kept / total - 0.3) < 0.05, kept / total


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(combination_type="nope", weights=(1.0,)), "combination_type must be one of"),
        (dict(combination_type="ties", weights=(1.0, 1.0)), "needs density"),
        (dict(combination_type="ties", weights=(1.0, 1.0), density=1.5), "needs density"),
        (dict(combination_type="linear", weights=(1.0, 1.0), density=0.5), "density is not used"),
        (dict(combination_type="cat", weights=(1.0, float("nan"))), "finite number"),
        (dict(combination_type="cat", weights=()), "give 1 to 8"),
        (dict(combination_type="svd", weights=(1.0,), svd_rank=0), "svd_rank must be"),
        (dict(combination_type="svd", weights=(1.0,), svd_clamp=2.0), "svd_clamp must be"),
        (dict(combination_type="dare_ties", weights=(1.0,), density=0.5, seed=-1), "seed must"),
        (
            dict(combination_type="ties", weights=(1.0,), density=0.5, majority_sign_method="x"),
            "majority_sign_method must be",
        ),
    ],
)
def test_bad_specs_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(FormatError, match=match):
        MergeSpec(**kwargs)


def test_bad_merges_are_refused(merge_adapters: dict[str, Path]) -> None:
    mixed = [read_adapter_files(merge_adapters[n]) for n in MIXED]
    with pytest.raises(FormatError, match="needs adapters of one rank"):
        merge_lora(mixed, MergeSpec("ties", WEIGHTS, density=0.5), max_rank=64)
    with pytest.raises(FormatError, match="exceeds the largest allowed, 16"):
        merge_lora(mixed, MergeSpec("cat", WEIGHTS), max_rank=16)
    with pytest.raises(FormatError, match="3 adapters but 2 weights"):
        merge_lora(mixed, MergeSpec("cat", (1.0, 1.0)), max_rank=64)
