"""The L2 disk tier: atomic content-addressed entries, restarts, budget, verification, faults."""

from __future__ import annotations

import errno
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.cache import disk as disk_mod
from loraplex.cache.disk import MANIFEST_NAME, DiskBudgetError, DiskTier, DiskTierError
from loraplex.cache.store import LocalDirStore
from loraplex.cache.verify import verify_adapter_dir
from loraplex.types import AdapterCorruptError, AdapterError, AdapterIntegrityError
from tests.s3fixture import write_adapter

ST = "adapter_model.safetensors"
CFG = "adapter_config.json"


@pytest.fixture
def adapters(tmp_path: Path) -> list[tuple[Path, str]]:
    """Four distinct adapters (same size each), as (dir, digest)."""
    return [write_adapter(tmp_path / "src" / f"a{i}", seed=i) for i in range(4)]


def tmp_dirs(root: Path) -> list[str]:
    return [p.name for p in root.iterdir() if p.name.startswith(".tmp-")]


def test_put_is_content_addressed_and_atomic(tmp_path: Path, adapters: list) -> None:
    src, digest = adapters[0]
    size = DiskTier.nbytes_of(src)
    with DiskTier(tmp_path / "l2", 10 * size) as tier:
        assert tier.path(digest) is None and digest not in tier
        assert tier.put(digest, src) == size
        entry = tier.path(digest)
        assert entry == tmp_path / "l2" / digest
        assert sorted(p.name for p in entry.iterdir()) == sorted([CFG, ST, MANIFEST_NAME])
        assert tier.entries() == {digest: size} and tier.used_bytes == size
        assert tier.free_bytes == 9 * size and len(tier) == 1
        assert tier.put(digest, src) == size  # already there: no-op
        assert tier.used_bytes == size and tmp_dirs(tier.root) == []
        res = tier.load_verified(digest, "a0")
        assert res.digest == digest and res.nbytes == size and res.stage == "disk_load"
        assert (
            res.seconds > 0 and res.path == entry and set(res.tensors) == set(load_file(src / ST))
        )
        assert tier.remove(digest) == size
        assert tier.remove(digest) == 0
        assert tier.entries() == {} and not entry.exists() and tmp_dirs(tier.root) == []


def test_bin_adapter_and_only_the_used_weights_are_copied(tmp_path: Path) -> None:
    src, digest = write_adapter(tmp_path / "bin", seed=1, fmt="bin")
    with DiskTier(tmp_path / "l2", 1 << 20) as tier:
        tier.put(digest, src)
        assert (tier.root / digest / "adapter_model.bin").is_file()
        assert tier.load_verified(digest, "b").digest == digest
    # both weight files in the source: only the safetensors one (the one that is read) is kept
    st, st_digest = write_adapter(tmp_path / "st", seed=2)
    shutil.copy(src / "adapter_model.bin", st / "adapter_model.bin")
    with DiskTier(tmp_path / "l2", 1 << 20) as tier:
        tier.put(st_digest, st)
        assert not (tier.root / st_digest / "adapter_model.bin").exists()
        assert tier.entries()[st_digest] == DiskTier.nbytes_of(st)


def test_restart_rebuilds_the_index(tmp_path: Path, adapters: list) -> None:
    size = DiskTier.nbytes_of(adapters[0][0])
    with DiskTier(tmp_path / "l2", 10 * size) as tier:
        for src, digest in adapters[:3]:
            tier.put(digest, src)
        before = tier.entries()
    with DiskTier(tmp_path / "l2", 10 * size) as again:
        assert again.entries() == before
        assert again.scan_report.entries == 3 and again.scan_report.dropped == []
        assert set(again.access_times()) == set(before)
        for _src, digest in adapters[:3]:
            assert again.load_verified(digest, "x").digest == digest


def test_root_is_owned_by_one_tier_at_a_time(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "l2", 100)
    with pytest.raises(DiskTierError, match="in use by another DiskTier"):
        DiskTier(tmp_path / "l2", 100)
    tier.close()
    DiskTier(tmp_path / "l2", 100).close()


def test_crash_leftovers_are_cleaned_at_start(tmp_path: Path, adapters: list) -> None:
    src0, d0 = adapters[0]
    d1, d2, d3 = (d for _, d in adapters[1:])
    root = tmp_path / "l2"
    with DiskTier(root, 1 << 20) as tier:
        for src, digest in adapters:
            tier.put(digest, src)
    # a write interrupted before its rename, and a delete interrupted after its rename
    half = root / ".tmp-0123abcd"
    half.mkdir()
    (half / CFG).write_text("{")
    shutil.copytree(root / d0, root / ".tmp-del-feed")
    # an entry whose weights were truncated, one without manifest, one with a wrong manifest
    with open(root / d1 / ST, "r+b") as f:
        f.truncate(100)
    (root / d2 / MANIFEST_NAME).unlink()
    manifest = json.loads((root / d3 / MANIFEST_NAME).read_text())
    manifest["digest"] = d0
    (root / d3 / MANIFEST_NAME).write_text(json.dumps(manifest))
    (root / "notes.txt").write_text("not ours: left alone")
    with DiskTier(root, 1 << 20) as tier:
        assert tier.entries() == {d0: DiskTier.nbytes_of(src0)}
        report = tier.scan_report
        assert report.temp_removed == 2 and report.entries == 1
        assert sorted(d.split(":")[0] for d in report.dropped) == sorted([d1, d2, d3])
        assert any("truncated" in d for d in report.dropped)
        assert sorted(p.name for p in root.iterdir()) == sorted([d0, ".lock", "notes.txt"])


def test_budget_is_never_exceeded(tmp_path: Path, adapters: list) -> None:
    size = DiskTier.nbytes_of(adapters[0][0])
    with DiskTier(tmp_path / "l2", 2 * size + size // 2) as tier:
        tier.put(adapters[0][1], adapters[0][0])
        tier.put(adapters[1][1], adapters[1][0])
        with pytest.raises(DiskBudgetError, match="evict first") as info:
            tier.put(adapters[2][1], adapters[2][0])
        e = info.value
        assert e.needed == size and e.free == size // 2 and e.capacity == tier.capacity_bytes
        assert tier.path(adapters[2][1]) is None and tmp_dirs(tier.root) == []
        assert tier.used_bytes == 2 * size
        tier.remove(adapters[0][1])  # the caller evicts, then the put fits
        tier.put(adapters[2][1], adapters[2][0])
        assert tier.used_bytes == 2 * size <= tier.capacity_bytes


def test_concurrent_puts_respect_the_budget(tmp_path: Path, adapters: list) -> None:
    size = DiskTier.nbytes_of(adapters[0][0])
    with DiskTier(tmp_path / "l2", 2 * size) as tier:
        errors: list[Exception] = []
        barrier = threading.Barrier(len(adapters) * 2)

        def put(src: Path, digest: str) -> None:
            barrier.wait()
            try:
                tier.put(digest, src)
            except DiskBudgetError as e:
                errors.append(e)

        threads = [threading.Thread(target=put, args=a) for a in adapters * 2]  # each digest twice
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert tier.used_bytes <= tier.capacity_bytes
        assert sum(p.stat().st_size for p in tier.root.glob("*/adapter_*")) == tier.used_bytes
        assert len(tier) >= 1 and tmp_dirs(tier.root) == []
        assert tier.free_bytes == tier.capacity_bytes - tier.used_bytes


def test_truncated_file_is_an_error_naming_the_tier_and_is_deleted(
    tmp_path: Path, adapters: list
) -> None:
    src, digest = adapters[0]
    with DiskTier(tmp_path / "l2", 1 << 20) as tier:
        tier.put(digest, src)
        weights = tier.root / digest / ST
        with open(weights, "r+b") as f:
            f.truncate(weights.stat().st_size - 10)
        with pytest.raises(AdapterCorruptError) as info:
            tier.load_verified(digest, "team-a")
        msg = str(info.value)
        assert "'team-a'" in msg and "disk tier" in msg and "truncated" in msg
        assert "bad copy was deleted" in msg and info.value.deleted
        assert info.value.tier == "disk" and info.value.name == "team-a"
        assert tier.path(digest) is None and not (tier.root / digest).exists()
        assert tier.used_bytes == 0
        tier.put(digest, src)  # a fresh copy can come back
        assert tier.load_verified(digest, "team-a").digest == digest


@pytest.mark.parametrize("what", ["tensors", "config"])
def test_checksum_mismatch_is_an_integrity_error_and_is_deleted(
    tmp_path: Path, adapters: list, what: str
) -> None:
    (src, digest), (other, _) = adapters[0], adapters[1]
    with DiskTier(tmp_path / "l2", 1 << 20) as tier:
        tier.put(digest, src)
        entry = tier.root / digest
        if what == "tensors":  # same sizes, other bytes: passes the cheap size check
            shutil.copyfile(other / ST, entry / ST)
        else:  # a math-relevant config field changed
            cfg = json.loads((entry / CFG).read_text())
            cfg["lora_alpha"] = 3 * cfg["lora_alpha"]
            (entry / CFG).write_text(json.dumps(cfg))
        with pytest.raises(AdapterIntegrityError) as info:
            tier.load_verified(digest, "team-a")
        e = info.value
        msg = str(e)
        assert "'team-a'" in msg and "disk tier" in msg
        assert f"expected {digest[:12]}" in msg and e.actual[:12] in msg and e.actual != digest
        assert e.expected == digest and e.deleted and "bad copy was deleted" in msg
        assert digest not in tier and not entry.exists()


def test_disk_full_leaves_no_partial_entry(
    tmp_path: Path, adapters: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, digest = adapters[0]

    def copy_half_then_enospc(s: Path, d: Path) -> None:
        data = Path(s).read_bytes()
        Path(d).write_bytes(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    with DiskTier(tmp_path / "l2", 1 << 20) as tier:
        monkeypatch.setattr(disk_mod.shutil, "copyfile", copy_half_then_enospc)
        with pytest.raises(DiskTierError, match="No space left on device") as info:
            tier.put(digest, src)
        assert digest[:12] in str(info.value) and str(tier.root) in str(info.value)
        assert tier.entries() == {} and tier.free_bytes == tier.capacity_bytes
        assert sorted(p.name for p in tier.root.iterdir()) == [".lock"]
        monkeypatch.undo()
        assert tier.put(digest, src) == DiskTier.nbytes_of(src)


def test_failed_rename_leaves_no_partial_entry(
    tmp_path: Path, adapters: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, digest = adapters[0]

    def failing_rename(a: object, b: object) -> None:
        raise OSError(errno.EIO, "Input/output error")

    with DiskTier(tmp_path / "l2", 1 << 20) as tier:
        monkeypatch.setattr(disk_mod.os, "rename", failing_rename)
        with pytest.raises(DiskTierError, match="Input/output error"):
            tier.put(digest, src)
        monkeypatch.undo()
        assert tier.entries() == {} and sorted(p.name for p in tier.root.iterdir()) == [".lock"]


def test_staging_moves_a_verified_download_in(tmp_path: Path, adapters: list) -> None:
    src, digest = adapters[0]
    (tmp_path / "store").mkdir()
    store = LocalDirStore(tmp_path / "store")
    store.put_dir(src, "a")
    with DiskTier(tmp_path / "l2", 1 << 20) as tier:
        with tier.staging() as tmp:
            store.fetch("a", tmp)
            verify_adapter_dir(tmp, digest, name="a", tier="object_store")
            (tmp / "junk").write_text("x")  # anything else is not part of the entry
            assert tier.put(digest, tmp) == DiskTier.nbytes_of(src)
            assert not tmp.exists()  # moved, not copied
        assert sorted(p.name for p in (tier.root / digest).iterdir()) == sorted(
            [CFG, ST, MANIFEST_NAME]
        )
        # an abandoned staging dir (e.g. a failed download) is removed on exit
        with tier.staging() as tmp:
            (tmp / CFG).write_text("{}")
        assert tmp_dirs(tier.root) == []
        # over budget from staging: nothing stored, the staging dir still cleaned up
        small = DiskTier.nbytes_of(src)
        tier.remove(digest)
        tier.capacity_bytes = small - 1
        with pytest.raises(DiskBudgetError), tier.staging() as tmp:
            store.fetch("a", tmp)
            tier.put(digest, tmp)
        assert tier.entries() == {} and tmp_dirs(tier.root) == []


def test_verify_adapter_dir(tmp_path: Path, adapters: list) -> None:
    src, digest = adapters[0]
    config, tensors, actual = verify_adapter_dir(src, digest, name="a", tier="host")
    assert actual == digest and config["peft_type"] == "LORA" and tensors
    assert verify_adapter_dir(src, None, name="a", tier="host")[2] == digest
    with pytest.raises(ValueError, match="64 lowercase hex"):
        verify_adapter_dir(src, "abc", name="a", tier="host")
    # a tensor swapped for another of the same shape is caught
    t = load_file(src / ST)
    first = sorted(t)[0]
    t[first] = torch.zeros_like(t[first])
    save_file(t, str(src / ST))
    with pytest.raises(AdapterIntegrityError, match="'a': the host tier copy"):
        verify_adapter_dir(src, digest, name="a", tier="host")
    with pytest.raises(AdapterCorruptError, match="directory not found"):
        verify_adapter_dir(tmp_path / "nothing", digest, name="a", tier="disk")


def test_bad_digests_and_sources_are_refused(tmp_path: Path, adapters: list) -> None:
    with DiskTier(tmp_path / "l2", 1 << 20) as tier:
        for bad in ("../../etc", "ABC" * 21 + "D", "a" * 63, ".tmp-x"):
            with pytest.raises(ValueError, match="64 lowercase hex"):
                tier.put(bad, adapters[0][0])
            with pytest.raises(ValueError):
                tier.path(bad)
        with pytest.raises(DiskTierError, match="not in the disk tier"):
            tier.load_verified("0" * 64, "ghost")
        (tmp_path / "empty").mkdir()
        with pytest.raises(AdapterError, match="not an adapter directory"):
            tier.put("0" * 64, tmp_path / "empty")
    with pytest.raises(ValueError, match=">= 0 bytes"):
        DiskTier(tmp_path / "l3", -1)


def test_source_changing_during_put_stores_nothing(
    tmp_path: Path, adapters: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, digest = adapters[0]
    real_copy = disk_mod.shutil.copyfile

    def copy_and_grow(s: Path, d: Path) -> None:
        real_copy(s, d)
        with open(d, "ab") as f:  # the source was appended to mid-copy
            f.write(b"more")

    with DiskTier(tmp_path / "l2", 1 << 20) as tier:
        monkeypatch.setattr(disk_mod.shutil, "copyfile", copy_and_grow)
        with pytest.raises(DiskTierError, match="changed while adapter"):
            tier.put(digest, src)
        assert tier.entries() == {} and tier.free_bytes == tier.capacity_bytes
        assert sorted(p.name for p in tier.root.iterdir()) == [".lock"]


@pytest.mark.parametrize("what", ["tensors", "one_byte", "first_data_byte", "config"])
def test_a_changed_copy_is_caught_after_a_verified_load(
    tmp_path: Path, adapters: list, what: str
) -> None:
    """Loads after the first full verification compare BLAKE3 file hashes of the bytes read:
    the same tensors come back, and any change since is still an integrity error."""
    (src, digest), (other, _) = adapters[0], adapters[1]
    with DiskTier(tmp_path / "l2", 1 << 20) as tier:
        tier.put(digest, src)
        first = tier.load_verified(digest, "team-a")  # full verification
        again = tier.load_verified(digest, "team-a")  # the same bytes: file hashes only
        assert again.config == first.config and again.tensors.keys() == first.tensors.keys()
        for name, t in first.tensors.items():
            assert torch.equal(again.tensors[name], t) and again.tensors[name].dtype == t.dtype
            assert again.tensors[name].data_ptr() != t.data_ptr()  # its own buffer
        want = load_file(str(src / ST))
        assert all(torch.equal(again.tensors[k], v) for k, v in want.items())
        entry = tier.root / digest
        if what == "tensors":
            shutil.copyfile(other / ST, entry / ST)
        elif what == "one_byte":  # the last byte of the data: inside the last tensor
            raw = bytearray((entry / ST).read_bytes())
            raw[-1] ^= 0x01
            (entry / ST).write_bytes(bytes(raw))
        elif what == "first_data_byte":  # right after the header: inside the first tensor
            raw = bytearray((entry / ST).read_bytes())
            raw[8 + int.from_bytes(raw[:8], "little")] ^= 0x01
            (entry / ST).write_bytes(bytes(raw))
        else:
            cfg = json.loads((entry / CFG).read_text())
            cfg["lora_alpha"] = 3 * cfg["lora_alpha"]
            (entry / CFG).write_text(json.dumps(cfg))
        with pytest.raises(AdapterIntegrityError) as info:
            tier.load_verified(digest, "team-a")
        assert info.value.deleted and digest not in tier and not entry.exists()


def test_a_copy_changed_outside_the_math_is_verified_again_and_kept(
    tmp_path: Path, adapters: list
) -> None:
    """A config byte that is not part of the digest (whitespace) misses the fast path; the full
    verification passes, the entry stays, and the same tensors come back."""
    src, digest = adapters[0]
    with DiskTier(tmp_path / "l2", 1 << 20) as tier:
        tier.put(digest, src)
        first = tier.load_verified(digest, "team-a")
        cfg = tier.root / digest / CFG
        cfg.write_text(cfg.read_text() + "\n")
        again = tier.load_verified(digest, "team-a")
        assert again.config == first.config and digest in tier and cfg.exists()
        assert all(torch.equal(again.tensors[k], t) for k, t in first.tensors.items())
        assert tier.load_verified(digest, "team-a").digest == digest  # and again after that
