"""The engine's local catalog: an offline ``LoRARequest(name, path)`` becomes an AdapterSpec.

The cache keys everything by content digest, so a request naming a directory needs the digest
of the files in it. It is computed once per version of the files and memoised by (resolved
path, fingerprint), the fingerprint being ``(name, size, mtime_ns)`` of the adapter files: a
repeated request does not re-hash, a rewritten directory does (and gets a new digest, so it
can never be served old weights or old KV).

Safetensors directories are hashed without loading tensors
(:func:`loraplex.lora.digest.digest_safetensors_dir`); ``.bin`` ones need torch
(:func:`loraplex.lora.adapter.read_adapter`). Only a directory (or store object) whose weights
are a ``.bin`` alone gets a spec that allows reading a pickle (``AdapterSpec.allow_pickle``): if
a safetensors directory later loses its safetensors file and gains a ``.bin``, its new
fingerprint makes a new spec, and a spec made for safetensors never reads the ``.bin``. Object-store URIs (``s3://...``) are
memoised by the store's change fingerprint, checked at most every ``fingerprint_ttl_s`` (one
check per URI at a time); the first request of a version downloads it once to hash it. While
the store is unreachable, a URI whose digest is known keeps that digest (its copy in memory or
on disk keeps being served).
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from pathlib import Path

from loraplex.cache.store import ObjectStore
from loraplex.cache.verify import fetch_verified
from loraplex.lora.adapter import read_adapter
from loraplex.lora.digest import DigestError, digest_safetensors_dir
from loraplex.lora.peft.files import ADAPTER_FILES, SAFETENSORS_NAME
from loraplex.requests import LoRARequest
from loraplex.types import AdapterError, AdapterRef, AdapterSpec, StoreUnavailableError

log = logging.getLogger(__name__)

__all__ = ["LocalAdapterCatalog"]


def files_fingerprint(path: Path) -> tuple[tuple[str, int, int], ...]:
    """(name, size, mtime_ns) of the files that define an adapter — changes when rewritten."""
    out = []
    for name in ADAPTER_FILES:
        p = path / name
        if p.is_file():
            st = p.stat()
            out.append((name, st.st_size, st.st_mtime_ns))
    return tuple(out)


def digest_dir(path: Path, name: str) -> tuple[str, bool]:
    """The adapter digest of a local directory, and whether its weights are a ``.bin`` (a
    pickle) alone (AdapterError when it cannot be read)."""
    if (path / SAFETENSORS_NAME).is_file():
        try:
            return digest_safetensors_dir(path), False
        except DigestError as e:
            raise AdapterError(f"adapter {name!r}: {e}") from e
    return read_adapter(path).digest, True  # .bin: needs torch


class LocalAdapterCatalog:
    """``LoRARequest`` -> :class:`AdapterSpec` for offline requests; see the module docstring.

    Thread-safe (servers' worker threads and ``LLM.generate`` may call it concurrently).
    """

    def __init__(self, store: ObjectStore | None = None, *, fingerprint_ttl_s: float = 2.0) -> None:
        self.store = store
        self.fingerprint_ttl_s = float(fingerprint_ttl_s)
        self.hashes = 0  # directories hashed (each memo miss)
        self._lock = threading.Lock()
        # path or URI -> (fingerprint, (digest, weights are a .bin alone))
        self._memo: dict[str, tuple[object, tuple[str, bool]]] = {}
        self._fp_cache: dict[str, tuple[str, float]] = {}  # URI -> (store fingerprint, when)
        self._key_locks: dict[str, threading.Lock] = {}

    def spec(self, req: LoRARequest) -> AdapterSpec:
        """The spec of ``req``: its digest (memoised), ``revision`` or the digest's first 12
        hex digits, and its path as the source."""
        raw = req.path
        scheme = raw.split("://", 1)[0].lower() if "://" in raw else ""
        if scheme and scheme != "file":
            digest, pickle = self._store_digest(req)
        else:
            path = Path(raw[len("file://") :] if scheme else raw).expanduser()
            if not path.is_dir():
                raise AdapterError(f"adapter {req.name!r}: path {raw!r} is not a directory")
            digest, pickle = self._dir_digest(req.name, path)
        revision = req.revision if req.revision is not None else digest[:12]
        return AdapterSpec(AdapterRef(req.name, revision, digest), raw, allow_pickle=pickle)

    def _key_lock(self, key: str) -> threading.Lock:
        with self._lock:
            return self._key_locks.setdefault(key, threading.Lock())

    def _dir_digest(self, name: str, path: Path) -> tuple[str, bool]:
        key = str(path.resolve())
        fp = files_fingerprint(path)
        with self._key_lock(key):  # concurrent requests for one directory hash it once
            known = self._memo.get(key)
            if known is not None and known[0] == fp:
                return known[1]
            got = digest_dir(path, name)
            with self._lock:
                self.hashes += 1
                self._memo[key] = (fp, got)
            return got

    def _store_digest(self, req: LoRARequest) -> tuple[str, bool]:
        if self.store is None:
            raise AdapterError(
                f"adapter {req.name!r}: {req.path!r} is an object-store URI but no object store "
                "is configured (--adapter-store-url)"
            )
        uri = self.store.uri(req.path)
        with self._key_lock(uri):  # one store round-trip per URI at a time
            known = self._memo.get(uri)
            cached = self._fp_cache.get(uri)
            now = time.monotonic()
            if cached is not None and now - cached[1] < self.fingerprint_ttl_s:
                fp = cached[0]
            else:
                try:
                    fp = self.store.fingerprint(uri)
                except StoreUnavailableError:
                    if known is None:
                        raise
                    log.warning("object store unavailable; serving the known copy of %s", uri)
                    return known[1]
                self._fp_cache[uri] = (fp, time.monotonic())
            if known is not None and known[0] == fp:
                return known[1]
            with tempfile.TemporaryDirectory(prefix="loraplex-digest-") as tmp:
                vf = fetch_verified(self.store, uri, Path(tmp) / "a", None, name=req.name)
            got = (vf.digest, SAFETENSORS_NAME not in vf.fetch.files)
            with self._lock:
                self.hashes += 1
                self._memo[uri] = (fp, got)
            return got
