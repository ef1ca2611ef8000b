"""The registry's value types: what callers get back (frozen dataclasses, no database handles).

:class:`Manifest` (one adapter revision), :class:`Release` (a name's active / canary / previous
revision), :class:`Tenant`, :class:`Principal` (who an API key is) and :class:`AuditEntry`, plus
what a manifest signature covers (:data:`SIGNED_FIELDS`, :func:`signed_payload`) and the API key
scopes (:data:`SCOPES`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from loraplex.types import AdapterRef

SCOPES = ("inference", "admin:register", "admin:promote", "admin:pin", "admin:load", "admin:*")


@dataclass(frozen=True)
class Manifest:
    """One adapter revision as registered (``sha256`` is the AdapterRef digest).

    The one list of a manifest's fields: the database row (``RevisionRow``, same column
    names), ``to_dict`` and the audit entries derive from it; :data:`SIGNED_FIELDS` names the
    ones a signature covers. Fields with defaults are set by the registry, not by inspection.
    """

    name: str
    tenant: str | None
    revision: str
    sha256: str
    weights_sha256: str
    config_sha256: str
    base_model_name: str
    base_model_digest: str
    rank: int
    alpha: float
    dtype: str
    target_modules: tuple[str, ...]
    nbytes: int
    source_uri: str
    priority: int = 0
    slo_class: str | None = None
    warm_policy: str = "on-demand"
    status: str = "uploaded"
    created_at: float = 0.0
    activated_at: float | None = None
    rollback_revision: str | None = None
    signature: str | None = None
    signed_by: str | None = None
    path: str = ""  # the local directory that was validated (what the server loads)

    @property
    def ref(self) -> AdapterRef:
        """The adapter's identity for every cache key."""
        return AdapterRef(self.name, self.revision, self.sha256)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["target_modules"] = list(self.target_modules)
        return d

    def signed_payload(self) -> bytes:
        """Canonical JSON of the content fields a signature covers (see :func:`signed_payload`)."""
        return signed_payload(self)


SIGNED_FIELDS = (
    "name",
    "tenant",
    "sha256",
    "weights_sha256",
    "config_sha256",
    "base_model_digest",
    "rank",
    "alpha",
    "dtype",
    "target_modules",
    "nbytes",
)
"""What a manifest signature signs: name, tenant, content digests, base digest and shape facts.
The revision label, source location and serving knobs are not covered (a signer cannot know the
revision the registry will assign, and moving files is not a change)."""

_SIGNED_AS: dict[str, Callable[[Any], Any]] = {
    "rank": int,
    "alpha": float,
    "target_modules": list,
    "nbytes": int,
}


def signed_payload(m: Manifest) -> bytes:
    """The bytes a signature of ``m`` covers: canonical JSON (sorted keys) of
    ``{"v": "loraplex-manifest-v1", <each of SIGNED_FIELDS>}``."""
    doc: dict[str, Any] = {"v": "loraplex-manifest-v1"}
    for f in SIGNED_FIELDS:
        value = getattr(m, f)
        doc[f] = _SIGNED_AS[f](value) if f in _SIGNED_AS else value
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Release:
    """A logical adapter name: the active revision, an optional canary, the previous one."""

    name: str
    active_revision: str | None
    canary_revision: str | None
    canary_weight: float
    previous_revision: str | None
    tenant: str | None = None  # owner; None = shared


@dataclass(frozen=True)
class Tenant:
    name: str
    max_waiting: int | None
    rate_limit_rps: float | None
    host_bytes_budget: int | None
    created_at: float


TENANT_LIMITS = tuple(f.name for f in fields(Tenant) if f.name not in ("name", "created_at"))
"""The limits a tenant carries (``max_waiting``, ``rate_limit_rps``, ``host_bytes_budget``)."""


@dataclass(frozen=True)
class Principal:
    """Who an API key authenticates as."""

    key_id: str
    tenant: str | None
    scopes: frozenset[str] = field(default_factory=frozenset)

    def allows(self, scope: str) -> bool:
        """``admin:*`` covers every ``admin:...`` scope."""
        return scope in self.scopes or (scope.startswith("admin:") and "admin:*" in self.scopes)


@dataclass(frozen=True)
class AuditEntry:
    id: int
    ts: float
    actor: str
    action: str
    target: str
    before: dict | None
    after: dict | None
