"""The one transition table of adapter revisions; every status change goes through
:func:`check_transition`.

    uploaded   -> validated | disabled
    validated  -> staged | disabled
    staged     -> active | disabled          (canary traffic while staged)
    active     -> deprecated | disabled      (replaced by a promote | stopped / rolled back)
    deprecated -> active | disabled          (rollback or re-promote | retire)
    disabled   -> staged                     (re-enable; must be promoted again)

Only ``active`` serves traffic, ``staged`` only through an explicit canary.
"""

from __future__ import annotations

from loraplex.registry.db import ADAPTER_STATUSES
from loraplex.registry.errors import TransitionError

TRANSITIONS: dict[str, frozenset[str]] = {
    "uploaded": frozenset({"validated", "disabled"}),
    "validated": frozenset({"staged", "disabled"}),
    "staged": frozenset({"active", "disabled"}),
    "active": frozenset({"deprecated", "disabled"}),
    "deprecated": frozenset({"active", "disabled"}),
    "disabled": frozenset({"staged"}),
}
assert set(TRANSITIONS) == set(ADAPTER_STATUSES)


def allowed(src: str) -> frozenset[str]:
    """Statuses reachable from ``src`` in one move."""
    return TRANSITIONS.get(src, frozenset())


def check_transition(src: str, dst: str, what: str = "revision") -> None:
    """Raise :class:`TransitionError` unless ``src -> dst`` is in the table."""
    if dst not in allowed(src):
        moves = ", ".join(sorted(allowed(src))) or "none"
        raise TransitionError(
            f"{what}: illegal transition {src} -> {dst} (allowed from {src}: {moves})"
        )
