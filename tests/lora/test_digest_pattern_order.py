"""Attack: change what an adapter computes without changing its identity (issue 14).

The maths takes the *first* ``rank_pattern`` / ``alpha_pattern`` entry (in file order) that
matches a module (PEFT's ``get_pattern_key``). Digest v1 sorted the pattern keys, so reordering
the patterns changed the scales but not the digest: the registry returned the old revision for
the new content and every cache served the old copy (old scales) under the shared digest.
Digest v2 hashes the patterns in file order; the torch-free and torch digests stay equal, the
registry's signed payload covers the digest, and a revision registered under v1 fails
verification loudly (never a silent pass).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from loraplex.checkpoint.modules import BaseModelSpec
from loraplex.entrypoints.llm import LLM
from loraplex.lora.adapter import compute_adapter_digest, load_peft_adapter, read_adapter_files
from loraplex.lora.digest import digest_safetensors_dir
from loraplex.lora.peft.targets import LoraSettings
from loraplex.model.config import load_model_config
from loraplex.registry import Registry, RegistryPolicy, ValidationError, base_model_info, signing
from loraplex.requests import LoRARequest
from loraplex.types import AdapterIntegrityError, AdapterRef, AdapterSpec

Q = "model.layers.0.self_attn.q_proj"
# both keys match Q: the first one in file order decides its alpha
FIRST_Q = {"q_proj": 2.0, "self_attn.q_proj": 32.0}
FIRST_ATTN_Q = {"self_attn.q_proj": 32.0, "q_proj": 2.0}


def _with_patterns(src: Path, dst: Path, alpha_pattern: dict[str, float]) -> Path:
    shutil.copytree(src, dst)
    cfg_path = dst / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["alpha_pattern"] = alpha_pattern
    cfg_path.write_text(json.dumps(cfg))
    return dst


@pytest.fixture
def reordered(adapters: dict[str, Path], tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "root"
    return (
        _with_patterns(adapters["all_r8"], root / "first_q", FIRST_Q),
        _with_patterns(adapters["all_r8"], root / "first_attn_q", FIRST_ATTN_Q),
    )


def _spec(model: Path) -> BaseModelSpec:
    mc = load_model_config(model)
    return BaseModelSpec(mc.num_layers, mc.module_shapes, mc.model_type)


def test_pattern_order_changes_the_scales_and_the_digest(
    tiny_model: Path, reordered: tuple[Path, Path]
) -> None:
    a, b = reordered
    scales = []
    for d in reordered:
        config, tensors = read_adapter_files(d)
        scales.append(LoraSettings.of(config).rank_and_scale(Q)[1])
        # the torch-free digest (registry) and the torch one (engine) stay one value
        assert digest_safetensors_dir(d) == compute_adapter_digest(config, tensors)
        loaded = load_peft_adapter(d, _spec(tiny_model))
        assert loaded.weights[(0, "q_proj")].scale == scales[-1]
    assert scales == [2.0 / 8, 32.0 / 8]  # the first matching pattern wins
    assert digest_safetensors_dir(a) != digest_safetensors_dir(b)


def test_rank_pattern_order_is_part_of_the_digest(adapters: dict[str, Path]) -> None:
    config, tensors = read_adapter_files(adapters["all_r8"])
    one = {**config, "rank_pattern": {"q_proj": 4, "self_attn.q_proj": 8}}
    two = {**config, "rank_pattern": {"self_attn.q_proj": 8, "q_proj": 4}}
    assert LoraSettings.of(one).rank_of(Q) != LoraSettings.of(two).rank_of(Q)
    assert compute_adapter_digest(one, tensors) != compute_adapter_digest(two, tensors)
    # equal maths spelled alike still share the digest
    assert compute_adapter_digest(one, tensors) == compute_adapter_digest(dict(one), tensors)


def test_reordered_patterns_are_never_served_with_the_other_order_s_scales(
    tiny_model: Path, reordered: tuple[Path, Path]
) -> None:
    """The attack end to end: the engine loads one order, then is asked for the other; with a
    shared digest its cache answered with the first copy (the first order's scales)."""
    llm = LLM(str(tiny_model), max_loras=1, max_cpu_loras=2, max_lora_rank=8, dtype="float32")
    catalog, cache = llm.engine.adapter_catalog, llm.engine.adapters
    assert catalog is not None and cache is not None
    got = []
    for name, d in zip(("first_q", "first_attn_q"), reordered, strict=True):
        adapter, _ = cache.acquire(catalog.spec(LoRARequest(name, str(d))))
        got.append(adapter.weights[(0, "q_proj")].scale)
        cache.release(adapter)
    assert got == [2.0 / 8, 32.0 / 8]
    outs = llm.generate(
        [[1, 2, 3, 4]] * 2,
        lora_request=[LoRARequest(n, str(d)) for n, d in zip(("x", "y"), reordered, strict=True)],
    )
    assert outs[0].adapter is not None and outs[1].adapter is not None
    assert outs[0].adapter.sha256 != outs[1].adapter.sha256


def test_registry_registers_the_other_order_as_new_content_and_signatures_cover_it(
    tiny_model: Path, reordered: tuple[Path, Path], tmp_path: Path
) -> None:
    a, b = reordered
    base = base_model_info(tiny_model, "tiny")
    priv, pub = signing.generate_keypair()
    policy = RegistryPolicy(allowed_roots=(str(a.parent),), trusted_keys=(pub,))
    with Registry.open(f"sqlite:///{tmp_path / 'reg.db'}", policy=policy) as reg:
        draft_a, _ = reg.prepare(a, "sql", base=base)
        draft_b, _ = reg.prepare(b, "sql", base=base)
        assert draft_a.sha256 != draft_b.sha256
        assert draft_a.signed_payload() != draft_b.signed_payload()
        sig_a = signing.sign(draft_a.signed_payload(), priv)
        ra = reg.register(a, "sql", base=base, signature=sig_a, actor="t")
        # a's signature does not vouch for b (the payload holds the digest)
        with pytest.raises(ValidationError, match="bad_signature"):
            reg.register(b, "sql", base=base, signature=sig_a, actor="t")
        rb = reg.register(b, "sql", base=base, actor="t")
        assert (ra.revision, rb.revision) == ("r1", "r2") and ra.sha256 != rb.sha256


def test_a_revision_registered_under_the_old_digest_fails_verification_loudly(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    """Digest v1 values never verify under v2: the load is refused, and the error says that
    the revision must be registered again (no silent pass, no silent re-interpretation)."""
    from loraplex.lora.adapter import read_adapter

    v1 = read_adapter(adapters["patterns"]).legacy_digest()
    assert v1 != digest_safetensors_dir(adapters["patterns"])
    llm = LLM(str(tiny_model), max_loras=1, max_cpu_loras=2, dtype="float32")
    cache = llm.engine.adapters
    assert cache is not None
    spec = AdapterSpec(AdapterRef("old", "r1", v1), str(adapters["patterns"]))
    with pytest.raises(AdapterIntegrityError, match=r"previous digest version.*register"):
        cache.acquire(spec)
    assert cache.is_idle()


def test_validate_names_a_revision_registered_under_the_old_digest(
    tiny_model: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """A manifest stored with its v1 digest (as an earlier loraplex registered it) is not
    re-validated against the same files: ``validate`` refuses it and says why."""
    from loraplex.lora.adapter import read_adapter
    from loraplex.registry.rows import revision_row

    src = adapters["patterns"]
    base = base_model_info(tiny_model, "tiny")
    policy = RegistryPolicy(allowed_roots=(str(src.parent),))
    with Registry.open(f"sqlite:///{tmp_path / 'reg.db'}", policy=policy) as reg:
        m = reg.register(src, "old", base=base, actor="t")
        with reg._db.write() as s:  # what the registry of digest v1 stored for these files
            revision_row(s, "old", m.revision).sha256 = read_adapter(src).legacy_digest()
        with pytest.raises(ValidationError, match=r"unchanged.*earlier digest version"):
            reg.validate("old", m.revision, base=base, actor="t")
