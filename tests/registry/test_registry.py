"""The adapter registry against SQLite and a real PostgreSQL: digests, validation reasons,
lifecycle table, promote/canary/rollback, tenants, keys, audit, migrations, concurrency."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from sqlalchemy import create_engine, inspect, text

from loraplex.lora.adapter import compute_adapter_digest, read_adapter_files
from loraplex.lora.digest import digest_safetensors_dir
from loraplex.registry import (
    ADAPTER_STATUSES,
    TRANSITIONS,
    CanaryPolicy,
    Manifest,
    NotFoundError,
    Principal,
    Registry,
    RegistryError,
    RegistryPolicy,
    TransitionError,
    ValidationError,
    base_model_info,
    signed_payload,
    signing,
)
from loraplex.registry.db import Base, current_revision, head_revision
from loraplex.registry.lifecycle import check_transition
from loraplex.registry.records import MAX_CONCURRENT_REQUESTS
from loraplex.server.catalog import Catalog
from loraplex.testing import make_random_adapter, make_random_model


@pytest.fixture
def root(tmp_path: Path, adapters: dict[str, Path]) -> Path:
    """An allowed adapter root holding copies of the conftest adapters."""
    r = tmp_path / "root"
    for name, src in adapters.items():
        shutil.copytree(src, r / name)
    return r


@pytest.fixture(scope="session")
def base(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> object:
    old = os.environ.get("LORAPLEX_HOME")
    os.environ["LORAPLEX_HOME"] = str(tmp_path_factory.mktemp("home"))
    try:
        return base_model_info(tiny_model, "tiny")
    finally:
        if old is None:
            os.environ.pop("LORAPLEX_HOME", None)
        else:
            os.environ["LORAPLEX_HOME"] = old


@pytest.fixture(scope="session")
def narrow_model(workdir: Path) -> Path:
    """Another architecture size: every adapter of tiny_model is a shape mismatch here."""
    return make_random_model(workdir / "narrow-llama", num_layers=3, hidden_size=32, seed=3,
                             with_tokenizer=False)  # fmt: skip


@pytest.fixture(scope="session")
def twin_model(workdir: Path) -> Path:
    """Same shapes as tiny_model, other weights: only the base digest tells them apart."""
    return make_random_model(workdir / "twin-llama", num_layers=3, seed=99, with_tokenizer=False)


_opened: list[Registry] = []


@pytest.fixture(autouse=True)
def _close_registries() -> Iterator[None]:
    """Close every registry a test opened (PostgreSQL connections are a finite resource)."""
    yield
    while _opened:
        _opened.pop().close()


def open_reg(url: str, root: Path | None = None, **policy: object) -> Registry:
    """A registry over ``url`` allowing adapters under ``root``; closed after the test."""
    roots = (str(root),) if root is not None else ()
    reg = Registry.open(url, policy=RegistryPolicy(allowed_roots=roots, **policy))  # type: ignore[arg-type]
    _opened.append(reg)
    return reg


def serving(reg: Registry, base: object, name: str, *, tenant: str | None, u: float
            ) -> tuple[Manifest, str] | None:  # fmt: skip
    """The (manifest, via) a request for ``name`` by ``tenant`` (None: an operator, who sees
    every name) is served with for the uniform draw ``u``, as the server decides it: the
    catalog's snapshot of the registry's releases and ``Servable.choose``. None when the name
    is unknown, invisible to the tenant or has no active revision."""
    catalog = Catalog(reg, base, poll_s=0.0)  # type: ignore[arg-type]
    s = catalog.lookup(name, Principal("test-key", tenant, frozenset({"inference"})))
    return None if s is None else s.choose(u)


def variant(src: Path, dst: Path, seed: int) -> Path:
    """A copy of adapter ``src`` with different weights (same shapes and config)."""
    dst.mkdir(parents=True)
    shutil.copy(src / "adapter_config.json", dst / "adapter_config.json")
    _, tensors = read_adapter_files(src)
    g = torch.Generator().manual_seed(seed)
    save_file({k: torch.randn(v.shape, generator=g) * 0.05 for k, v in tensors.items()},
              str(dst / "adapter_model.safetensors"))  # fmt: skip
    return dst


def file_sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------ digest


def test_digest_equals_torch_digest(adapters: dict[str, Path], tmp_path: Path) -> None:
    for name, path in adapters.items():
        config, tensors = read_adapter_files(path)
        assert digest_safetensors_dir(path) == compute_adapter_digest(config, tensors), name
    # other dtypes and an extra metadata header entry digest the same way too
    config, tensors = read_adapter_files(adapters["attn_r4_rslora"])
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        d = tmp_path / str(dtype)
        d.mkdir()
        shutil.copy(adapters["attn_r4_rslora"] / "adapter_config.json", d)
        cast = {k: v.to(dtype) for k, v in tensors.items()}
        save_file(cast, str(d / "adapter_model.safetensors"), metadata={"format": "pt"})
        assert digest_safetensors_dir(d) == compute_adapter_digest(config, cast), dtype
    assert digest_safetensors_dir(d) != digest_safetensors_dir(adapters["attn_r4_rslora"])


def test_registry_never_imports_torch() -> None:
    code = (
        "import sys, loraplex.registry, loraplex.registry.cli, loraplex.lora.digest, "
        "loraplex.lora.peft.layout, loraplex.lora.peft.config, loraplex.lora.peft.files, "
        "loraplex.checkpoint.modules, loraplex.checkpoint.safetensors, loraplex.paths, "
        "loraplex.tools.plan; "
        "bad = [m for m in ('torch', 'loraplex.engine', 'loraplex.cache', 'loraplex.server', "
        "'loraplex.lora.adapter') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_registry_methods_are_the_stores_methods_forwarded() -> None:
    """The facade declares no signature of its own: each public method is a store's method
    (same signature and docstring), so a new parameter is one edit, in the store."""
    import inspect

    from loraplex.registry.audit import AuditLog
    from loraplex.registry.keys import ApiKeys
    from loraplex.registry.releases import Releases
    from loraplex.registry.revisions import Revisions
    from loraplex.registry.tenants import Tenants

    stores = (Revisions, Releases, Tenants, ApiKeys, AuditLog)
    own = {"open", "close", "generation"}
    public = [n for n in vars(Registry) if not n.startswith("_") and n not in own]
    store_methods = {n: getattr(s, n) for s in stores for n in vars(s) if not n.startswith("_")}
    assert set(public) == set(store_methods)  # every store method is reachable, nothing else
    for name in public:
        method = getattr(Registry, name)
        assert method.__wrapped__ is store_methods[name], name
        assert inspect.signature(method) == inspect.signature(store_methods[name]), name
        assert method.__doc__ == store_methods[name].__doc__, name
    with Registry.open("sqlite://") as reg:  # bound: the store's signature without self
        assert "warm" in inspect.signature(reg.register).parameters
        assert reg.list() == [] and reg.list_tenants() == []


def test_manifest_fields_are_the_revision_columns() -> None:
    """The Manifest dataclass is the one field list: the row conversion maps it by name."""
    from dataclasses import fields

    from loraplex.registry.db import RevisionRow

    columns = set(RevisionRow.__table__.columns.keys()) - {"id"}
    assert {f.name for f in fields(Manifest)} == columns


def test_signed_payload_bytes_are_stable() -> None:
    """Signatures already stored must keep verifying: the signed bytes of a manifest are pinned."""
    m = Manifest(
        name="x", tenant=None, revision="r7", sha256="a" * 64, weights_sha256="b" * 64,
        config_sha256="c" * 64, base_model_name="tiny", base_model_digest="d" * 64, rank=8,
        alpha=16, dtype="float32", target_modules=("q_proj", "v_proj"), nbytes=4096,
        source_uri="/elsewhere", priority=5, warm_policy="host", status="active",
    )  # fmt: skip
    expected = (
        '{"alpha":16.0,"base_model_digest":"' + "d" * 64 + '","config_sha256":"' + "c" * 64
        + '","dtype":"float32","name":"x","nbytes":4096,"rank":8,"sha256":"' + "a" * 64
        + '","target_modules":["q_proj","v_proj"],"tenant":null,"v":"loraplex-manifest-v1",'
        '"weights_sha256":"' + "b" * 64 + '"}'
    )  # fmt: skip
    assert m.signed_payload() == signed_payload(m) == expected.encode()
    # the revision, source and serving knobs are not signed
    moved = replace(m, revision="r8", source_uri="/other", priority=0, status="staged")
    assert moved.signed_payload() == m.signed_payload()
    assert replace(m, rank=9).signed_payload() != m.signed_payload()


def test_base_model_info_is_memoised(tiny_model: Path, tmp_path: Path) -> None:
    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    a = base_model_info(model)
    assert a.name == "m" and len(a.digest) == 64 and a.config["num_hidden_layers"] == 3
    memo_path = tmp_path / "home" / "base-digests.json"
    memo = json.loads(memo_path.read_text())
    weights = str((model / "model.safetensors").resolve())
    assert memo[weights]["sha256"] == file_sha(model / "model.safetensors")
    # a restart trusts the memo while (size, mtime) match: prove it by planting a fake hash
    memo[weights]["sha256"] = "0" * 64
    memo_path.write_text(json.dumps(memo))
    assert base_model_info(model).digest != a.digest
    # touching the file invalidates the memo entry
    st = (model / "model.safetensors").stat()
    os.utime(model / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert base_model_info(model).digest == a.digest
    with pytest.raises(RegistryError, match=r"config\.json"):
        base_model_info(tmp_path)


# ------------------------------------------------------------------------------ register


def test_register_records_a_full_manifest(db_url: str, root: Path, base: object) -> None:
    reg = open_reg(db_url, root)
    path = root / "all_r8"
    m = reg.register(path, "x", base=base, actor="alice", priority=3, slo_class="gold",
                     warm_policy="host")  # fmt: skip
    config, tensors = read_adapter_files(path)
    assert m.revision == "r1" and m.status == "validated" and m.tenant is None
    assert m.sha256 == compute_adapter_digest(config, tensors)
    assert m.weights_sha256 == file_sha(path / "adapter_model.safetensors")
    assert m.config_sha256 == file_sha(path / "adapter_config.json")
    assert (m.base_model_name, m.base_model_digest) == ("tiny", base.digest)  # type: ignore[attr-defined]
    assert (m.rank, m.alpha, m.dtype) == (8, 16.0, "float32")
    assert m.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                "down_proj")  # fmt: skip
    assert m.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert (m.priority, m.slo_class, m.warm_policy) == (3, "gold", "host")
    assert m.source_uri == m.path == str(path.resolve())
    assert m.ref.sha256 == m.sha256 and m.ref.revision == "r1"
    assert reg.get("x", "r1") == m and reg.release("x").active_revision is None

    # identical content again: the same revision, nothing new
    gen = reg.generation()
    assert reg.register(path, "x", base=base, actor="alice").revision == "r1"
    assert len(reg.list()) == 1 and reg.generation() >= gen
    with pytest.raises(RegistryError, match="already registered as revision 'r1'"):
        reg.register(path, "x", base=base, actor="alice", revision="v9")
    # new content: the next revision; an explicit label that exists is refused
    m2 = reg.register(variant(path, root / "x2", 1), "x", base=base, actor="alice")
    assert m2.revision == "r2" and m2.sha256 != m.sha256
    with pytest.raises(RegistryError, match="already has a revision 'r2'"):
        reg.register(variant(path, root / "x3", 2), "x", base=base, actor="a", revision="r2")
    m3 = reg.register(root / "x3", "x", base=base, actor="a", revision="canary-1")
    assert [r.revision for r in reg.list()] == ["r1", "r2", "canary-1"]
    assert m3.status == "validated"
    for bad in ("", "a b", "../x", "x..y", "-x"):
        with pytest.raises(RegistryError, match="invalid adapter name"):
            reg.register(path, bad, base=base, actor="a")
    with pytest.raises(RegistryError, match="warm_policy"):
        reg.register(path, "y", base=base, actor="a", warm_policy="always")
    reg.close()


def _refused(reg: Registry, reason: str, path: Path, name: str, base: object, **kw: object) -> None:
    n_audit = len(reg.audit_log(limit=1000))
    with pytest.raises(ValidationError) as ei:
        reg.register(path, name, base=base, actor="mallory", **kw)  # type: ignore[arg-type]
    assert ei.value.reason == reason, str(ei.value)
    assert reason in str(ei.value)
    with pytest.raises(NotFoundError):  # nothing recorded ...
        reg.release(name)
    log = reg.audit_log(limit=1000)
    assert len(log) == n_audit + 1  # ... but the refusal is audited
    assert (log[0].action, log[0].actor, log[0].after["reason"]) == (  # type: ignore[index]
        "register.refused", "mallory", reason)  # fmt: skip


def test_each_validation_failure_names_its_reason(
    db_url: str, root: Path, base: object, tmp_path: Path, narrow_model: Path
) -> None:
    reg = open_reg(db_url, root, max_rank=32)
    good = root / "all_r8"
    _refused(reg, "rank_too_large", root / "all_r64_layer1", "big", base)
    _refused(reg, "shape_mismatch", good, "narrow", base_model_info(narrow_model))
    _refused(reg, "sha256_mismatch", good, "wrongsha", base, sha256="ab" * 32)
    # formats and files the torch-free reader refuses: pickle weights, a truncated file, a
    # module without its lora_B
    cfg_only = [root / n for n in ("pickled", "truncated", "halfmodule")]
    for d in cfg_only:
        d.mkdir()
        shutil.copy(good / "adapter_config.json", d)
    _, tensors0 = read_adapter_files(good)
    torch.save(tensors0, cfg_only[0] / "adapter_model.bin")
    _refused(reg, "unsupported_format", cfg_only[0], "pickled", base)
    blob0 = (good / "adapter_model.safetensors").read_bytes()
    (cfg_only[1] / "adapter_model.safetensors").write_bytes(blob0[: len(blob0) // 2])
    _refused(reg, "unreadable", cfg_only[1], "truncated", base)
    b_key = next(k for k in sorted(tensors0) if "lora_B" in k)
    save_file({k: v for k, v in tensors0.items() if k != b_key},
              str(cfg_only[2] / "adapter_model.safetensors"))  # fmt: skip
    _refused(reg, "incomplete_adapter", cfg_only[2], "halfmodule", base)

    # embedding / lm_head LoRA tensors the config does not target, a full lm_head weight, and
    # a config naming a module no supported model has
    config, tensors = read_adapter_files(good)
    vocab, hidden = base.config["vocab_size"], base.config["hidden_size"]  # type: ignore[attr-defined]
    for i, (extra, reason) in enumerate((
        ({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, vocab),
          "base_model.model.model.embed_tokens.lora_embedding_B": torch.zeros(hidden, 8)},
         "unsupported_tensor"),
        ({"base_model.model.lm_head.weight": torch.zeros(vocab, hidden)}, "unsupported_tensor"),
    )):  # fmt: skip
        d = root / f"emb{i}"
        d.mkdir()
        shutil.copy(good / "adapter_config.json", d)
        save_file({**tensors, **extra}, str(d / "adapter_model.safetensors"))
        _refused(reg, reason, d, f"emb{i}", base)
    d = root / "gpt2_cfg"
    shutil.copytree(good, d)
    (d / "adapter_config.json").write_text(
        json.dumps({**config, "target_modules": ["q_proj", "c_attn"]})
    )
    _refused(reg, "unsupported_target", d, "gpt2", base)

    # sources: outside the roots, "..", a symlinked dir and a symlinked file leading out
    outside = tmp_path / "outside"
    shutil.copytree(good, outside)
    _refused(reg, "source_not_allowed", outside, "out", base)
    _refused(reg, "path_traversal", root / "all_r8" / ".." / "all_r8", "dots", base)
    (root / "link").symlink_to(outside, target_is_directory=True)
    _refused(reg, "source_not_allowed", root / "link", "link", base)
    d = root / "filelink"
    d.mkdir()
    shutil.copy(good / "adapter_config.json", d)
    (d / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    _refused(reg, "source_not_allowed", d, "filelink", base)
    _refused(reg, "source_not_allowed", good, "s3", base, source_uri="s3://evil/x/")
    no_roots = open_reg(db_url)
    _refused(no_roots, "source_not_allowed", good, "noroots", base)
    # ... unless the operator says so (its own --lora-modules)
    assert no_roots.register(outside, "op", base=base, actor="op", allow_any_source=True)
    prefixed = open_reg(db_url, root, allowed_prefixes=("s3://bucket/adapters/",))
    m = prefixed.register(outside, "s3ok", base=base, actor="a",
                          source_uri="s3://bucket/adapters/s3ok/")  # fmt: skip
    assert m.source_uri == "s3://bucket/adapters/s3ok/"
    _refused(prefixed, "source_not_allowed", outside, "s3bad", base,
             source_uri="s3://bucket/adapters-evil/x/")  # fmt: skip
    _refused(prefixed, "path_traversal", outside, "s3dots", base,
             source_uri="s3://bucket/adapters/../secrets/")  # fmt: skip

    # tampered weights: accepted at registration, refused when re-validated
    vic = root / "victim"
    shutil.copytree(good, vic)
    m = reg.register(vic, "victim", base=base, actor="a")
    reg.validate("victim", m.revision, base=base, actor="a")
    blob = bytearray((vic / "adapter_model.safetensors").read_bytes())
    blob[-1] ^= 0x01
    (vic / "adapter_model.safetensors").write_bytes(bytes(blob))
    with pytest.raises(ValidationError) as ei:
        reg.validate("victim", m.revision, base=base, actor="a")
    assert ei.value.reason == "sha256_mismatch"
    assert reg.audit_log(limit=1)[0].action == "validate.failed"
    reg.close()


def _drop_layer1_q(t: dict[str, torch.Tensor]) -> None:
    for k in [k for k in t if ".layers.1.self_attn.q_proj." in k]:
        del t[k]


@pytest.mark.parametrize(
    ("config", "edit", "reason"),
    [
        pytest.param({"init_lora_weights": "pissa"}, None, "unsupported_config", id="pissa"),
        pytest.param({"use_dora": True}, None, "unsupported_config", id="dora"),
        pytest.param(
            {"modules_to_save": ["lm_head"]}, None, "unsupported_config", id="modules-to-save"
        ),
        pytest.param({"target_modules": "(unclosed"}, None, "unsupported_config", id="regex"),
        pytest.param({"use_rslora": "yes"}, None, "unsupported_config", id="rslora-type"),
        pytest.param({"r": 4}, None, "shape_mismatch", id="rank-vs-r"),
        pytest.param({"layers_to_transform": [0, 1]}, None, "unsupported_tensor", id="untargeted"),
        pytest.param({"exclude_modules": ["v_proj"]}, None, "unsupported_tensor", id="excluded"),
        pytest.param({}, _drop_layer1_q, "incomplete_adapter", id="targeted-but-missing"),
    ],
)
def test_registry_refuses_what_the_loader_refuses(
    adapters: dict[str, Path], base: object, tmp_path: Path, config: dict, edit: object,
    reason: str,
) -> None:  # fmt: skip
    """One set of format rules: an adapter the engine's loader refuses cannot be registered,
    and both say why in the same words."""
    from loraplex.checkpoint.modules import BaseModelSpec
    from loraplex.lora.adapter import load_peft_adapter
    from loraplex.registry.inspect import inspect_adapter
    from loraplex.types import AdapterError

    cfg, tensors = read_adapter_files(adapters["all_r8"])
    if edit is not None:
        edit(tensors)  # type: ignore[operator]
    d = tmp_path / "bad"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    save_file(tensors, str(d / "adapter_model.safetensors"))
    with pytest.raises(AdapterError) as loader:
        load_peft_adapter(d, BaseModelSpec.from_hf_config(base.config))  # type: ignore[attr-defined]
    with pytest.raises(ValidationError) as registry:
        inspect_adapter(d, base, max_rank=64)  # type: ignore[arg-type]
    assert registry.value.reason == reason, str(registry.value)
    why = str(registry.value).removeprefix(f"{reason}: ")
    assert str(loader.value) == f"adapter {d}: {why}"


def test_lm_head_and_embedding_lora_register_and_modules_to_save_does_not(
    db_url: str, root: Path, base: object, tiny_model: Path
) -> None:
    """The registration check accepts LoRA on lm_head / embed_tokens (PEFT's tensors, its
    copies of the base matrices included) and refuses modules_to_save in one line naming the
    module, as the loader does."""
    reg = open_reg(db_url, root)
    d = make_random_adapter(
        tiny_model, root / "vocab", r=4, target_modules=["q_proj", "lm_head", "embed_tokens"],
        seed=11,
    )  # fmt: skip
    m = reg.register(d, "vocab", base=base, actor="a")
    assert m.target_modules == ("embed_tokens", "lm_head", "q_proj")
    full = root / "full"
    shutil.copytree(d, full)
    cfg = json.loads((full / "adapter_config.json").read_text())
    (full / "adapter_config.json").write_text(json.dumps({**cfg, "modules_to_save": ["lm_head"]}))
    with pytest.raises(ValidationError) as ei:
        reg.register(full, "full", base=base, actor="a")
    assert ei.value.reason == "unsupported_config"
    msg = str(ei.value)
    assert "full replacement weights for lm_head" in msg and "\n" not in msg, msg


def test_wrong_base_digest_is_refused_on_validate(
    db_url: str, root: Path, base: object, twin_model: Path
) -> None:
    reg = open_reg(db_url, root)
    m = reg.register(root / "mlp_r16", "m", base=base, actor="a")
    twin = base_model_info(twin_model)
    assert twin.config["hidden_size"] == base.config["hidden_size"]  # type: ignore[attr-defined]
    with pytest.raises(ValidationError) as ei:
        reg.validate("m", m.revision, base=twin, actor="a")
    assert ei.value.reason == "base_model_mismatch"
    assert reg.validate("m", m.revision, base=base, actor="a").status == "validated"


def test_signatures(db_url: str, root: Path, base: object) -> None:
    priv, pub = signing.generate_keypair()
    other_priv, other_pub = signing.generate_keypair()
    reg = open_reg(db_url, root, require_signatures=True, trusted_keys=(pub,))
    draft, _ = reg.prepare(root / "all_r8", "s", base=base)
    good = signing.sign(draft.signed_payload(), priv)
    _refused(reg, "unsigned", root / "all_r8", "s", base)
    _refused(reg, "bad_signature", root / "all_r8", "s", base,
             signature=signing.sign(draft.signed_payload(), other_priv))  # fmt: skip
    _refused(reg, "bad_signature", root / "all_r8", "s", base, signature="not base64!")
    # signed for another name (or tenant): the payload differs
    other_draft, _ = reg.prepare(root / "all_r8", "t", base=base)
    _refused(reg, "bad_signature", root / "all_r8", "s", base,
             signature=signing.sign(other_draft.signed_payload(), priv))  # fmt: skip
    m = reg.register(root / "all_r8", "s", base=base, actor="a", signature=good)
    assert m.signature == good and m.signed_by == signing.key_id(pub)
    assert m.signed_payload() == draft.signed_payload()
    # raw base64 trusted keys work too; a present-but-bad signature is refused even when
    # signatures are optional
    raw = signing.load_public_key(pub).public_bytes_raw()
    import base64

    lax = open_reg(db_url, root, trusted_keys=(base64.b64encode(raw).decode(),))
    assert lax.register(root / "mlp_r16", "u", base=base, actor="a").signature is None
    bad = signing.sign(b"something else", priv)
    _refused(lax, "bad_signature", root / "mlp_r16", "v", base, signature=bad)
    # re-validation re-verifies the stored signature against the configured keys
    assert lax.validate("s", "r1", base=base, actor="a").signed_by == signing.key_id(pub)
    strict_other = open_reg(db_url, root, require_signatures=True, trusted_keys=(other_pub,))
    with pytest.raises(ValidationError) as ei:
        strict_other.validate("s", "r1", base=base, actor="a")
    assert ei.value.reason == "bad_signature"
    with pytest.raises(ValidationError) as ei:
        strict_other.validate("u", "r1", base=base, actor="a")
    assert ei.value.reason == "unsigned"
    with pytest.raises(RegistryError, match="trusted key"):
        RegistryPolicy(trusted_keys=("garbage",))
    with pytest.raises(RegistryError, match="at least one trusted key"):
        RegistryPolicy(require_signatures=True)


# ------------------------------------------------------------------------------ lifecycle


def test_transition_table_refuses_every_other_move() -> None:
    for src in ADAPTER_STATUSES:
        for dst in ADAPTER_STATUSES:
            if dst in TRANSITIONS[src]:
                check_transition(src, dst)
            else:
                with pytest.raises(TransitionError) as ei:
                    check_transition(src, dst)
                msg = str(ei.value)
                assert f"{src} -> {dst}" in msg
                assert all(a in msg for a in TRANSITIONS[src])


def _at_status(reg: Registry, root: Path, base: object, name: str, status: str) -> None:
    """Register ``name`` and walk its revision r2 to ``status`` (r1 stays as the other one)."""
    reg.register(root / "attn_r4_rslora", name, base=base, actor="t")
    reg.register(root / "all_r8", name, base=base, actor="t")
    if status == "validated":
        return
    reg.stage(name, "r2", actor="t")
    if status == "staged":
        return
    reg.promote(name, "r2", actor="t")
    if status == "active":
        return
    if status == "deprecated":
        reg.promote(name, "r1", actor="t")
        return
    reg.disable(name, "r2", actor="t")


def test_registry_moves_follow_the_table(db_url: str, root: Path, base: object) -> None:
    reg = open_reg(db_url, root)
    ops = {
        "stage": lambda n: reg.stage(n, "r2", actor="t"),
        "promote": lambda n: reg.promote(n, "r2", actor="t"),
        "disable": lambda n: reg.disable(n, "r2", actor="t"),
        "canary": lambda n: reg.canary(n, "r2", 0.5, actor="t"),
    }
    i = 0
    for status in ("validated", "staged", "active", "deprecated", "disabled"):
        for op, call in ops.items():
            i += 1
            name = f"n{i}"
            _at_status(reg, root, base, name, status)
            assert reg.get(name, "r2").status == status
            if op == "canary" and reg.release(name).active_revision is None:
                reg.promote(name, "r1", actor="t")  # a canary needs an active revision
            allowed = {
                "stage": "staged" in TRANSITIONS[status],
                "promote": "active" in TRANSITIONS[status] or status == "validated",
                "disable": "disabled" in TRANSITIONS[status],
                "canary": status in ("validated", "staged"),
            }[op]
            before = reg.get(name, "r2").status
            if allowed:
                call(name)
            else:
                with pytest.raises(TransitionError):
                    call(name)
                assert reg.get(name, "r2").status == before, (status, op)
    reg.close()


def test_promote_canary_rollback(db_url: str, root: Path, base: object) -> None:
    reg = open_reg(db_url, root)
    r1 = reg.register(root / "all_r8", "x", base=base, actor="a")
    r2 = reg.register(variant(root / "all_r8", root / "v2", 1), "x", base=base, actor="a")
    r3 = reg.register(variant(root / "all_r8", root / "v3", 2), "x", base=base, actor="a")
    assert len({r1.sha256, r2.sha256, r3.sha256}) == 3
    assert serving(reg, base, "x", tenant=None, u=0.0) is None  # nothing active yet
    with pytest.raises(TransitionError, match="no active revision"):
        reg.canary("x", "r2", 0.1, actor="a")
    with pytest.raises(TransitionError, match="no canary"):
        reg.promote("x", actor="a")
    rel = reg.promote("x", "r1", actor="a")  # validated -> staged -> active
    assert (rel.active_revision, rel.previous_revision) == ("r1", None)
    assert reg.get("x").activated_at is not None and reg.get("x").rollback_revision is None
    with pytest.raises(TransitionError, match="active -> active"):
        reg.promote("x", "r1", actor="a")

    rel = reg.canary("x", "r2", 0.1, actor="a")
    assert (rel.canary_revision, rel.canary_weight) == ("r2", 0.1)
    assert reg.get("x", "r2").status == "staged"
    res = serving(reg, base, "x", tenant=None, u=0.05)
    assert res is not None and (res[0].sha256, res[1]) == (r2.sha256, "canary")
    res = serving(reg, base, "x", tenant=None, u=0.1)
    assert res is not None and (res[0].sha256, res[1]) == (r1.sha256, "active")
    with pytest.raises(RegistryError, match="weight"):
        reg.canary("x", "r2", 1.5, actor="a")

    rel = reg.promote("x", actor="a")  # the canary
    assert (rel.active_revision, rel.previous_revision, rel.canary_revision) == ("r2", "r1", None)
    assert rel.canary_weight == 0.0
    assert reg.get("x", "r1").status == "deprecated"
    assert reg.get("x").rollback_revision == "r1"
    reg.promote("x", "r3", actor="a")
    assert reg.get("x", "r2").status == "deprecated" and reg.get("x").rollback_revision == "r2"
    assert [m.revision for m in reg.list(status="active")] == ["r3"]

    rel = reg.rollback("x", actor="a")  # r3 -> disabled, r2 back at once
    assert (rel.active_revision, rel.previous_revision) == ("r2", "r1")
    assert reg.get("x", "r3").status == "disabled"
    res = serving(reg, base, "x", tenant=None, u=0.0)
    assert res is not None and res[0].sha256 == r2.sha256
    rel = reg.rollback("x", actor="a")
    assert (rel.active_revision, rel.previous_revision) == ("r1", None)
    with pytest.raises(TransitionError, match="no previous revision"):
        reg.rollback("x", actor="a")
    # a disabled revision comes back only through stage -> promote
    with pytest.raises(TransitionError):
        reg.promote("x", "r3", actor="a")
    reg.stage("x", "r3", actor="a")
    reg.canary("x", "r3", 0.2, actor="a")
    assert reg.release("x").canary_revision == "r3"
    m = reg.disable("x", actor="a")  # the active one
    # activate() re-enables in one step (disabled -> staged -> active) and is idempotent
    gen = reg.generation()
    assert reg.activate("x", "r1", actor="a").active_revision == "r1"
    assert reg.get("x", "r1").status == "active"
    assert reg.audit_log(limit=1)[0].action == "promote" and reg.generation() == gen + 1
    assert reg.activate("x", "r1", actor="a").active_revision == "r1"
    m = reg.disable("x", actor="a")
    assert m.revision == "r1" and reg.release("x").active_revision is None
    assert serving(reg, base, "x", tenant=None, u=0.0) is None
    with pytest.raises(NotFoundError, match="no active revision"):
        reg.get("x")
    with pytest.raises(NotFoundError):
        reg.promote("nope", actor="a")
    with pytest.raises(NotFoundError):
        reg.get("x", "r99")
    # the database itself refuses a second active revision of a name
    reg.promote("x", "r3", actor="a")
    eng = create_engine(db_url)
    with pytest.raises(Exception, match=r"(?i)unique|duplicate"), eng.begin() as c:
        c.execute(text("UPDATE adapter_revisions SET status = 'active' WHERE name = 'x'"))
    eng.dispose()
    assert [m.revision for m in reg.list(status="active")] == ["r3"]


def test_canary_split_statistics(db_url: str, root: Path, base: object) -> None:
    reg = open_reg(db_url, root)
    reg.register(root / "all_r8", "x", base=base, actor="a")
    reg.register(variant(root / "all_r8", root / "v2", 1), "x", base=base, actor="a")
    reg.promote("x", "r1", actor="a")
    rng = random.Random(1234)
    for weight in (0.1, 0.5):
        reg.canary("x", "r2", weight, actor="a")
        n = 400
        hits = sum(
            serving(reg, base, "x", tenant=None, u=rng.random())[1] == "canary"  # type: ignore[index]
            for _ in range(n)
        )
        sigma = (n * weight * (1 - weight)) ** 0.5
        assert abs(hits - n * weight) < 4 * sigma, (weight, hits)
    reg.canary("x", "r2", 0.0, actor="a")
    assert all(serving(reg, base, "x", tenant=None, u=u)[1] == "active"  # type: ignore[index]
               for u in (0.0, 0.5))  # fmt: skip
    reg.canary("x", "r2", 1.0, actor="a")
    assert all(serving(reg, base, "x", tenant=None, u=u)[1] == "canary"  # type: ignore[index]
               for u in (0.0, 0.999))  # fmt: skip


# ------------------------------------------------------------------------------ tenants


def test_tenant_visibility(db_url: str, root: Path, base: object) -> None:
    reg = open_reg(db_url, root)
    reg.create_tenant("acme", max_waiting=8, rate_limit_rps=2.5, host_bytes_budget=2**30,
                      actor="op")  # fmt: skip
    reg.create_tenant("globex", actor="op")
    with pytest.raises(RegistryError, match="already exists"):
        reg.create_tenant("acme", actor="op")
    with pytest.raises(NotFoundError, match="unknown tenant"):
        reg.register(root / "all_r8", "z", base=base, actor="a", tenant="initech")
    reg.register(root / "all_r8", "a-only", base=base, actor="a", tenant="acme")
    reg.register(root / "mlp_r16", "g-only", base=base, actor="a", tenant="globex")
    reg.register(root / "attn_r4_rslora", "shared", base=base, actor="a")
    reg.register(root / "qv_r32_regex", "a-staged", base=base, actor="a", tenant="acme")
    for n in ("a-only", "g-only", "shared"):
        reg.promote(n, "r1", actor="a")
    with pytest.raises(RegistryError, match="already taken"):
        reg.register(root / "patterns", "a-only", base=base, actor="g", tenant="globex")
    with pytest.raises(RegistryError, match="already taken"):
        reg.register(root / "patterns", "shared", base=base, actor="g", tenant="globex")

    assert serving(reg, base, "a-only", tenant="acme", u=0.0) is not None
    assert serving(reg, base, "a-only", tenant="globex", u=0.0) is None
    assert serving(reg, base, "g-only", tenant="acme", u=0.0) is None
    assert serving(reg, base, "shared", tenant="globex", u=0.0) is not None
    assert serving(reg, base, "a-staged", tenant="acme", u=0.0) is None  # not active
    assert serving(reg, base, "unknown", tenant="acme", u=0.0) is None
    assert serving(reg, base, "g-only", tenant=None, u=0.0) is not None  # the operator sees all
    assert [r.name for r in reg.visible(tenant="acme")] == ["a-only", "shared"]
    assert [r.name for r in reg.visible(tenant="globex")] == ["g-only", "shared"]
    assert [r.name for r in reg.visible(tenant=None)] == ["a-only", "g-only", "shared"]
    assert reg.visible(tenant="acme")[0].tenant == "acme"
    assert {m.name for m in reg.list(tenant="acme")} == {"a-only", "a-staged", "shared"}
    assert {m.name for m in reg.list(tenant="acme", include_shared=False)} == {"a-only", "a-staged"}
    assert len(reg.list()) == 4

    t = reg.get_tenant("acme")
    assert (t.max_waiting, t.rate_limit_rps, t.host_bytes_budget) == (8, 2.5, 2**30)
    t = reg.update_tenant("acme", actor="op", rate_limit_rps=None, max_waiting=3)
    assert (t.max_waiting, t.rate_limit_rps) == (3, None)
    with pytest.raises(RegistryError, match="unknown tenant limit"):
        reg.update_tenant("acme", actor="op", burst=3)
    with pytest.raises(RegistryError, match="rate_limit_rps"):
        reg.create_tenant("bad", rate_limit_rps=-1, actor="op")
    with pytest.raises(NotFoundError):
        reg.get_tenant("nobody")
    assert [t.name for t in reg.list_tenants()] == ["acme", "globex"]


def _all_cells(url: str) -> list[str]:
    eng = create_engine(url)
    cells: list[str] = []
    with eng.connect() as c:
        for table in inspect(eng).get_table_names():
            for row in c.execute(text(f'SELECT * FROM "{table}"')):
                cells += [str(v) for v in row]
    eng.dispose()
    return cells


def test_api_keys_are_hashed_scoped_and_revocable(db_url: str, tmp_path: Path) -> None:
    reg = open_reg(db_url)
    assert not reg.has_keys()
    reg.create_tenant("acme", actor="op")
    kid, secret = reg.create_key("acme", actor="op", label="ci")
    aid, admin_secret = reg.create_key(None, scopes=("admin:*",), actor="op")
    pid, promo_secret = reg.create_key(None, scopes=("admin:promote", "inference"), actor="op")
    assert secret.startswith("lpx-") and len(secret) >= 36 and reg.has_keys()
    p = reg.authenticate(secret)
    assert p is not None and (p.key_id, p.tenant, p.scopes) == (kid, "acme", {"inference"})
    assert p.allows("inference") and not p.allows("admin:register")
    a = reg.authenticate(admin_secret)
    assert a is not None and a.tenant is None
    assert all(a.allows(s) for s in ("admin:register", "admin:promote", "admin:pin", "admin:load"))
    assert not a.allows("inference")
    q = reg.authenticate(promo_secret)
    assert q is not None and q.allows("admin:promote") and not q.allows("admin:pin")
    for wrong in ("", "lpx-", secret + "x", secret[:-1], "Bearer " + secret, None):
        assert reg.authenticate(wrong) is None  # type: ignore[arg-type]
    with pytest.raises(RegistryError, match="only hold the 'inference' scope"):
        reg.create_key("acme", scopes=("admin:*",), actor="op")
    with pytest.raises(RegistryError, match="unknown scope"):
        reg.create_key(None, scopes=("root",), actor="op")
    with pytest.raises(NotFoundError):
        reg.create_key("initech", actor="op")

    listed = reg.list_keys()
    assert {k["key_id"] for k in listed} == {kid, aid, pid}
    assert [k["key_id"] for k in reg.list_keys("acme")] == [kid]
    dumped = json.dumps(listed)
    for s in (secret, admin_secret, promo_secret):
        assert s not in dumped and hashlib.sha256(s.encode()).hexdigest() not in dumped
    # the secret is nowhere in the database, only its sha256
    cells = _all_cells(db_url)
    for s in (secret, admin_secret, promo_secret):
        assert not any(s in c for c in cells)
        assert hashlib.sha256(s.encode()).hexdigest() in cells
    if db_url.startswith("sqlite"):
        db = Path(db_url.removeprefix("sqlite:///"))
        blob = b"".join(p.read_bytes() for p in db.parent.glob(db.name + "*"))
        assert secret.encode() not in blob and secret[4:].encode() not in blob
        assert hashlib.sha256(secret.encode()).hexdigest().encode() in blob

    reg.revoke_key(kid, actor="op")
    assert reg.authenticate(secret) is None
    assert next(k for k in reg.list_keys() if k["key_id"] == kid)["revoked"]
    with pytest.raises(RegistryError, match="already revoked"):
        reg.revoke_key(kid, actor="op")
    with pytest.raises(NotFoundError):
        reg.revoke_key("key_nope", actor="op")
    reg.revoke_key(aid, actor="op")
    reg.revoke_key(pid, actor="op")
    assert not reg.has_keys()


# ------------------------------------------------------------------------------ audit


def test_every_mutation_is_audited_with_before_after(db_url: str, root: Path, base: object) -> None:
    reg = open_reg(db_url, root)
    steps = [
        ("tenant.create", "tenant:acme", lambda: reg.create_tenant("acme", actor="op")),
        ("tenant.update", "tenant:acme",
         lambda: reg.update_tenant("acme", actor="op", max_waiting=4)),
        ("register", "x@r1", lambda: reg.register(root / "all_r8", "x", base=base, actor="op")),
        ("register", "x@r2", lambda: reg.register(variant(root / "all_r8", root / "v2", 1), "x",
                                                  base=base, actor="op")),
        ("validate", "x@r1", lambda: reg.validate("x", "r1", base=base, actor="op")),
        ("stage", "x@r1", lambda: reg.stage("x", "r1", actor="op")),
        ("promote", "x", lambda: reg.promote("x", "r1", actor="op")),
        ("canary", "x", lambda: reg.canary("x", "r2", 0.25, actor="op")),
        ("promote", "x", lambda: reg.promote("x", actor="op")),
        ("rollback", "x", lambda: reg.rollback("x", actor="op")),
        ("disable", "x@r1", lambda: reg.disable("x", actor="op")),
        ("key.create", None, lambda: reg.create_key("acme", actor="op")),
        ("key.revoke", None, lambda: reg.revoke_key(reg.list_keys()[0]["key_id"], actor="op")),
        ("pin", "x", lambda: reg.audit("op", "pin", "x", {"pinned": False}, {"pinned": True})),
    ]  # fmt: skip
    for action, target, call in steps:
        gen = reg.generation()
        call()
        assert reg.generation() > gen, action
        e = reg.audit_log(limit=1)[0]
        assert (e.action, e.actor) == (action, "op")
        if target is not None:
            assert e.target == target
        assert e.after is not None and e.ts > 0
        if action not in ("tenant.create", "register", "key.create"):
            assert e.before is not None and e.before != e.after, action
    log = reg.audit_log(limit=100)
    assert [e.action for e in reversed(log)] == [s[0] for s in steps]
    promote = next(e for e in log if e.action == "promote")  # the canary's promotion
    assert (promote.before["active_revision"], promote.before["canary_revision"]) == ("r1", "r2")
    assert (promote.after["active_revision"], promote.after["canary_revision"]) == ("r2", None)
    rb = next(e for e in log if e.action == "rollback")
    assert (rb.before["active_revision"], rb.after["active_revision"]) == ("r2", "r1")
    assert {e.target for e in reg.audit_log(target="x")} == {"x", "x@r1", "x@r2"}
    assert len(reg.audit_log(limit=2)) == 2
    created = next(e for e in log if e.action == "key.create")
    assert "secret" not in json.dumps(created.after)


# ------------------------------------------------------------------------------ migrations


def test_migrations_run_once_and_match_the_models(db_url: str) -> None:
    reg = open_reg(db_url)
    reg.create_tenant("t", actor="op")
    eng = create_engine(db_url)
    assert current_revision(eng) == head_revision()
    tables = sorted(inspect(eng).get_table_names())
    reg.close()
    reg2 = open_reg(db_url)  # a second open is a no-op that keeps the data
    assert [t.name for t in reg2.list_tenants()] == ["t"]
    assert current_revision(eng) == head_revision()
    assert sorted(inspect(eng).get_table_names()) == tables
    insp = inspect(eng)
    for table in Base.metadata.sorted_tables:
        cols = {c["name"] for c in insp.get_columns(table.name)}
        assert cols == {c.name for c in table.columns}, table.name
    indexes = {i["name"] for i in insp.get_indexes("adapter_revisions")}
    assert {"uq_one_active", "ix_revisions_sha256"} <= indexes
    with eng.connect() as c:
        assert (
            c.execute(text("SELECT version_num FROM alembic_version")).scalar() == head_revision()
        )
    eng.dispose()
    reg2.close()


def test_open_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(RegistryError, match="bad registry URL"):
        Registry.open("not a url")
    with pytest.raises(RegistryError, match="cannot open registry"):
        Registry.open("postgresql+psycopg://u:secretpw@127.0.0.1:1/x")
    try:
        Registry.open("postgresql+psycopg://u:secretpw@127.0.0.1:1/x")
    except RegistryError as e:
        assert "secretpw" not in str(e)
    reg = Registry.open()  # default: $LORAPLEX_HOME/registry.db
    assert reg.url == f"sqlite:///{tmp_path / 'home' / 'registry.db'}"
    assert (tmp_path / "home" / "registry.db").exists()


def test_in_memory_registry_works_across_threads() -> None:
    reg = Registry.open("sqlite://")
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            reg.create_tenant(f"t{i}", actor="op")
            reg.create_key(f"t{i}", actor="op")
            reg.list_tenants()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(reg.list_tenants()) == 8 and len(reg.list_keys()) == 8


# ------------------------------------------------------------------------------ concurrency


def test_concurrent_promotes_and_registers(db_url: str, root: Path, base: object) -> None:
    regs = [open_reg(db_url, root) for _ in range(4)]
    dirs = [variant(root / "all_r8", root / f"v{i}", i) for i in range(4)]
    errors: list[BaseException] = []

    def run_all(calls: list) -> list:
        barrier = threading.Barrier(len(calls))
        out: list = [None] * len(calls)

        def go(i: int) -> None:
            barrier.wait()
            try:
                out[i] = calls[i]()
            except BaseException as e:
                out[i] = e

        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(calls))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        return out

    # four registrations of different content under one name: r1..r4, no duplicates
    out = run_all([lambda i=i: regs[i].register(dirs[i], "x", base=base, actor=f"w{i}")
                   for i in range(4)])  # fmt: skip
    assert not [o for o in out if isinstance(o, BaseException)], out
    assert sorted(m.revision for m in out) == ["r1", "r2", "r3", "r4"]
    # the same content four times at once: one revision
    out = run_all([lambda i=i: regs[i].register(root / "mlp_r16", "y", base=base, actor="w")
                   for i in range(4)])  # fmt: skip
    assert {m.revision for m in out} == {"r1"} and len(regs[0].list()) == 5
    # rounds of simultaneous promotes of different revisions: always exactly one active
    for rnd in range(3):
        revs = ["r1", "r2", "r3", "r4"] if rnd % 2 == 0 else ["r4", "r3", "r2", "r1"]
        out = run_all([lambda i=i, r=r: regs[i].promote("x", r, actor=f"w{i}")
                       for i, r in enumerate(revs)])  # fmt: skip
        errors += [o for o in out if isinstance(o, BaseException)
                   and not isinstance(o, TransitionError)]  # fmt: skip
        active = [m.revision for m in regs[0].list(status="active") if m.name == "x"]
        assert len(active) == 1, active
        assert regs[1].release("x").active_revision == active[0]
    assert not errors, errors
    promotes = [e for e in regs[0].audit_log(limit=1000) if e.action == "promote"]
    # every successful promote left one audit entry whose before is the prior after
    chain = sorted(promotes, key=lambda e: e.id)
    for a, b in itertools.pairwise(chain):
        assert a.after["active_revision"] == b.before["active_revision"]  # type: ignore[index]
    for r in regs:
        r.close()


_PROMOTER = """
import os, sys, time
from loraplex.registry import Registry, TransitionError
reg = Registry.open(sys.argv[1])
reg.generation()
print("ready", flush=True)
while not os.path.exists(sys.argv[3]):  # the parent says go to both at once
    time.sleep(0.002)
done = 0
for rev in sys.argv[2].split(","):
    try:
        reg.promote("x", rev, actor="proc")
        done += 1
    except TransitionError:
        pass  # the other process made it active first
print(done)
"""


def test_processes_promoting_at_once_leave_one_active(
    db_url: str, root: Path, base: object, tmp_path: Path
) -> None:
    """Two processes (separate connections and locks) promote at the same moment."""
    reg = open_reg(db_url, root)
    for i in range(3):
        reg.register(variant(root / "all_r8", root / f"p{i}", i), "x", base=base, actor="a")
    go = tmp_path / "go"
    orders = ["r1,r2,r3,r1,r2,r3", "r3,r2,r1,r3,r1,r2"]
    procs = [
        subprocess.Popen([sys.executable, "-c", _PROMOTER, db_url, order, str(go)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for order in orders
    ]  # fmt: skip
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready", p.stderr
    go.touch()
    done = 0
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        done += int(out)
    assert done >= 2
    active = [m.revision for m in reg.list(status="active")]
    assert len(active) == 1 and reg.release("x").active_revision == active[0]
    chain = sorted(
        (e for e in reg.audit_log(limit=100) if e.action == "promote"), key=lambda e: e.id
    )
    assert len(chain) == done
    for a, b in itertools.pairwise(chain):
        assert a.after["active_revision"] == b.before["active_revision"]  # type: ignore[index]
    reg.close()


_OPENER = """
import os, sys, time
import loraplex.registry as R
print("ready", flush=True)
while not os.path.exists(sys.argv[2]):
    time.sleep(0.002)
reg = R.Registry.open(sys.argv[1])
reg.create_tenant(f"t{os.getpid()}", actor="proc")
"""


def test_processes_opening_a_fresh_database_at_once(db_url: str, tmp_path: Path) -> None:
    """Only one process migrates; the others wait and find the schema current."""
    go = tmp_path / "go"
    procs = [
        subprocess.Popen([sys.executable, "-c", _OPENER, db_url, str(go)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]  # fmt: skip
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    go.touch()
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    reg = open_reg(db_url)
    assert len(reg.list_tenants()) == 2 and reg.generation() == 2
    eng = create_engine(db_url)
    assert current_revision(eng) == head_revision()
    eng.dispose()
    reg.close()


# ------------------------------------------------------------------------------ limits and canary
# issue 19 items 3-4: the manifest's max_concurrent_requests (validated, bounded), a canary's health
# policy on its release, and the idempotent rollback_canary that replicas call when they judge a
# canary unhealthy


def _two_revisions(reg: Registry, root: Path, base: object) -> None:
    reg.register(root / "all_r8", "x", base=base, actor="a", max_concurrent_requests=4)
    reg.register(variant(root / "all_r8", root / "v2", 1), "x", base=base, actor="a")
    reg.promote("x", "r1", actor="a")


def test_max_concurrent_requests_is_recorded_and_bounded(
    db_url: str, root: Path, base: object
) -> None:
    reg = open_reg(db_url, root)
    for bad in (0, -1, MAX_CONCURRENT_REQUESTS + 1, 2.5, True, "3"):
        with pytest.raises(RegistryError, match="max_concurrent_requests"):
            reg.register(root / "all_r8", "x", base=base, actor="a", max_concurrent_requests=bad)
    m = reg.register(root / "all_r8", "x", base=base, actor="a", max_concurrent_requests=3)
    assert m.max_concurrent_requests == 3 and reg.get("x", "r1").max_concurrent_requests == 3
    entry = reg.audit_log(limit=1)[0]
    assert entry.action == "register" and entry.after["max_concurrent_requests"] == 3  # type: ignore[index]
    other = reg.register(variant(root / "all_r8", root / "v2", 1), "x", base=base, actor="a")
    assert other.max_concurrent_requests is None  # the default: no limit


def test_canary_policy_is_validated() -> None:
    for bad in (
        {"window_s": 0},
        {"window_s": float("inf")},
        {"min_requests": 0},
        {"max_error_rate": 1.5},
        {"max_ttft_p95_s": -1.0},
        {"min_quality": 2},
        {"scorer": "Not a name!"},
        {"max_concurrent_requests": 0},
        {"windw_s": 10},  # a typo is refused, not dropped
    ):
        with pytest.raises(RegistryError):
            CanaryPolicy.from_dict(bad)
    p = CanaryPolicy.from_dict({"window_s": 30, "min_requests": 5, "scorer": "json"})
    assert CanaryPolicy.from_dict(p.to_dict()) == p


def test_canary_policy_is_stored_with_the_release_and_cleared_with_the_canary(
    db_url: str, root: Path, base: object
) -> None:
    reg = open_reg(db_url, root)
    _two_revisions(reg, root, base)
    policy = CanaryPolicy(
        window_s=60, min_requests=5, max_error_rate=0.2, max_concurrent_requests=1
    )
    rel = reg.canary("x", "r2", 0.5, actor="a", policy=policy)
    assert rel.canary_policy == policy and reg.release("x").canary_policy == policy
    assert reg.audit_log(limit=1)[0].after["canary_policy"]["min_requests"] == 5  # type: ignore[index]
    rel = reg.promote("x", actor="a")
    assert rel.canary_policy is None and rel.canary_revision is None


def test_rollback_canary_is_idempotent_and_audited(db_url: str, root: Path, base: object) -> None:
    reg = open_reg(db_url, root)
    _two_revisions(reg, root, base)
    reg.canary("x", "r2", 0.5, actor="a", policy=CanaryPolicy(min_requests=1))
    rel = reg.rollback_canary("x", "r2", actor="system:canary-health", reason="error rate 1.0")
    assert rel is not None
    assert (rel.active_revision, rel.canary_revision, rel.canary_policy) == ("r1", None, None)
    assert reg.get("x", "r2").status == "disabled"
    assert rel.last_rollback is not None
    assert (rel.last_rollback.revision, rel.last_rollback.actor, rel.last_rollback.reason) == (
        "r2",
        "system:canary-health",
        "error rate 1.0",
    )
    assert reg.release("x").last_rollback == rel.last_rollback
    entry = reg.audit_log(limit=1)[0]
    assert (entry.actor, entry.action, entry.target) == ("system:canary-health", "rollback", "x")
    assert entry.before["canary_revision"] == "r2"  # type: ignore[index]
    assert entry.after["reason"] == "error rate 1.0"  # type: ignore[index]
    # a second replica's rollback of the same canary writes nothing and keeps r1 active
    n = len(reg.audit_log())
    assert reg.rollback_canary("x", "r2", actor="system:canary-health", reason="again") is None
    assert len(reg.audit_log()) == n and reg.release("x").active_revision == "r1"
    with pytest.raises(RegistryError, match="reason"):
        reg.rollback_canary("x", "r2", actor="a", reason="")


def test_replicas_rolling_back_one_canary_at_once_stop_it_once(
    db_url: str, root: Path, base: object
) -> None:
    """Four registries on one database (four replicas) roll back the same canary together:
    exactly one writes, the active revision is untouched, one audit entry."""
    first = open_reg(db_url, root)
    _two_revisions(first, root, base)
    first.canary("x", "r2", 0.5, actor="a", policy=CanaryPolicy(min_requests=1))
    regs = [open_reg(db_url, root) for _ in range(4)]
    barrier = threading.Barrier(len(regs))
    results: list[object] = []
    errors: list[BaseException] = []

    def run(reg: Registry) -> None:
        barrier.wait()
        try:
            results.append(reg.rollback_canary("x", "r2", actor="system:canary-health", reason="e"))
        except BaseException as e:  # collected: the assertion below names it
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in regs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sum(r is not None for r in results) == 1
    rel = first.release("x")
    assert (rel.active_revision, rel.canary_revision) == ("r1", None)
    rollbacks = [e for e in first.audit_log(target="x") if e.action == "rollback"]
    assert len(rollbacks) == 1


def test_manual_rollback_records_its_reason(db_url: str, root: Path, base: object) -> None:
    reg = open_reg(db_url, root)
    _two_revisions(reg, root, base)
    reg.promote("x", "r2", actor="a")
    rel = reg.rollback("x", actor="op", reason="bad answers")
    assert rel.active_revision == "r1" and rel.last_rollback is not None
    assert (rel.last_rollback.revision, rel.last_rollback.reason) == ("r2", "bad answers")


def test_quantized_base_is_recorded_and_takes_the_float_bases_adapters(
    db_url: str, root: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """An adapter trained on the float base registers for its quantized forms (same shapes);
    each registration and validation records how the base is quantized."""
    from loraplex.testing.quant import write_gptq

    gptq, _ = write_gptq(tiny_model, tmp_path / "gptq", tmp_path / "ref", bits=4, group_size=32)
    quantized = base_model_info(gptq, "tiny-gptq")
    at_load = base_model_info(tiny_model, "tiny", quantization="int4")
    assert quantized.quantization == "gptq w4 g32" and at_load.quantization == "int4"
    assert base_model_info(tiny_model, "tiny").quantization is None
    from loraplex.testing.compressed import write_compressed_tensors

    for scheme, want in (
        ("W4A8", "compressed-tensors w4 g32 a8"),
        ("W8A16", "compressed-tensors w8 g32"),
    ):
        ct, _ = write_compressed_tensors(
            tiny_model, tmp_path / scheme, tmp_path / f"{scheme}-ref", scheme, group_size=32
        )
        assert base_model_info(ct, scheme).quantization == want
    assert at_load.digest == base_model_info(tiny_model, "tiny").digest  # the same files
    reg = open_reg(db_url, root)
    path = root / "all_r8"
    m = reg.register(path, "x", base=quantized, actor="alice")
    assert m.base_model_digest == quantized.digest
    reg.validate("x", m.revision, base=quantized, actor="alice")
    log = reg.audit_log(limit=10)
    assert (
        log[0].action == "validate"
        and log[0].after["verified"]["base_quantization"] == "gptq w4 g32"
    )  # type: ignore[index]
    assert log[1].action == "register" and log[1].after["base_quantization"] == "gptq w4 g32"  # type: ignore[index]
    reg.close()


def test_hybrid_adapter_registers_against_its_base_only(
    db_url: str, root: Path, base: object, workdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A Qwen3.5 adapter on the linear-attention projections registers against a Qwen3.5 base
    (its modules recorded in table order) and is refused against a Llama base, naming the
    module that base lacks."""
    hybrid = make_random_model(workdir / "qwen3_5", "qwen3_5", num_layers=2, with_tokenizer=False)
    old = os.environ.get("LORAPLEX_HOME")
    os.environ["LORAPLEX_HOME"] = str(tmp_path_factory.mktemp("home-hybrid"))
    try:
        hybrid_base = base_model_info(hybrid, "hybrid")
    finally:
        if old is None:
            os.environ.pop("LORAPLEX_HOME", None)
        else:
            os.environ["LORAPLEX_HOME"] = old
    reg = open_reg(db_url, root)
    d = make_random_adapter(
        hybrid, root / "gdn", r=4, target_modules=["in_proj_qkv", "out_proj", "q_proj"], seed=12
    )
    m = reg.register(d, "gdn", base=hybrid_base, actor="a")
    assert m.target_modules == ("q_proj", "in_proj_qkv", "out_proj")
    with pytest.raises(ValidationError) as ei:
        reg.register(d, "gdn-on-llama", base=base, actor="a")
    assert "in_proj_qkv" in str(ei.value) or "out_proj" in str(ei.value), str(ei.value)
