"""Verification of every adapter copy against its content digest before it is used.

A copy (a download from the object store, an entry of the disk tier) is read with
``read_adapter_files`` and hashed with ``compute_adapter_digest``; the digest must equal the
``AdapterRef.sha256`` it is supposed to be. Otherwise:

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
from loraplex.lora.adapter import compute_adapter_digest, read_adapter_files
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


def verify_adapter_dir(
    path: Path, expected_sha256: str | None, *, name: str, tier: str
) -> tuple[dict, dict[str, torch.Tensor], str]:
    """Read the adapter at ``path`` and return ``(config, tensors, digest)``.

    ``digest`` is ``compute_adapter_digest(config, tensors)``; when ``expected_sha256`` is given
    it must match, else :class:`AdapterIntegrityError`. Unreadable files raise
    :class:`AdapterCorruptError`. Both messages name the adapter and the tier. Deletes nothing.
    """
    if expected_sha256 is not None:
        check_digest(expected_sha256)
    try:
        config, tensors = read_adapter_files(path)
    except AdapterError as e:
        raise AdapterCorruptError(
            f"adapter {name!r}: the {tier} tier copy at {path} is unusable: {e}",
            name=name,
            tier=tier,
            path=str(path),
        ) from e
    digest = compute_adapter_digest(config, tensors)
    if expected_sha256 is not None and digest != expected_sha256:
        raise AdapterIntegrityError(
            f"adapter {name!r}: the {tier} tier copy at {path} has digest {digest[:12]}…, "
            f"expected {expected_sha256[:12]}… (checksum mismatch: corrupted, or changed without "
            "re-registering)",
            name=name,
            tier=tier,
            path=str(path),
            expected=expected_sha256,
            actual=digest,
        )
    return config, tensors, digest


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
) -> VerifiedFetch:
    """Download ``uri`` into ``dest`` and verify it; on any failure ``dest``'s adapter files are
    removed (the directory too if this call created it) and the error propagates.

    ``StoreError`` for transfer problems, :class:`AdapterCopyError` for a bad copy. A digest
    mismatch here means the store holds other bytes than were registered: the store object is
    left alone (it is the source of truth; re-register or fix it), only the download goes.
    """
    dest = Path(dest)
    created = not dest.exists()
    res = store.fetch(uri, dest)
    t0 = time.perf_counter()
    try:
        config, tensors, digest = verify_adapter_dir(dest, expected_sha256, name=name, tier=tier)
    except AdapterCopyError as e:
        for f in res.files:
            (dest / f).unlink(missing_ok=True)
        if created:
            shutil.rmtree(dest, ignore_errors=True)
        e.mark_deleted()
        raise
    return VerifiedFetch(res, config, tensors, digest, time.perf_counter() - t0)
