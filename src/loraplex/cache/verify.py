"""Verification of every adapter copy against its content digest before it is used.

A copy (a download from the object store, an entry of the disk tier, a local directory) is read
once into memory this process owns (``read_adapter``: the bytes are hashed, then parsed, so the
tensors are exactly what was hashed); the digest must equal the ``AdapterRef.sha256`` it is
supposed to be before anything uses the copy. Otherwise:

    unreadable / truncated files  -> AdapterCorruptError   (names adapter, tier, path, cause)
    digest != expected            -> AdapterIntegrityError (names adapter, tier, both digests)

Both are :class:`AdapterCopyError` (an ``AdapterError``). Whoever owns the copy deletes it:
:func:`fetch_verified` removes a bad download, ``DiskTier.load_verified`` a bad disk entry. A bad
object in the store itself (the source of truth) is reported, never deleted from here.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.cache.store import STAGE_REMOTE_DOWNLOAD, FetchResult, ObjectStore
from loraplex.lora.adapter import AdapterRead, read_adapter
from loraplex.types import (
    AdapterCopyError,
    AdapterCorruptError,
    AdapterError,
    AdapterIntegrityError,
)

STAGE_DISK_LOAD = "disk_load"
TIER_DISK = "disk"
TIER_OBJECT_STORE = "object_store"

__all__ = [
    "STAGE_DISK_LOAD",
    "STAGE_REMOTE_DOWNLOAD",
    "TIER_DISK",
    "TIER_OBJECT_STORE",
    "AdapterCopyError",
    "AdapterCorruptError",
    "AdapterIntegrityError",
    "VerifiedFetch",
    "check_digest",
    "fetch_verified",
    "verified_read",
    "verify_adapter_dir",
]


def check_digest(digest: str) -> str:
    """``digest`` if it is 64 lowercase hex digits (a sha256), else ``ValueError``.

    Digests become directory names and cache keys, so nothing else may pass.
    """
    if (
        not isinstance(digest, str)
        or len(digest) != 64
        or any(c not in "0123456789abcdef" for c in digest)
    ):
        raise ValueError(f"adapter digest must be 64 lowercase hex digits, got {digest!r}")
    return digest


def verified_read(
    path: Path, expected_sha256: str | None, *, name: str, tier: str, allow_pickle: bool = True
) -> AdapterRead:
    """Read the adapter at ``path`` once into owned memory (:func:`read_adapter`) and check the
    digest of those bytes against ``expected_sha256`` (when given) before anything uses them.

    Unreadable, truncated or refused files (a ``.bin`` where ``allow_pickle`` is False) raise
    :class:`AdapterCorruptError`; a digest mismatch :class:`AdapterIntegrityError` (saying so
    when the copy matches the expected digest under the previous digest version). Both name
    the adapter and the tier. Deletes nothing.
    """
    if expected_sha256 is not None:
        check_digest(expected_sha256)
    try:
        read = read_adapter(path, allow_pickle=allow_pickle)
    except AdapterError as e:
        raise AdapterCorruptError(
            f"adapter {name!r}: the {tier} tier copy at {path} is unusable: {e}",
            name=name,
            tier=tier,
            path=str(path),
        ) from e
    digest = read.digest
    if expected_sha256 is not None and digest != expected_sha256:
        raise AdapterIntegrityError(
            f"adapter {name!r}: the {tier} tier copy at {path} has digest {digest[:12]}…, "
            f"expected {expected_sha256[:12]}… ({mismatch_cause(read, expected_sha256)})",
            name=name,
            tier=tier,
            path=str(path),
            expected=expected_sha256,
            actual=digest,
        )
    return read


def mismatch_cause(
    read: AdapterRead,
    expected_sha256: str,
    otherwise: str = "checksum mismatch: corrupted, or changed without re-registering",
) -> str:
    """Why a copy's digest is not the expected one, as far as can be told: the expected digest
    is these bytes' digest under the previous digest version, or ``otherwise``."""
    if read.legacy_digest() == expected_sha256:
        return (
            "the expected digest is the previous digest version's (v1, which ignored the order "
            "of rank_pattern / alpha_pattern): register the revision again"
        )
    return otherwise


def verify_adapter_dir(
    path: Path,
    expected_sha256: str | None,
    *,
    name: str,
    tier: str,
    allow_pickle: bool = True,
) -> tuple[dict, dict[str, torch.Tensor], str]:
    """``(config, tensors, digest)`` of :func:`verified_read` (same checks and errors)."""
    read = verified_read(path, expected_sha256, name=name, tier=tier, allow_pickle=allow_pickle)
    return read.config, read.tensors, read.digest


@dataclass
class VerifiedFetch:
    """A download from an object store that passed verification.

    ``fetch.seconds`` is the ``remote_download`` stage; ``verify_seconds`` the read + hash after.
    """

    fetch: FetchResult
    config: dict
    tensors: dict[str, torch.Tensor]
    digest: str
    verify_seconds: float
    stage: str = STAGE_REMOTE_DOWNLOAD


def fetch_verified(
    store: ObjectStore,
    uri: str,
    dest: Path,
    expected_sha256: str | None,
    *,
    name: str,
    tier: str = TIER_OBJECT_STORE,
    allow_pickle: bool = True,
) -> VerifiedFetch:
    """Download ``uri`` into ``dest`` and verify it (read once into owned memory, hashed, then
    parsed: :func:`verified_read`); on any failure ``dest``'s adapter files are removed (the
    directory too if this call created it) and the error propagates.

    ``StoreError`` for transfer problems, :class:`AdapterCopyError` for a bad copy. A digest
    mismatch here means the store holds other bytes than were registered: the store object is
    left alone (it is the source of truth; re-register or fix it), only the download goes.
    """
    dest = Path(dest)
    created = not dest.exists()
    res = store.fetch(uri, dest)
    t0 = time.perf_counter()
    try:
        read = verified_read(dest, expected_sha256, name=name, tier=tier, allow_pickle=allow_pickle)
    except AdapterCopyError as e:
        for f in res.files:
            (dest / f).unlink(missing_ok=True)
        if created:
            shutil.rmtree(dest, ignore_errors=True)
        e.mark_deleted()
        raise
    return VerifiedFetch(res, read.config, read.tensors, read.digest, time.perf_counter() - t0)
