"""Merges as registry operations (:func:`loraplex.registry.merges.merge_adapters`) and the
``loraplex registry merge`` command: the result is a new revision registered like any other
(versioned, its digest verified, signed where required, audited), its inputs resolved for the
caller's tenant and one base model, bounded before any tensor is read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from loraplex.cli import main
from loraplex.lora.adapter import read_adapter, read_adapter_files
from loraplex.lora.merging import merge_adapter_dirs, merge_lora
from loraplex.lora.peft.merging import MAX_MERGED_ADAPTERS, MergeSpec
from loraplex.registry import (
    NotFoundError,
    Registry,
    RegistryError,
    RegistryPolicy,
    ValidationError,
    base_model_info,
)
from loraplex.registry.inspect import BaseModelInfo
from loraplex.registry.merges import merge_adapters
from loraplex.registry.signing import generate_keypair, sign

INPUTS = ("all_r8", "attn_r4_rslora", "mlp_r16")


@pytest.fixture
def root(tmp_path: Path, adapters: dict[str, Path]) -> Path:
    r = tmp_path / "root"
    for name in (*INPUTS, "patterns"):
        shutil.copytree(adapters[name], r / name)
    return r


@pytest.fixture(scope="module")
def base(tiny_model: Path) -> BaseModelInfo:
    return base_model_info(tiny_model, "tiny")


@pytest.fixture(scope="module")
def twin_base(workdir: Path) -> BaseModelInfo:
    """Same shapes as the tiny model, other weights: only the base digest tells them apart."""
    from loraplex.testing import make_random_model

    twin = make_random_model(workdir / "twin-merge", num_layers=3, seed=98, with_tokenizer=False)
    return base_model_info(twin, "twin")


def _register_inputs(reg: Registry, root: Path, base: BaseModelInfo, tenant: str | None = None
                     ) -> None:  # fmt: skip
    for name in INPUTS:
        m = reg.register(root / name, name, base=base, tenant=tenant, actor="test")
        reg.activate(name, m.revision, actor="test")


def _merge(reg: Registry, base: BaseModelInfo, tmp_path: Path, refs: list[str], spec: MergeSpec,
           **kw: object) -> object:  # fmt: skip
    kw.setdefault("name", "merged")
    kw.setdefault("tenant", None)
    return merge_adapters(reg, refs, spec, base=base, actor="alice", merger=merge_adapter_dirs,
                          out_root=tmp_path / "merged", **kw)  # type: ignore[arg-type]  # fmt: skip


def test_merge_registers_a_verified_versioned_revision(
    reg: Registry, root: Path, base: BaseModelInfo, tmp_path: Path
) -> None:
    _register_inputs(reg, root, base)
    spec = MergeSpec("cat", (1.0, -0.5, 0.25))
    m = _merge(reg, base, tmp_path, ["all_r8", "attn_r4_rslora@r1", "mlp_r16"], spec)
    assert (m.name, m.revision, m.status, m.rank) == ("merged", "r1", "validated", 28)
    # the registered directory holds exactly the merge of the inputs' files, and its digest is
    # the manifest's: the registry's own re-validation agrees
    read = read_adapter(m.path)
    assert read.digest == m.sha256 and Path(m.path).name == m.sha256
    _, want = merge_lora([read_adapter_files(root / n) for n in INPUTS], spec, max_rank=64)
    assert set(read.tensors) == set(want)
    for k, t in want.items():
        assert torch.equal(read.tensors[k], t), k
    assert reg.validate("merged", "r1", base=base, actor="test").sha256 == m.sha256
    # versioned: another merge is r2; the same merge again is the same revision
    m2 = _merge(reg, base, tmp_path, ["all_r8", "mlp_r16"], MergeSpec("svd", (1.0, 1.0)))
    assert m2.revision == "r2" and m2.rank == 16
    again = _merge(reg, base, tmp_path, ["all_r8", "attn_r4_rslora@r1", "mlp_r16"], spec)
    assert (again.revision, again.sha256) == ("r1", m.sha256)
    # audited with its inputs and parameters
    entry = next(e for e in reg.audit_log(target="merged") if e.action == "merge")
    assert entry.actor == "alice" and entry.target == "merged@r1"
    assert [i["name"] for i in entry.after["inputs"]] == list(INPUTS)
    assert entry.after["combination_type"] == "cat" and entry.after["weights"] == [1.0, -0.5, 0.25]
    assert not list((tmp_path / "merged").glob(".merging-*"))  # no temporary left behind


def test_merge_is_signed_where_the_registry_requires_it(
    db_url: str, root: Path, base: BaseModelInfo, tmp_path: Path
) -> None:
    private, public = generate_keypair()
    reg = Registry.open(db_url, policy=RegistryPolicy(allowed_roots=(str(root),),
                                                      require_signatures=True, trusted_keys=(public,)))  # fmt: skip
    try:
        for name in ("all_r8", "mlp_r16"):
            draft, _ = reg.prepare(root / name, name, base=base)
            s = sign(draft.signed_payload(), private)
            reg.activate(name, reg.register(root / name, name, base=base, signature=s,
                                            actor="test").revision, actor="test")  # fmt: skip
        spec = MergeSpec("dare_linear_svd", (0.6, 0.4), density=0.5, seed=3)
        refs = ["all_r8", "mlp_r16"]
        with pytest.raises(ValidationError, match="requires signed manifests") as e:
            _merge(reg, base, tmp_path, refs, MergeSpec("svd", (0.6, 0.4)))
        assert e.value.reason == "unsigned"
        # signed here (the command line's key) ...
        m = _merge(reg, base, tmp_path, refs, spec, sign=lambda p: sign(p, private))
        assert m.signed_by and m.signature
        # ... or elsewhere: a dry run names the payload, the same merge then carries it
        draft = _merge(reg, base, tmp_path, refs, spec, name="merged2", dry_run=True)
        assert draft.revision == "" and reg.list(status=None)[-1].name != "merged2"
        m2 = _merge(reg, base, tmp_path, refs, spec, name="merged2",
                    signature=sign(draft.signed_payload(), private))  # fmt: skip
        assert m2.sha256 == m.sha256 == draft.sha256 and m2.signed_by == m.signed_by
        with pytest.raises(ValidationError, match="does not verify"):
            _merge(reg, base, tmp_path, refs, spec, name="merged3",
                   signature=sign(b"something else", private))  # fmt: skip
    finally:
        reg.close()


def test_merge_refusals(
    reg: Registry, root: Path, base: BaseModelInfo, twin_base: BaseModelInfo, tmp_path: Path
) -> None:
    reg.create_tenant("acme", actor="test")
    reg.create_tenant("bravo", actor="test")
    _register_inputs(reg, root, base)  # shared
    m = reg.register(root / "patterns", "bravo_own", base=base, tenant="bravo", actor="test")
    reg.activate("bravo_own", m.revision, actor="test")
    m = reg.register(root / "patterns", "for_twin", base=twin_base, actor="test")
    reg.activate("for_twin", m.revision, actor="test")
    cat = MergeSpec("cat", (1.0, 1.0))

    def refused(err: type[Exception], match: str, refs: list[str], spec: MergeSpec = cat,
                **kw: object) -> None:  # fmt: skip
        with pytest.raises(err, match=match):
            _merge(reg, base, tmp_path, refs, spec, **kw)

    refused(NotFoundError, "unknown adapter 'nope'", ["all_r8", "nope"])
    refused(NotFoundError, "revision", ["all_r8", "mlp_r16@r9"])
    # another tenant's adapter is unknown to a tenant, as for inference; shared ones are not
    refused(NotFoundError, "unknown adapter 'bravo_own'", ["all_r8", "bravo_own"], tenant="acme")
    acme = _merge(reg, base, tmp_path, ["all_r8", "mlp_r16"], cat, name="acme_m", tenant="acme")
    assert acme.tenant == "acme"
    refused(RegistryError, "already taken", ["all_r8", "mlp_r16"], name="acme_m", tenant="bravo")
    refused(ValidationError, "registered for base model twin", ["all_r8", "for_twin"])
    refused(ValidationError, "needs adapters of one rank", ["all_r8", "mlp_r16"],
            MergeSpec("ties", (1.0, 1.0), density=0.5))  # fmt: skip
    small = Registry.open(reg.url, policy=RegistryPolicy(max_rank=16))
    try:
        with pytest.raises(ValidationError, match="rank 28, above this registry's largest, 16"):
            _merge(small, base, tmp_path, list(INPUTS), MergeSpec("cat", (1.0, 1.0, 1.0)))
    finally:
        small.close()
    refused(ValidationError, "3 adapters but 2 weights", list(INPUTS))
    refused(ValidationError, "named twice", ["all_r8", "all_r8@r1"])
    refused(ValidationError, "name 1 to 8", ["all_r8"] * (MAX_MERGED_ADAPTERS + 1),
            MergeSpec("cat", (1.0,) * MAX_MERGED_ADAPTERS))  # fmt: skip
    refused(RegistryError, "invalid adapter name", ["all_r8", "../x"])
    reg.disable("mlp_r16", "r1", actor="test")
    refused(ValidationError, "is disabled", ["all_r8", "mlp_r16@r1"])
    # an input whose files changed since registration is refused (its digest is checked)
    reg.activate("attn_r4_rslora", "r1", actor="test")
    shutil.copy(root / "patterns" / "adapter_model.safetensors",
                root / "attn_r4_rslora" / "adapter_model.safetensors")  # fmt: skip
    refused(ValidationError, "no longer match the registered digest", ["all_r8", "attn_r4_rslora"])
    assert not [m for m in reg.list() if m.name == "merged"]  # nothing registered by a refusal


# ------------------------------------------------------------------------------ the command


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_registry_merge_command(
    capsys: pytest.CaptureFixture[str],
    db_url: str,
    root: Path,
    tiny_model: Path,
    twin_base: BaseModelInfo,
    tmp_path: Path,
) -> None:
    private, public = generate_keypair()
    (tmp_path / "priv.pem").write_text(private)
    (tmp_path / "pub.pem").write_text(public)
    u = ["--registry-url", db_url, "--actor", "carol", "--json"]
    pol = ["--allowed-root", str(root), "--require-signatures", "--trusted-key",
           str(tmp_path / "pub.pem")]  # fmt: skip
    for name in ("all_r8", "attn_r4_rslora"):
        code, out, err = _cli(capsys, "adapters", "register", name, str(root / name),
                              "--base-model", str(tiny_model), "--activate",
                              "--sign-key", str(tmp_path / "priv.pem"), *u, *pol)  # fmt: skip
        assert code == 0, err
    merge = ["registry", "merge", "--base-model", str(tiny_model), *u, *pol,
             "--out", str(tmp_path / "out")]  # fmt: skip
    code, out, err = _cli(capsys, *merge, "mix", "all_r8", "attn_r4_rslora@r1",
                          "--combination-type", "dare_ties_svd", "--weights", "1", "-0.5",
                          "--density", "0.7", "--seed", "5", "--activate",
                          "--sign-key", str(tmp_path / "priv.pem"))  # fmt: skip
    assert code == 0, err
    m = json.loads(out)
    assert (m["name"], m["revision"], m["status"], m["rank"]) == ("mix", "r1", "active", 8)
    assert m["signed_by"] and read_adapter(m["path"]).digest == m["sha256"]
    assert Path(m["path"]).parent == tmp_path / "out"
    # ``loraplex adapters merge`` is the same command; unsigned is refused here
    code, out, err = _cli(capsys, "adapters", *merge[1:], "mix2", "all_r8", "attn_r4_rslora",
                          "--combination-type", "svd")  # fmt: skip
    assert code == 2 and "unsigned" in err and len(err.strip().splitlines()) == 1
    with Registry.open(db_url) as reg:
        reg.register(root / "mlp_r16", "twin_one", base=twin_base, actor="test",
                     allow_any_source=True)  # fmt: skip
        reg.activate("twin_one", "r1", actor="test")
    for extra, want in [
        (["all_r8", "twin_one", "--combination-type", "cat"], "base_model_mismatch"),
        (["all_r8", "nope", "--combination-type", "cat"], "unknown adapter 'nope'"),
        (["all_r8", "--combination-type", "ties"], "needs density"),
        (["all_r8", "attn_r4_rslora", "--combination-type", "cat", "--weights", "1"],
         "2 adapters but 1 weights"),
        (["all_r8", "--combination-type", "bogus"], "invalid choice"),
    ]:  # fmt: skip
        code, out, err = _cli(capsys, *merge, "mix3", *extra)
        assert code == 2 and want in err, (extra, err)
        assert err.startswith("loraplex registry: error: ") and len(err.strip().splitlines()) == 1
