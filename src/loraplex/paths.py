"""Whether a path lies under allowed roots (loraplex's one containment check), and the cache root.

Layer 1: imports only the config layer's declaration of its environment variable (and no
third-party package), so every layer may use it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path, PurePath

from loraplex.config import ENV_CACHE_DIR, env_value

StrPath = str | os.PathLike[str]


def _normalise(p: StrPath, resolve: bool) -> PurePath:
    expanded = os.path.expanduser(os.fspath(p))
    return PurePath(os.path.realpath(expanded) if resolve else os.path.abspath(expanded))


def contained(path: StrPath, roots: Iterable[StrPath], *, resolve: bool = True) -> bool:
    """Whether ``path`` is one of ``roots`` or lies below one of them.

    ``resolve=True`` (the default; use it for every decision that grants access): ``~`` is
    expanded and symlinks and ``..`` are resolved in ``path`` and in the roots
    (``os.path.realpath``), so a link inside a root that leads outside is outside.

    ``resolve=False`` is the lexical form (``~`` expanded, made absolute, ``..`` folded by
    ``os.path.abspath``, links left alone): it answers where a path was *named*, not where its
    bytes are, so it never grants access on its own. The server's ``resolve_model`` uses it on
    purpose: a registered manifest whose source was named under ``--allowed-lora-roots`` must
    still resolve inside them at request time (its files may since have been swapped for links
    out, which the resolved check then refuses), while one the operator registered from
    elsewhere (``--lora-modules``) is not subject to the roots at all.
    """
    p = _normalise(path, resolve)
    return any(p.is_relative_to(_normalise(r, resolve)) for r in roots)


def first_outside(directory: StrPath, names: Iterable[str], roots: Iterable[StrPath]) -> str | None:
    """The first of ``names`` in ``directory`` that exists (or is a symlink, even a dangling one)
    and resolves outside ``roots``; None when every present one stays inside."""
    root_list = list(roots)
    for name in names:
        p = os.path.join(os.fspath(directory), name)
        if (os.path.exists(p) or os.path.islink(p)) and not contained(p, root_list):
            return name
    return None


def default_cache_dir() -> Path:
    """``$LORAPLEX_CACHE_DIR`` if set, else ``~/.cache/loraplex`` (demo model, built kernels)."""
    env = env_value(ENV_CACHE_DIR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "loraplex"
