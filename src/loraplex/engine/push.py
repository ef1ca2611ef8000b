"""In-process pushes (the offline API): adapters handed to the engine as tensors or bytes, one
active revision per name, and the retirement of the revisions they replace.

A push is read exactly as a directory with the same two files (:func:`read_pushed`: one
digest), validated against the base model, admitted into host memory (and the disk tier when
asked) by :meth:`TieredAdapterCache.push`, and only then becomes its name's active revision,
in one step under a lock: a request resolves its name once, when it is prepared, and keeps
that revision's host copy (and its digest-keyed KV) to its last token. A replaced revision is
unpinned and leaves the device and host tiers when no request holds it any more
(:meth:`PushedAdapters.retire`, called after every engine step); its KV blocks are keyed by
its digest, so no request of another revision can ever hit them, and they are recycled as the
block pool needs room.
"""

from __future__ import annotations

import threading

from loraplex.cache.adapters import PIN_PUSH, TieredAdapterCache
from loraplex.cache.controller import TIER_DEVICE, TIER_HOST
from loraplex.lora.adapter import read_pushed
from loraplex.lora.push import encode_config, encode_tensors
from loraplex.requests import LoRARequest
from loraplex.types import (
    AdapterError,
    AdapterInUseError,
    AdapterRef,
    AdapterSpec,
    pushed_source,
)

__all__ = ["PushedAdapters"]


class PushedAdapters:
    """name -> the spec of its active pushed (or added) revision; see the module docstring.
    Thread-safe."""

    def __init__(self, cache: TieredAdapterCache) -> None:
        self.cache = cache
        self._lock = threading.Lock()
        self._active: dict[str, AdapterSpec] = {}
        self._retiring: set[str] = set()  # digests replaced, still held by requests

    def spec_of(self, name: str) -> AdapterSpec | None:
        with self._lock:
            return self._active.get(name)

    def push_bytes(
        self,
        name: str,
        config_bytes: bytes,
        weights: bytearray,
        *,
        revision: str | None = None,
        persist_disk: bool = False,
    ) -> AdapterSpec:
        """Make ``(config_bytes, weights)`` (an ``adapter_config.json`` and a whole
        ``adapter_model.safetensors``, owned by the engine from now on) the active revision of
        ``name`` (``revision``: its label, default the digest's first 12 hex digits). Bad
        input raises :class:`AdapterError` and changes nothing; a label that already names
        other content under ``name`` is refused too."""
        read = read_pushed(config_bytes, weights, name=name)
        label = revision if revision is not None else read.digest[:12]
        with self._lock:
            prev = self._active.get(name)
        if prev is not None and prev.ref.revision == label and prev.sha256 != read.digest:
            raise AdapterError(
                f"adapter {name!r} already has a revision {label!r} with other content"
            )
        spec = AdapterSpec(AdapterRef(name, label, read.digest), pushed_source(read.digest))
        self.cache.push(spec, read, persist_disk=persist_disk)
        self.activate(spec)
        return spec

    def push_request(self, req: LoRARequest, *, persist_disk: bool = False) -> AdapterSpec:
        """:meth:`push_bytes` of a LoRARequest carrying tensors (encoded as PEFT's files)."""
        assert req.lora_tensors is not None and req.peft_config is not None
        config = encode_config(req.peft_config, name=req.name)
        weights = encode_tensors(req.lora_tensors, name=req.name)
        return self.push_bytes(
            req.name, config, weights, revision=req.revision, persist_disk=persist_disk
        )

    def activate(self, spec: AdapterSpec) -> AdapterSpec | None:
        """Make ``spec`` its name's active revision (one step); the one it replaced, whose
        copies are retired once no request holds them."""
        with self._lock:
            prev = self._active.get(spec.name)
            self._active[spec.name] = spec
            if prev is not None and prev.sha256 != spec.sha256:
                self._retiring.add(prev.sha256)
            self._retiring.discard(spec.sha256)
        self.retire()
        return prev

    def resolve(self, req: LoRARequest) -> AdapterSpec:
        """The spec a LoRARequest without a path is served with: its tensors pushed (the same
        content again is a host-memory hit), or its name's active revision."""
        if req.lora_tensors is not None:
            return self.push_request(req)
        spec = self.spec_of(req.name)
        if spec is None:
            raise AdapterError(
                f"adapter {req.name!r} has no path and was never added (LLMEngine.add_lora)"
            )
        return spec

    def retire(self) -> list[str]:
        """Drop the replaced revisions no request holds any more from the device and host
        tiers (a disk copy stays, evictable); the digests dropped."""
        with self._lock:
            self._retiring -= self._digests()
            todo = list(self._retiring)
        done = []
        for d in todo:
            if self.cache.request_refs.get(d, 0):
                continue
            try:
                self.cache.unpin(d, PIN_PUSH)
                self.cache.evict(d, tiers=(TIER_DEVICE, TIER_HOST))
            except AdapterInUseError:
                continue  # a request took it meanwhile: next time
            with self._lock:
                self._retiring.discard(d)
            done.append(d)
        return done

    @property
    def retiring(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._retiring)

    def _digests(self) -> set[str]:
        return {s.sha256 for s in self._active.values()}
