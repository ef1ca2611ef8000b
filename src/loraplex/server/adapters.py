"""The served adapter names: which name maps to which adapter directory, and back.

Inference requests may only name adapters registered here (at start-up with ``--lora-modules``
or through the admin API); a request can never supply a path. Unregistering a name is
drain-safe: requests already admitted hold references on the adapter's weights and finish on
them, new requests for the name get 404.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from loraplex.requests import LoRARequest
from loraplex.types import AdapterError

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


@dataclass
class ServedAdapter:
    name: str
    path: str
    base_model_name: str | None = None
    source: str = "cli"  # cli | admin
    created: int = field(default_factory=lambda: int(time.time()))

    def lora_request(self) -> LoRARequest:
        return LoRARequest(self.name, self.path)


class AdapterDirectory:
    """Thread-safe name ↔ adapter map; digests are learned when an adapter is first loaded."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, ServedAdapter] = {}
        self._digest_of: dict[str, str] = {}  # name -> sha256 (last load)
        self._names_of: dict[str, set[str]] = {}  # sha256 -> names ever served with it

    def add(self, adapter: ServedAdapter, *, replace: bool = False) -> None:
        with self._lock:
            if adapter.name in self._by_name and not replace:
                raise AdapterError(f"the LoRA adapter {adapter.name!r} has already been loaded")
            self._by_name[adapter.name] = adapter
            self._digest_of.pop(adapter.name, None)

    def remove(self, name: str) -> ServedAdapter | None:
        with self._lock:
            self._digest_of.pop(name, None)
            return self._by_name.pop(name, None)

    def get(self, name: str) -> ServedAdapter | None:
        with self._lock:
            return self._by_name.get(name)

    def list(self) -> list[ServedAdapter]:
        with self._lock:
            return list(self._by_name.values())

    def learn(self, name: str, digest: str) -> None:
        """Record that ``name`` resolved to ``digest``."""
        with self._lock:
            if name in self._by_name:
                self._digest_of[name] = digest
            self._names_of.setdefault(digest, set()).add(name)

    def digest_of(self, name: str) -> str | None:
        with self._lock:
            return self._digest_of.get(name)

    def names_of(self, digest: str) -> list[str]:
        """Served names currently mapped to ``digest`` (or every name it was served as, if none
        is registered any more)."""
        with self._lock:
            current = [n for n, d in self._digest_of.items() if d == digest]
            return sorted(current) if current else sorted(self._names_of.get(digest, ()))


def check_allowed_path(path: str, roots: list[str]) -> Path:
    """Resolve ``path`` and check it (and every adapter file in it) lies under an allowed root.

    Symlinks are resolved first, so a link inside a root that points outside is refused."""
    if not roots:
        raise AdapterError(
            "loading adapters at runtime is disabled: no --allowed-lora-roots configured"
        )
    if "\x00" in path:
        raise AdapterError("lora_path contains a NUL byte")
    real_roots = [Path(r).resolve() for r in roots]
    p = Path(os.path.expanduser(path))
    if not p.is_absolute():
        raise AdapterError(f"lora_path {path!r} must be an absolute path")
    resolved = p.resolve()

    def inside(x: Path) -> bool:
        return any(x == r or x.is_relative_to(r) for r in real_roots)

    if not inside(resolved):
        raise AdapterError(
            f"lora_path {path!r} is outside the allowed roots ({', '.join(map(str, real_roots))})"
        )
    if not resolved.is_dir():
        raise AdapterError(f"lora_path {path!r} is not a directory")
    for name in ADAPTER_FILES:
        f = resolved / name
        if f.exists() and not inside(f.resolve()):
            raise AdapterError(f"{name} in {path!r} links outside the allowed roots")
    return resolved
