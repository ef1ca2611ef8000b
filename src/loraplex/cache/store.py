"""Object stores (the L3 tier): where adapter directories live as the source of truth.

One small protocol, :class:`ObjectStore`, with two backends chosen once at start-up by
:func:`~loraplex.cache.backends.open_store`: :class:`LocalDirStore` (a directory tree, here) and
:class:`~loraplex.cache.s3.S3Store` (S3 or any S3-compatible service through boto3). A store
only moves bytes: it fetches an adapter directory's known files (``adapter_config.json`` plus
``adapter_model.safetensors`` or, failing that, ``adapter_model.bin``), reports a cheap change
fingerprint, uploads, deletes and lists. It never decides what to cache or evict, and it does not
verify digests (see ``verify.py``).

This module holds what every backend shares (the errors, the protocol and its value types, the
fetch helpers that leave nothing behind on failure) and the local backend; the S3 backend is in
``s3.py``, the choice between them in ``backends.py``.

Every failure is a :class:`StoreError` (an :class:`AdapterError`) whose message names the store,
the URI and the cause; subclasses tell "not there" from "not allowed" from "store down".
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable
from urllib.parse import unquote, urlparse

from loraplex.lora.peft.files import (
    ADAPTER_FILES,
    BIN_NAME,
    CONFIG_NAME,
    SAFETENSORS_NAME,
    choose_adapter_files,
)
from loraplex.paths import contained
from loraplex.types import StoreError, StoreNotFoundError, StorePermissionError

STAGE_REMOTE_DOWNLOAD = "remote_download"


@dataclass(frozen=True)
class StoreEntry:
    """What a store holds for one adapter: the files fetch would download and their sizes."""

    uri: str
    files: dict[str, int]  # file name -> size in bytes (config + chosen weights file)
    fingerprint: str

    @property
    def nbytes(self) -> int:
        return sum(self.files.values())


@dataclass(frozen=True)
class FetchResult:
    """One download of an adapter directory into ``dest`` (the ``remote_download`` stage)."""

    uri: str
    dest: Path
    files: tuple[str, ...]
    nbytes: int
    seconds: float
    fingerprint: str  # of the objects actually downloaded
    stage: str = field(default=STAGE_REMOTE_DOWNLOAD)


@runtime_checkable
class ObjectStore(Protocol):
    """Where adapters come from. URIs are full (``file://``, ``s3://``) or relative to the root."""

    def describe(self) -> str:
        """Human-readable identity of the store, for errors and metrics."""
        ...

    def uri(self, name: str) -> str:
        """The full URI of the adapter directory ``name`` (relative to the store's root)."""
        ...

    def stat(self, uri: str) -> StoreEntry:
        """Files and sizes of one adapter; :class:`StoreNotFoundError` if it is not complete."""
        ...

    def fingerprint(self, uri: str) -> str:
        """Cheap change detector (sizes + mtimes locally, sizes + ETags on S3)."""
        ...

    def exists(self, uri: str) -> bool:
        """Whether a complete adapter (config + weights) is at ``uri``."""
        ...

    def fetch(self, uri: str, dest: Path) -> FetchResult:
        """Download the adapter's files into ``dest`` (created if needed); nothing left on error."""
        ...

    def put_dir(self, src: Path, uri: str) -> None:
        """Upload the adapter files of ``src`` to ``uri``, replacing what was there."""
        ...

    def delete(self, uri: str) -> None:
        """Remove the adapter files at ``uri`` (no error if they are already gone)."""
        ...

    def list(self, prefix: str = "") -> list[str]:
        """Full URIs of the adapter directories under ``prefix`` (relative to the root), sorted."""
        ...


def local_files(src: Path) -> list[str]:
    """Known adapter file names present (as regular files) in a local directory."""
    return [n for n in ADAPTER_FILES if (src / n).is_file()]


def files_to_put(src: Path) -> tuple[list[str], list[str]]:
    """What every backend's ``put_dir`` of ``src`` writes and then deletes: its adapter files,
    weights first and the config last (a reader that sees the config also sees the weights),
    and the known adapter files it lacks (a former upload's, never to be mixed with this one).
    A :class:`StoreError` unless ``src`` holds a config and a weights file."""
    names = local_files(src)
    if CONFIG_NAME not in names or len(names) < 2:
        raise StoreError(f"{src} is not an adapter directory (needs config + weights)")
    writes = sorted(names, key=lambda n: n == CONFIG_NAME)
    return writes, [n for n in ADAPTER_FILES if n not in names]


def fetch_files(dest: Path, files: Sequence[str], copy_one: Callable[[str, Path], int]) -> int:
    """Copy every file of an adapter into ``dest`` with ``copy_one(name, target) -> bytes``; on
    any failure the files written so far (and ``dest``, if this call created it) are removed
    before the error propagates. Returns the bytes written."""
    created = _prepare_dest(dest)
    written: list[str] = []
    try:
        total = 0
        for name in files:
            written.append(name)
            total += copy_one(name, dest / name)
        return total
    except BaseException:
        _remove_files(dest, written, created)
        raise


def _remove_files(dest: Path, names: Iterable[str], created_dest: bool) -> None:
    """Undo a failed fetch: drop the files it wrote (and ``dest`` if the fetch created it)."""
    for n in names:
        (dest / n).unlink(missing_ok=True)
    if created_dest:
        shutil.rmtree(dest, ignore_errors=True)


def _prepare_dest(dest: Path) -> bool:
    """Create ``dest`` if missing; returns whether it was created (so a failure can remove it)."""
    dest = Path(dest)
    if dest.exists():
        if not dest.is_dir():
            raise StoreError(f"fetch destination {dest} is not a directory")
        return False
    dest.mkdir(parents=True)
    return True


class StoreBase:
    """What every store derives from :meth:`stat`."""

    def stat(self, uri: str) -> StoreEntry:
        raise NotImplementedError

    def fingerprint(self, uri: str) -> str:
        return self.stat(uri).fingerprint

    def exists(self, uri: str) -> bool:
        try:
            self.stat(uri)
        except StoreNotFoundError:
            return False
        return True


class LocalDirStore(StoreBase):
    """Adapters as directories under ``root``; nothing outside ``root`` is ever read or written.

    URIs are paths relative to ``root``, absolute paths inside it, or ``file://`` URLs of those.
    Any ``..`` component is refused, and so is anything (including a symlinked file) that
    resolves outside ``root``.
    """

    def __init__(self, root: str | Path) -> None:
        root_path = Path(root).expanduser()
        if not root_path.is_dir():
            raise StoreNotFoundError(
                f"local store root {root_path} does not exist or is not a directory",
                store=f"local dir {root_path}",
            )
        self.root = root_path.resolve()

    def describe(self) -> str:
        return f"local dir {self.root}"

    def uri(self, name: str) -> str:
        return self._dir(name).as_uri()

    # -- resolution ------------------------------------------------------------------------------
    def _refuse(self, uri: str, why: str) -> StorePermissionError:
        return StorePermissionError(
            f"{self.describe()}: refused adapter URI {uri!r}: {why}", store=self.describe(), uri=uri
        )

    def _contained(self, p: Path) -> bool:
        """Strictly inside the root (the root itself is no adapter directory)."""
        return p != self.root and contained(p, (self.root,))

    def _dir(self, uri: str) -> Path:
        """Resolved adapter directory for ``uri``, checked to lie strictly inside the root."""
        uri = os.fspath(uri)
        if uri.startswith("file://"):
            parsed = urlparse(uri)
            if parsed.netloc not in ("", "localhost"):
                raise self._refuse(uri, f"file URL with host {parsed.netloc!r}")
            raw = Path(unquote(parsed.path))
        elif "://" in uri:
            raise self._refuse(uri, "not a local path or file:// URL")
        else:
            raw = Path(uri)
        if not str(raw) or str(raw) == ".":
            raise self._refuse(uri, "empty adapter path")
        if ".." in raw.parts:
            raise self._refuse(uri, "'..' components are not allowed")
        full = (raw if raw.is_absolute() else self.root / raw).resolve()
        if not self._contained(full):
            raise self._refuse(uri, f"resolves to {full}, outside the store root {self.root}")
        return full

    def _file(self, uri: str, d: Path, name: str) -> Path:
        """One adapter file, refused if it is a symlink leading outside the root."""
        p = (d / name).resolve()
        if not self._contained(p):
            raise self._refuse(uri, f"{name} resolves to {p}, outside the store root {self.root}")
        return p

    # -- protocol --------------------------------------------------------------------------------
    def stat(self, uri: str) -> StoreEntry:
        d = self._dir(uri)
        names = choose_adapter_files(local_files(d)) if d.is_dir() else ()
        if len(names) < 2:
            if not d.is_dir():
                what = "no adapter directory"
            elif not names:
                what = f"missing {CONFIG_NAME}"
            else:
                what = f"missing weights ({SAFETENSORS_NAME} or {BIN_NAME})"
            raise StoreNotFoundError(
                f"{self.describe()}: {what} at {uri!r} ({d})", store=self.describe(), uri=uri
            )
        files: dict[str, int] = {}
        parts = []
        for n in names:
            st = self._file(uri, d, n).stat()
            files[n] = st.st_size
            parts.append(f"{n}:{st.st_size}:{st.st_mtime_ns}")
        return StoreEntry(d.as_uri(), files, "|".join(parts))

    def fetch(self, uri: str, dest: Path) -> FetchResult:
        t0 = time.perf_counter()
        entry = self.stat(uri)
        d = self._dir(uri)

        def copy_one(name: str, target: Path) -> int:
            try:
                shutil.copyfile(self._file(uri, d, name), target)
                return target.stat().st_size
            except OSError as e:
                raise StoreError(
                    f"{self.describe()}: cannot copy {uri!r} to {target.parent}: {e}",
                    store=self.describe(),
                    uri=uri,
                ) from e

        nbytes = fetch_files(Path(dest), entry.files, copy_one)
        return FetchResult(
            entry.uri, Path(dest), tuple(entry.files), nbytes, time.perf_counter() - t0,
            entry.fingerprint,
        )  # fmt: skip

    def put_dir(self, src: Path, uri: str) -> None:
        src = Path(src)
        writes, stale = files_to_put(src)
        d = self._dir(uri)
        try:
            d.mkdir(parents=True, exist_ok=True)
            for n in writes:  # each replaced whole: a reader sees the old file or the new one
                tmp = d / f".{n}.{uuid.uuid4().hex}.tmp"
                try:
                    shutil.copyfile(src / n, tmp)
                    os.replace(tmp, d / n)
                finally:
                    tmp.unlink(missing_ok=True)
            for n in stale:
                (d / n).unlink(missing_ok=True)
        except OSError as e:
            raise StoreError(
                f"{self.describe()}: cannot write {uri!r}: {e}", store=self.describe(), uri=uri
            ) from e

    def delete(self, uri: str) -> None:
        d = self._dir(uri)
        for n in ADAPTER_FILES:
            (d / n).unlink(missing_ok=True)
        try:
            d.rmdir()
        except OSError:
            pass  # missing, or holds other files: not ours to remove

    def list(self, prefix: str = "") -> list[str]:
        base = self._dir(prefix) if prefix else self.root
        out = []
        for dirpath, _dirs, files in os.walk(base):  # followlinks=False: stays inside the root
            if CONFIG_NAME in files:
                out.append(Path(dirpath).as_uri())
        return sorted(out)
