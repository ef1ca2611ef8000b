"""Choosing the object-store backend for a URL, once at start-up (:func:`open_store`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from loraplex.cache.s3 import S3Store
from loraplex.cache.store import LocalDirStore, ObjectStore


def open_store(url: str | Path, **options: Any) -> ObjectStore:
    """The store for ``url``: a path or ``file://`` URL → :class:`LocalDirStore`;
    ``s3://bucket[/prefix]`` → :class:`S3Store` (``options`` go to its constructor).

    Anything else raises ``ValueError`` naming the scheme.
    """
    if isinstance(url, Path):
        return LocalDirStore(url, **options)
    parsed = urlparse(url)
    scheme = parsed.scheme.lower()
    if scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"S3 store URL {url!r} has no bucket (expected s3://bucket/prefix)")
        return S3Store(parsed.netloc, parsed.path, **options)
    if scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file URL {url!r} names a host; only local paths are supported")
        return LocalDirStore(Path(unquote(parsed.path)), **options)
    if scheme == "" or (len(scheme) == 1 and os.name == "nt"):  # plain path (or C:\ on Windows)
        return LocalDirStore(Path(url), **options)
    raise ValueError(
        f"unsupported object store scheme {scheme!r} in {url!r} (supported: a path, file://, s3://)"
    )
