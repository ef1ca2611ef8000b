"""Object stores: LocalDirStore on a temp dir, S3Store against a real moto S3 server on loopback."""

from __future__ import annotations

import os
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplex.cache import store as store_mod
from loraplex.cache.backends import open_store
from loraplex.cache.s3 import S3Store
from loraplex.cache.store import LocalDirStore, ObjectStore
from loraplex.cache.verify import fetch_verified
from loraplex.lora import adapter as adapter_mod
from loraplex.lora.adapter import compute_adapter_digest, load_peft_adapter, read_adapter_files
from loraplex.lora.peft import files as peft_files
from loraplex.types import (
    AdapterIntegrityError,
    StoreError,
    StoreNotFoundError,
    StorePermissionError,
    StoreUnavailableError,
)
from tests.s3fixture import TINY_SPEC, fake_aws_env, free_port, run_moto_server, write_adapter


def digest_of(path: Path) -> str:
    return compute_adapter_digest(*read_adapter_files(path))


def test_file_names_are_the_adapter_reader_s() -> None:
    """The store moves exactly the files the reader reads: both take them from lora.peft.files."""
    assert store_mod.CONFIG_NAME is adapter_mod.CONFIG_NAME is peft_files.CONFIG_NAME
    assert store_mod.SAFETENSORS_NAME is adapter_mod.SAFETENSORS_NAME
    assert store_mod.BIN_NAME is adapter_mod.BIN_NAME
    assert store_mod.ADAPTER_FILES == (
        peft_files.CONFIG_NAME, peft_files.SAFETENSORS_NAME, peft_files.BIN_NAME
    )  # fmt: skip
    assert store_mod.choose_adapter_files is peft_files.choose_adapter_files


# -- open_store -----------------------------------------------------------------------------------


def test_open_store_picks_backend_by_scheme(tmp_path: Path) -> None:
    assert isinstance(open_store(str(tmp_path)), LocalDirStore)
    assert isinstance(open_store(tmp_path), LocalDirStore)
    assert isinstance(open_store(tmp_path.as_uri()), LocalDirStore)
    with pytest.raises(ValueError, match="'gs'"):
        open_store("gs://bucket/prefix")
    with pytest.raises(ValueError, match="no bucket"):
        open_store("s3:///prefix")
    with pytest.raises(StoreNotFoundError, match="does not exist"):
        open_store(str(tmp_path / "missing"))


def test_open_s3_without_boto3_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)  # import boto3 -> ImportError
    with pytest.raises(StoreError, match=r"pip install 'loraplex\[s3\]'"):
        open_store("s3://bucket/prefix")


# -- LocalDirStore --------------------------------------------------------------------------------


@pytest.fixture
def local(tmp_path: Path) -> LocalDirStore:
    (tmp_path / "root").mkdir()
    return LocalDirStore(tmp_path / "root")


def test_local_round_trip(local: LocalDirStore, tmp_path: Path) -> None:
    src, digest = write_adapter(tmp_path / "src", seed=1)
    assert isinstance(local, ObjectStore)
    assert not local.exists("team/a")
    local.put_dir(src, "team/a")
    assert local.exists("team/a")
    uri = local.uri("team/a")
    assert uri == (local.root / "team" / "a").as_uri()
    assert local.list() == [uri] and local.list("team") == [uri] and local.list("team/a") == [uri]
    entry = local.stat("team/a")
    assert entry.nbytes == sum((src / n).stat().st_size for n in entry.files)
    for ref in ("team/a", uri, str(local.root / "team" / "a")):  # relative, file://, absolute
        res = local.fetch(ref, tmp_path / "dl" / ref.replace("/", "_"))
        assert res.files == ("adapter_config.json", "adapter_model.safetensors")
        assert res.nbytes == entry.nbytes and res.seconds >= 0
        assert res.fingerprint == entry.fingerprint and res.stage == "remote_download"
        assert digest_of(res.dest) == digest
    local.delete("team/a")
    assert not local.exists("team/a") and local.list() == []
    local.delete("team/a")  # idempotent


def test_local_bin_adapters_and_preference(local: LocalDirStore, tmp_path: Path) -> None:
    src, digest = write_adapter(tmp_path / "bin", seed=2, fmt="bin")
    local.put_dir(src, "b")
    res = local.fetch("b", tmp_path / "dl")
    assert res.files == ("adapter_config.json", "adapter_model.bin")
    assert digest_of(res.dest) == digest
    # both weight files present: the safetensors one is the adapter (as read_adapter_files reads)
    st, st_digest = write_adapter(tmp_path / "st", seed=3)
    (local.root / "b" / "adapter_model.safetensors").write_bytes(
        (st / "adapter_model.safetensors").read_bytes()
    )
    (local.root / "b" / "adapter_config.json").write_bytes(
        (st / "adapter_config.json").read_bytes()
    )
    res = local.fetch("b", tmp_path / "dl2")
    assert res.files == ("adapter_config.json", "adapter_model.safetensors")
    assert digest_of(res.dest) == st_digest
    # put_dir replaces: the stale .bin is gone after uploading a safetensors-only adapter
    local.put_dir(st, "b")
    assert not (local.root / "b" / "adapter_model.bin").exists()


def test_local_fingerprint_changes_on_rewrite(local: LocalDirStore, tmp_path: Path) -> None:
    a, _ = write_adapter(tmp_path / "a", seed=1)
    b, _ = write_adapter(tmp_path / "b", seed=2)
    local.put_dir(a, "x")
    for f in (local.root / "x").iterdir():  # an old mtime: the rewrite below is surely later
        os.utime(f, ns=(1_000_000_000, 1_000_000_000))
    fp = local.fingerprint("x")
    assert local.fingerprint("x") == fp
    local.put_dir(b, "x")  # same sizes, new bytes: the mtime changes
    assert local.fingerprint("x") != fp


def test_local_missing_adapter(local: LocalDirStore, tmp_path: Path) -> None:
    with pytest.raises(StoreNotFoundError, match="no adapter directory at 'nope'"):
        local.fetch("nope", tmp_path / "dl")
    assert not (tmp_path / "dl").exists()
    (local.root / "half").mkdir()
    (local.root / "half" / "adapter_config.json").write_text("{}")
    with pytest.raises(StoreNotFoundError, match="missing weights"):
        local.stat("half")
    assert not local.exists("half")


@pytest.mark.parametrize(
    "uri",
    ["../outside", "a/../../outside", "a/../b", "..", "", ".", "s3://bucket/a", "file://host/x"],
)
def test_local_refuses_uris_escaping_the_root(local: LocalDirStore, uri: str) -> None:
    with pytest.raises(StorePermissionError, match="refused adapter URI"):
        local.fetch(uri, local.root.parent / "dl")
    assert not (local.root.parent / "dl").exists()


def test_local_refuses_absolute_paths_and_symlinks_outside(
    local: LocalDirStore, tmp_path: Path
) -> None:
    outside, _ = write_adapter(tmp_path / "outside", seed=4)
    for uri in (str(outside), outside.as_uri()):
        with pytest.raises(StorePermissionError, match="outside the store root"):
            local.stat(uri)
    # a symlinked directory pointing out of the root
    (local.root / "link").symlink_to(outside, target_is_directory=True)
    with pytest.raises(StorePermissionError, match="outside the store root"):
        local.fetch("link", tmp_path / "dl")
    # a real directory inside whose weights file is a symlink to a file outside
    inner = local.root / "inner"
    inner.mkdir()
    (inner / "adapter_config.json").write_bytes((outside / "adapter_config.json").read_bytes())
    (inner / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    with pytest.raises(StorePermissionError, match=r"adapter_model\.safetensors resolves to"):
        local.fetch("inner", tmp_path / "dl")
    assert not (tmp_path / "dl").exists()
    with pytest.raises(StorePermissionError):
        local.put_dir(outside, "../escape")
    assert not (tmp_path / "escape").exists()
    # a symlink that stays inside the root is fine
    local.put_dir(outside, "real")
    (local.root / "alias").symlink_to(local.root / "real", target_is_directory=True)
    assert local.exists("alias")


def test_local_fetch_failure_leaves_nothing(
    local: LocalDirStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, _ = write_adapter(tmp_path / "src")
    local.put_dir(src, "a")
    real_copy = store_mod.shutil.copyfile
    calls = []

    def failing_copy(s: Path, d: Path) -> None:
        calls.append(s)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_copy(s, d)

    monkeypatch.setattr(store_mod.shutil, "copyfile", failing_copy)
    with pytest.raises(StoreError, match="No space left on device"):
        local.fetch("a", tmp_path / "dl")
    assert not (tmp_path / "dl").exists()


# -- S3Store against moto_server ------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A moto S3 server for this module, with fake credentials in the environment."""
    tmp = tmp_path_factory.mktemp("moto")
    with fake_aws_env(tmp), run_moto_server(tmp) as url:
        yield url


@pytest.fixture(scope="module")
def boto_session(s3_endpoint: str) -> object:
    """One boto3 session for the module: its clients share the loaded service models (fast)."""
    import boto3

    return boto3.session.Session()


@pytest.fixture
def s3(s3_endpoint: str, boto_session: object) -> S3Store:
    """An S3Store on a fresh bucket, under the prefix ``adapters/``."""
    bucket = f"lp-{uuid.uuid4().hex[:12]}"
    store = S3Store(bucket, "adapters", endpoint_url=s3_endpoint, session=boto_session)
    store._client.create_bucket(Bucket=bucket)
    return store


def test_s3_round_trip(s3: S3Store, tmp_path: Path) -> None:
    src, digest = write_adapter(tmp_path / "src", seed=5)
    assert isinstance(s3, ObjectStore)
    uri = s3.uri("team/a")
    assert uri == f"s3://{s3.bucket}/adapters/team/a/"
    assert not s3.exists(uri)
    s3.put_dir(src, uri)
    assert s3.exists(uri) and s3.exists("team/a") and s3.exists(uri.rstrip("/"))
    s3.put_dir(src, "team/b")
    assert s3.list() == [uri, s3.uri("team/b")]
    assert s3.list("team/a") == [uri]
    entry = s3.stat(uri)
    assert entry.files == {n: (src / n).stat().st_size for n in entry.files}
    res = s3.fetch(uri, tmp_path / "dl")
    assert res.files == ("adapter_config.json", "adapter_model.safetensors")
    assert res.nbytes == entry.nbytes and res.fingerprint == entry.fingerprint
    assert digest_of(tmp_path / "dl") == digest
    # the fetched copy is a servable adapter with the same identity
    loaded = load_peft_adapter(tmp_path / "dl", TINY_SPEC, name="a")
    assert loaded.ref.sha256 == digest
    vf = fetch_verified(s3, uri, tmp_path / "dl2", digest, name="a")
    assert vf.digest == digest and vf.fetch.seconds > 0 and vf.verify_seconds > 0
    s3.delete(uri)
    assert not s3.exists(uri) and s3.list() == [s3.uri("team/b")]


def test_s3_bin_adapter(s3: S3Store, tmp_path: Path) -> None:
    src, digest = write_adapter(tmp_path / "src", seed=6, fmt="bin")
    s3.put_dir(src, "b")
    res = s3.fetch("b", tmp_path / "dl")
    assert res.files == ("adapter_config.json", "adapter_model.bin")
    assert digest_of(tmp_path / "dl") == digest


def test_s3_fingerprint_changes_when_rewritten(s3: S3Store, tmp_path: Path) -> None:
    a, _ = write_adapter(tmp_path / "a", seed=1)
    b, digest_b = write_adapter(tmp_path / "b", seed=2)
    s3.put_dir(a, "x")
    fp = s3.fingerprint("x")
    assert s3.fingerprint("x") == fp
    s3.put_dir(b, "x")  # same sizes, different bytes: the ETag changes
    assert s3.fingerprint("x") != fp
    assert digest_of(s3.fetch("x", tmp_path / "dl").dest) == digest_b


def test_s3_object_changed_during_download(
    s3: S3Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, _ = write_adapter(tmp_path / "a", seed=1)
    b, _ = write_adapter(tmp_path / "b", seed=2)
    s3.put_dir(a, "x")
    stale = s3._stat("x")
    s3.put_dir(b, "x")
    monkeypatch.setattr(s3, "_stat", lambda uri: stale)  # listing saw a, the GET finds b
    with pytest.raises(StoreError, match="changed while it was being downloaded"):
        s3.fetch("x", tmp_path / "dl")
    assert not (tmp_path / "dl").exists()


@pytest.mark.parametrize(
    "uri",
    [
        "s3://other-bucket/adapters/a/",
        "s3://{bucket}/elsewhere/a/",
        "s3://{bucket}/adapters/",
        "s3://{bucket}/adapters/../secret/a/",
        "s3://{bucket}/adapters//a/",
        "../secret",
        "gs://{bucket}/adapters/a/",
    ],
)
def test_s3_refuses_uris_outside_bucket_and_prefix(s3: S3Store, tmp_path: Path, uri: str) -> None:
    uri = uri.format(bucket=s3.bucket)
    for call in (lambda: s3.fetch(uri, tmp_path / "dl"), lambda: s3.exists(uri)):
        with pytest.raises(StorePermissionError, match="refused adapter URI") as info:
            call()
        assert s3.bucket in str(info.value) and info.value.uri == uri
    with pytest.raises(StorePermissionError):
        s3.put_dir(write_adapter(tmp_path / "src")[0], uri)
    assert not (tmp_path / "dl").exists()


def test_s3_missing_key_and_bucket(
    s3: S3Store, s3_endpoint: str, boto_session: object, tmp_path: Path
) -> None:
    with pytest.raises(StoreNotFoundError, match=r"no such key .*adapters/nope/adapter_config"):
        s3.fetch("nope", tmp_path / "dl")
    assert not (tmp_path / "dl").exists()
    src, _ = write_adapter(tmp_path / "src")
    s3._client.upload_file(
        str(src / "adapter_config.json"), s3.bucket, "adapters/half/adapter_config.json"
    )
    with pytest.raises(StoreNotFoundError, match="config but no weights"):
        s3.stat("half")
    missing = S3Store("no-such-bucket-here", endpoint_url=s3_endpoint, session=boto_session)
    with pytest.raises(StoreNotFoundError, match="no such bucket 'no-such-bucket-here'"):
        missing.fetch("a", tmp_path / "dl")


def test_s3_endpoint_down_fails_fast(boto_session: object, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    store = S3Store("bucket", "p", endpoint_url=url, session=boto_session)
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailableError) as info:
        store.fetch("a", tmp_path / "dl")
    assert time.monotonic() - t0 < 60  # a refused connection fails at once, not after retries
    msg = str(info.value)
    assert f"S3 endpoint {url} unreachable" in msg and "s3://bucket/p/a/" in msg
    assert not (tmp_path / "dl").exists()


def test_s3_endpoint_that_never_answers_times_out(boto_session: object) -> None:
    with socket.socket() as srv:  # accepts connections (kernel backlog) but never replies
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        url = f"http://127.0.0.1:{srv.getsockname()[1]}"
        store = S3Store(
            "bucket", endpoint_url=url, read_timeout=0.3, max_attempts=2, session=boto_session
        )
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailableError, match=f"S3 endpoint {url} timed out"):
            store.exists("a")
        assert time.monotonic() - t0 < 60  # 2 attempts x 0.3 s, not botocore's 60 s default


def test_s3_access_denied_is_clear(s3: S3Store, tmp_path: Path) -> None:
    from botocore.stub import Stubber

    with Stubber(s3._client) as stub:
        stub.add_client_error(
            "list_objects_v2", "AccessDenied", "Access Denied", http_status_code=403
        )
        with pytest.raises(StorePermissionError, match="access denied \\(AccessDenied"):
            s3.fetch("a", tmp_path / "dl")


def test_s3_endpoint_from_environment(
    s3_endpoint: str, boto_session: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    store = open_store("s3://env-bucket/some/prefix/", session=boto_session)
    assert isinstance(store, S3Store)
    assert store.endpoint_url == s3_endpoint and store.prefix == "some/prefix/"
    assert s3_endpoint in store.describe()
    store._client.create_bucket(Bucket="env-bucket")
    src, digest = write_adapter(tmp_path / "src", seed=9)
    store.put_dir(src, "a")
    assert store.list() == ["s3://env-bucket/some/prefix/a/"]
    assert digest_of(store.fetch("s3://env-bucket/some/prefix/a", tmp_path / "dl").dest) == digest


def test_fetch_verified_mismatch_deletes_the_download_not_the_source(
    s3: S3Store, tmp_path: Path
) -> None:
    src, _ = write_adapter(tmp_path / "src", seed=1)
    _, other = write_adapter(tmp_path / "other", seed=2)
    s3.put_dir(src, "a")
    with pytest.raises(AdapterIntegrityError) as info:
        fetch_verified(s3, "a", tmp_path / "dl", other, name="team-a")
    e = info.value
    msg = str(e)
    assert "'team-a'" in msg and "object_store tier" in msg and other[:12] in msg
    assert "bad copy was deleted" in msg and e.deleted and e.expected == other
    assert not (tmp_path / "dl").exists()
    assert s3.exists("a")  # the source of truth is reported, never deleted from here
