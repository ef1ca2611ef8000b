"""The engine's local catalog: an offline LoRARequest becomes an AdapterSpec keyed by the digest
of the directory's files — hashed once per version of the files, again when they change."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

from loraplex.engine.adapter_catalog import LocalAdapterCatalog
from loraplex.lora.digest import digest_safetensors_dir
from loraplex.requests import LoRARequest
from loraplex.types import AdapterError
from tests.s3fixture import write_adapter


def test_digest_is_memoised_until_the_files_change(tmp_path: Path) -> None:
    path, d1 = write_adapter(tmp_path / "x", seed=1)
    _, d2 = write_adapter(tmp_path / "y", seed=2)  # same shapes and sizes, other bytes
    cat = LocalAdapterCatalog()
    s = cat.spec(LoRARequest("x", path))
    assert (s.ref.name, s.ref.revision, s.sha256, s.source_uri) == ("x", d1[:12], d1, str(path))
    assert cat.spec(LoRARequest("other-name", 7, path, revision="r1")).ref.revision == "r1"
    assert cat.spec(LoRARequest("x", f"file://{path}")).sha256 == d1
    assert cat.hashes == 1  # repeated requests, any name or form: no re-hash
    mtimes = {f.name: f.stat().st_mtime_ns for f in path.iterdir()}
    shutil.rmtree(path)
    shutil.copytree(tmp_path / "y", path)
    for f in path.iterdir():  # a rewrite with a distinct mtime (sizes are equal)
        os.utime(f, ns=(mtimes[f.name] + 10**9, mtimes[f.name] + 10**9))
    assert cat.spec(LoRARequest("x", path)).sha256 == d2 == digest_safetensors_dir(path)
    assert cat.hashes == 2


def test_bin_adapters_hash_like_safetensors_ones(tmp_path: Path) -> None:
    st, digest = write_adapter(tmp_path / "st", seed=3)
    binary, bin_digest = write_adapter(tmp_path / "bin", seed=3, fmt="bin")
    cat = LocalAdapterCatalog()
    assert cat.spec(LoRARequest("b", binary)).sha256 == bin_digest == digest
    assert cat.spec(LoRARequest("s", st)).sha256 == digest


def test_concurrent_requests_hash_a_directory_once(tmp_path: Path) -> None:
    path, digest = write_adapter(tmp_path / "x", seed=4)
    cat = LocalAdapterCatalog()
    barrier = threading.Barrier(16)
    got: list[str] = []

    def run() -> None:
        barrier.wait()
        got.append(cat.spec(LoRARequest("x", path)).sha256)

    threads = [threading.Thread(target=run) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [digest] * 16 and cat.hashes == 1


def test_bad_sources_are_clear_errors(tmp_path: Path) -> None:
    cat = LocalAdapterCatalog()
    with pytest.raises(AdapterError, match=r"'ghost'.*not a directory"):
        cat.spec(LoRARequest("ghost", tmp_path / "missing"))
    path, _ = write_adapter(tmp_path / "bad", seed=5)
    weights = path / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(AdapterError, match=r"'bad'.*corrupt"):
        cat.spec(LoRARequest("bad", path))
    with pytest.raises(AdapterError, match="no object store is configured"):
        cat.spec(LoRARequest("s3", "s3://bucket/adapters/x"))
    assert cat.hashes == 0
