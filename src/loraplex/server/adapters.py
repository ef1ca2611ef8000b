"""Where runtime-loaded adapters may come from: :func:`check_allowed_path`.

Inference requests only ever name registered adapters (see :mod:`loraplex.server.catalog`);
a request can never supply a path. Admin loads must lie under ``--allowed-lora-roots``.
"""

from __future__ import annotations

import os
from pathlib import Path

from loraplex.types import AdapterError

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


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


def lexically_under(path: Path, roots: list[str]) -> bool:
    """Whether ``path`` (symlinks not resolved) lies under one of ``roots``."""
    p = Path(os.path.abspath(path))
    return any(p == Path(r) or p.is_relative_to(r) for r in roots)
