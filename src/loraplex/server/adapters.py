"""Where runtime-loaded adapters may come from: :func:`check_allowed_path`.

Inference requests only ever name registered adapters (see :mod:`loraplex.server.catalog`);
a request can never supply a path. Admin loads must lie under ``--allowed-lora-roots``.
"""

from __future__ import annotations

import os
from pathlib import Path

from loraplex.lora.peft.files import ADAPTER_FILES
from loraplex.paths import contained, first_outside
from loraplex.types import AdapterError


def check_allowed_path(path: str, roots: list[str]) -> Path:
    """Resolve ``path`` and check it (and every adapter file in it) lies under an allowed root.

    Symlinks are resolved first, so a link inside a root that points outside is refused."""
    if not roots:
        raise AdapterError(
            "loading adapters at runtime is disabled: no --allowed-lora-roots configured"
        )
    if "\x00" in path:
        raise AdapterError("lora_path contains a NUL byte")
    p = Path(os.path.expanduser(path))
    if not p.is_absolute():
        raise AdapterError(f"lora_path {path!r} must be an absolute path")
    resolved = p.resolve()
    if not contained(resolved, roots):
        real_roots = ", ".join(str(Path(r).resolve()) for r in roots)
        raise AdapterError(f"lora_path {path!r} is outside the allowed roots ({real_roots})")
    if not resolved.is_dir():
        raise AdapterError(f"lora_path {path!r} is not a directory")
    name = first_outside(resolved, ADAPTER_FILES, roots)
    if name is not None:
        raise AdapterError(f"{name} in {path!r} links outside the allowed roots")
    return resolved
