"""The L2 disk tier: a content-addressed, crash-safe directory of adapter copies under a budget.

Layout (``root`` is owned by one process at a time, enforced with a lock file)::

    root/<sha256>/adapter_config.json
    root/<sha256>/adapter_model.safetensors      (or adapter_model.bin)
    root/<sha256>/.loraplex-entry.json           manifest: digest + file sizes
    root/.tmp-<uuid>/                            a write (or delete) in progress

A write fills ``.tmp-<uuid>/``, fsyncs the files, the manifest and the directory, then
``os.rename``s it to ``<sha256>/``: an entry is either complete or absent. At start-up the index
is rebuilt by scanning: ``.tmp-*`` leftovers of a crash are removed, and entries whose files do
not match their manifest's sizes (the cheap check) are dropped. Full verification happens on use
(:meth:`DiskTier.load_verified`: the entry is read into owned memory and hashed before it is
parsed), which deletes a bad copy. After one full verification the tier remembers, in memory
only, each file's BLAKE3 hash and the tensor layout of those bytes (:class:`KnownFiles`): a
later load of the entry reads each file once into one buffer, hashing it segment by segment as
it lands (the loading thread and one helper thread share the segments), and compares (no digest
re-derivation, no header re-parse); any difference falls back to the full verification.

The budget counts the adapter files' bytes (the manifest and directory metadata are not counted,
nor transient ``.tmp`` staging). ``put`` never exceeds it: it raises :class:`DiskBudgetError` and
the caller — the one policy owner — evicts first. This class decides no evictions; it records
last-access times in memory only, for that owner.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraplex.cache.verify import STAGE_DISK_LOAD, TIER_DISK, check_digest, verified_read
from loraplex.lora.adapter import KnownFiles, read_known_adapter
from loraplex.lora.peft.files import (
    ADAPTER_FILES,
    BIN_NAME,
    CONFIG_NAME,
    SAFETENSORS_NAME,
    choose_adapter_files,
)
from loraplex.types import AdapterCopyError, AdapterError
from loraplex.workers import IdleWorker

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no cross-process lock
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

MANIFEST_NAME = ".loraplex-entry.json"
TMP_PREFIX = ".tmp-"
LOCK_NAME = ".lock"


class DiskTierError(AdapterError):
    """The disk tier cannot do what was asked (I/O error such as a full disk, root in use, ...)."""


class DiskBudgetError(DiskTierError):
    """A put would exceed the tier's byte budget: the caller must evict first."""

    def __init__(self, message: str, *, needed: int, free: int, capacity: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.free = free
        self.capacity = capacity


@dataclass
class ScanReport:
    """What the start-up scan found: entries kept, entries dropped, temp dirs removed."""

    entries: int = 0
    bytes: int = 0
    dropped: list[str] = field(default_factory=list)  # "digest-or-name: why"
    temp_removed: int = 0


@dataclass
class DiskLoadResult:
    """A verified read of one disk entry (the ``disk_load`` stage: read + hash)."""

    digest: str
    config: dict
    tensors: dict[str, torch.Tensor]
    nbytes: int
    seconds: float
    path: Path
    stage: str = STAGE_DISK_LOAD


def _adapter_files(src: Path) -> list[Path]:
    """The files ``put`` copies from ``src``: config + the weights file ``read_adapter_files``
    would read. ``AdapterError`` if either is missing."""
    names = choose_adapter_files(n for n in ADAPTER_FILES if (src / n).is_file())
    if len(names) < 2:
        raise AdapterError(
            f"adapter {src}: not an adapter directory (needs {CONFIG_NAME} and "
            f"{SAFETENSORS_NAME} or {BIN_NAME})"
        )
    return [src / n for n in names]


def _fsync_path(path: Path, *, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


class DiskTier:
    """Content-addressed adapter copies in ``root`` within ``capacity_bytes`` (thread-safe)."""

    def __init__(self, root: str | Path, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"disk tier capacity must be >= 0 bytes, got {capacity_bytes}")
        self.root = Path(root).expanduser()
        self.capacity_bytes = int(capacity_bytes)
        self._lock = threading.Lock()
        self._entries: dict[str, int] = {}  # digest -> bytes
        self._access: dict[str, float] = {}  # digest -> last access (time.time())
        # digest -> file hashes and tensor layout of the bytes this process last verified
        self._known: dict[str, KnownFiles] = {}
        # reads and hashes half of a known entry's segments beside the loading thread
        self._read_helper = IdleWorker("loraplex-disk-read")
        self._reserved = 0  # bytes of puts in progress
        self._lock_fd: int | None = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DiskTierError(f"disk tier {self.root}: cannot create the directory: {e}") from e
        self._acquire_root()
        self.scan_report = self._scan()
        if self.used_bytes > self.capacity_bytes:
            log.warning(
                "disk tier %s holds %d bytes, over its %d-byte budget: evict before new puts",
                self.root,
                self.used_bytes,
                self.capacity_bytes,
            )

    # -- lifecycle ----------------------------------------------------------------------------
    def _acquire_root(self) -> None:
        """One process per root: another one's scan would delete our in-progress writes."""
        if fcntl is None:
            return
        fd = os.open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            raise DiskTierError(
                f"disk tier {self.root} is in use by another DiskTier (this or another process); "
                "give each server its own --disk-cache directory"
            ) from e
        self._lock_fd = fd

    def close(self) -> None:
        """Release the root (the files stay: a later DiskTier on the same root finds them)."""
        fd = getattr(self, "_lock_fd", None)
        if fd is not None:
            os.close(fd)
            self._lock_fd = None

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def _scan(self) -> ScanReport:
        """Rebuild the index from disk; drop crash leftovers and entries failing the size check."""
        report = ScanReport()
        for child in sorted(self.root.iterdir()):
            if child.name.startswith(TMP_PREFIX):
                _rmtree(child)
                report.temp_removed += 1
                continue
            try:
                check_digest(child.name)
            except ValueError:
                if child.name != LOCK_NAME:
                    log.warning("disk tier %s: ignoring unknown entry %s", self.root, child.name)
                continue
            why = self._check_entry(child)
            if why is not None:
                log.warning("disk tier %s: dropping entry %s: %s", self.root, child.name, why)
                report.dropped.append(f"{child.name}: {why}")
                self._discard(child)
                continue
            nbytes = sum(self._manifest(child)["files"].values())
            self._entries[child.name] = nbytes
            try:
                self._access[child.name] = child.stat().st_mtime
            except OSError:
                self._access[child.name] = 0.0
            report.entries += 1
            report.bytes += nbytes
        return report

    @staticmethod
    def _manifest(entry: Path) -> dict:
        return json.loads((entry / MANIFEST_NAME).read_text())

    def _check_entry(self, entry: Path) -> str | None:
        """Why ``entry`` is not a complete entry (None if it is): cheap, sizes only."""
        if entry.is_symlink() or not entry.is_dir():
            return "not a directory"
        try:
            manifest = self._manifest(entry)
        except (OSError, ValueError) as e:
            return f"missing or unreadable manifest ({e})"
        if not isinstance(manifest, dict) or manifest.get("digest") != entry.name:
            return "manifest does not describe this entry"
        files = manifest.get("files")
        if not isinstance(files, dict) or len(files) < 2:
            return "manifest does not list the adapter's files"
        for name, size in files.items():
            if name not in ADAPTER_FILES:
                return f"manifest names an unknown file {name!r}"
            try:
                actual = (entry / name).stat().st_size
            except OSError:
                return f"{name} is missing"
            if actual != size:
                return f"{name} has {actual} bytes, the manifest says {size} (truncated?)"
        return None

    def _discard(self, entry: Path) -> None:
        """Make ``entry`` vanish atomically (rename into a temp name), then delete it."""
        doomed = self.root / f"{TMP_PREFIX}del-{uuid.uuid4().hex}"
        try:
            os.rename(entry, doomed)
        except OSError:
            return  # already gone
        _rmtree(doomed)

    # -- queries ------------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._entries.values())

    @property
    def free_bytes(self) -> int:
        """Bytes a put may still use (budget minus entries minus puts in progress)."""
        with self._lock:
            return max(0, self.capacity_bytes - sum(self._entries.values()) - self._reserved)

    def entries(self) -> dict[str, int]:
        """digest -> bytes of every complete entry (a copy)."""
        with self._lock:
            return dict(self._entries)

    def access_times(self) -> dict[str, float]:
        """digest -> last access (``time.time()``; the entry's mtime after a restart)."""
        with self._lock:
            return dict(self._access)

    def __contains__(self, digest: object) -> bool:
        with self._lock:
            return digest in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def path(self, digest: str) -> Path | None:
        """The entry directory of ``digest`` (recording an access), or None if absent."""
        check_digest(digest)
        p = self.root / digest
        with self._lock:
            if digest not in self._entries:
                return None
            if not p.is_dir():  # removed behind our back
                del self._entries[digest]
                self._access.pop(digest, None)
                return None
            self._access[digest] = time.time()
        return p

    @staticmethod
    def nbytes_of(src_dir: str | Path) -> int:
        """Bytes ``put(digest, src_dir)`` would charge against the budget."""
        return sum(p.stat().st_size for p in _adapter_files(Path(src_dir)))

    # -- writes -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def staging(self) -> Iterator[Path]:
        """A fresh temp directory inside the tier to download into; ``put`` from it moves the
        files instead of copying them. Removed on exit unless ``put`` took it."""
        tmp = self.root / f"{TMP_PREFIX}{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            yield tmp
        finally:
            _rmtree(tmp)

    def _is_staging(self, src: Path) -> bool:
        return src.parent.resolve() == self.root.resolve() and src.name.startswith(TMP_PREFIX)

    def put(self, digest: str, src_dir: str | Path) -> int:
        """Store the adapter in ``src_dir`` as entry ``digest``; returns its bytes.

        The caller has verified that ``src_dir`` holds ``digest``. Already present: a no-op that
        returns the entry's size. Over budget: :class:`DiskBudgetError` (nothing written). I/O
        failure (e.g. ENOSPC): :class:`DiskTierError` and no partial entry left behind.
        """
        check_digest(digest)
        src = Path(src_dir)
        files = _adapter_files(src)
        sizes = {p.name: p.stat().st_size for p in files}
        nbytes = sum(sizes.values())
        with self._lock:
            if digest in self._entries:
                self._access[digest] = time.time()
                return self._entries[digest]
            used = sum(self._entries.values())
            free = self.capacity_bytes - used - self._reserved
            if nbytes > free:
                raise DiskBudgetError(
                    f"disk tier {self.root}: adapter {digest[:12]} needs {nbytes} bytes but only "
                    f"{max(free, 0)} of {self.capacity_bytes} are free "
                    f"({used} used, {self._reserved} being written); evict first",
                    needed=nbytes,
                    free=max(free, 0),
                    capacity=self.capacity_bytes,
                )
            self._reserved += nbytes
        final = self.root / digest
        staged = self._is_staging(src)
        tmp = src if staged else self.root / f"{TMP_PREFIX}{uuid.uuid4().hex}"
        try:
            if staged:  # keep exactly the entry's files
                for extra in tmp.iterdir():
                    if extra.name in sizes:
                        continue
                    if extra.is_dir() and not extra.is_symlink():
                        _rmtree(extra)
                    else:
                        extra.unlink()
            else:
                tmp.mkdir()
                for p in files:
                    shutil.copyfile(p, tmp / p.name)
            for name, size in sizes.items():
                if (tmp / name).stat().st_size != size:
                    raise DiskTierError(
                        f"disk tier {self.root}: {src / name} changed while adapter "
                        f"{digest[:12]} was being stored (nothing was stored)"
                    )
                _fsync_path(tmp / name)
            manifest = {"version": 1, "digest": digest, "files": sizes}
            with open(tmp / MANIFEST_NAME, "w") as f:
                json.dump(manifest, f)
                f.flush()
                os.fsync(f.fileno())
            _fsync_path(tmp, directory=True)
            try:
                os.rename(tmp, final)
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not final.is_dir():
                    raise
                _rmtree(tmp)  # a concurrent put of the same digest won: same content
            _fsync_path(self.root, directory=True)
        except OSError as e:
            _rmtree(tmp)
            with self._lock:
                self._reserved -= nbytes
            raise DiskTierError(
                f"disk tier {self.root}: cannot write adapter {digest[:12]}: "
                f"{e.strerror or e} (nothing was stored)"
            ) from e
        except BaseException:
            _rmtree(tmp)
            with self._lock:
                self._reserved -= nbytes
            raise
        with self._lock:
            self._reserved -= nbytes
            self._entries[digest] = nbytes
            self._access[digest] = time.time()
        return nbytes

    def remove(self, digest: str) -> int:
        """Delete entry ``digest``; returns the bytes freed (0 if it was not there)."""
        check_digest(digest)
        with self._lock:
            nbytes = self._entries.pop(digest, 0)
            self._access.pop(digest, None)
            self._known.pop(digest, None)
        self._discard(self.root / digest)
        return nbytes

    # -- verified reads -----------------------------------------------------------------------
    def load_verified(self, digest: str, name: str, *, allow_pickle: bool = True) -> DiskLoadResult:
        """Read entry ``digest`` once into owned memory and check those bytes hash to ``digest``
        (the ``disk_load`` stage); the tensors are parsed from the bytes that were hashed.

        A corrupt or mismatching entry (or a ``.bin`` one when ``allow_pickle`` is False) is
        deleted, then :class:`AdapterCopyError` (naming the adapter ``name``, the disk tier and
        both digests) is raised. Missing: DiskTierError.
        """
        t0 = time.perf_counter()
        p = self.path(digest)
        if p is None:
            raise DiskTierError(
                f"adapter {name!r} ({digest[:12]}) is not in the disk tier {self.root}"
            )
        with self._lock:
            known = self._known.get(digest)
        fast = None
        if known is not None:
            fast = read_known_adapter(p, known, helper=self._read_helper)
        if fast is not None:  # the very bytes this process verified against the digest
            config, tensors = fast
        else:
            try:
                read = verified_read(
                    p, digest, name=name, tier=TIER_DISK, allow_pickle=allow_pickle
                )
            except AdapterCopyError as e:
                self.remove(digest)
                e.mark_deleted()
                raise
            config, tensors = read.config, read.tensors
            if read.files is not None:
                record = KnownFiles.of(read.files)
                with self._lock:
                    if digest in self._entries:
                        self._known[digest] = record
        with self._lock:
            nbytes = self._entries.get(digest, 0)
        return DiskLoadResult(digest, config, tensors, nbytes, time.perf_counter() - t0, p)
