"""The registry's value types: what callers get back (frozen dataclasses, no database handles).

:class:`Manifest` (one adapter revision), :class:`Release` (a name's active / canary / previous
revision), :class:`Tenant`, :class:`Principal` (who an API key is) and :class:`AuditEntry`, plus
what a manifest signature covers (:data:`SIGNED_FIELDS`, :func:`signed_payload`) and the API key
scopes (:data:`SCOPES`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from loraplex.registry.errors import RegistryError
from loraplex.types import AdapterRef
from loraplex.warm import WarmSchedule

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
    max_concurrent_requests: int | None = None  # calls in flight at once; None: no limit
    # warm windows (``{"device": "Mon-Fri 08:00-18:00", "tz": ...}``); None: ``warm_policy`` only
    warm_schedule: WarmSchedule | None = None
    # an activated LoRA's invocation sequence, from its config (None: a standard LoRA); the
    # config digest (hence ``sha256`` and a signature) covers it
    alora_invocation_tokens: tuple[int, ...] | None = None

    @property
    def ref(self) -> AdapterRef:
        """The adapter's identity for every cache key."""
        return AdapterRef(self.name, self.revision, self.sha256)

    @property
    def warm(self) -> str | WarmSchedule:
        """The manifest's ``warm``: its window schedule if it has one, else its warm policy."""
        return self.warm_schedule if self.warm_schedule is not None else self.warm_policy

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["target_modules"] = list(self.target_modules)
        d["warm_schedule"] = None if self.warm_schedule is None else self.warm_schedule.to_dict()
        inv = self.alora_invocation_tokens
        d["alora_invocation_tokens"] = None if inv is None else list(inv)
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


MAX_CONCURRENT_REQUESTS = 100_000
"""The largest ``max_concurrent_requests`` a manifest or canary policy may set."""


def check_concurrency(key: str, value: Any) -> int | None:
    """A concurrency limit: None (no limit) or an integer in [1, MAX_CONCURRENT_REQUESTS]."""
    if value is None:
        return None
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or not 1 <= value <= MAX_CONCURRENT_REQUESTS
    ):
        raise RegistryError(
            f"{key} must be an integer in [1, {MAX_CONCURRENT_REQUESTS}] or null, got {value!r}"
        )
    return value


def _number(key: str, value: Any, lo: float, hi: float, *, open_lo: bool = False) -> float | None:
    if value is None:
        return None
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not (lo < value if open_lo else lo <= value)
        or value > hi
    ):
        side = "(" if open_lo else "["
        raise RegistryError(f"{key} must be a number in {side}{lo:g}, {hi:g}], got {value!r}")
    return float(value)


SCORER_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
"""A canary scorer's name: the server's built-in ``json`` (1 when the completion parses as JSON,
else 0) or one a deployment installs (a server without it does not score)."""


@dataclass(frozen=True)
class CanaryPolicy:
    """When a canary revision keeps serving: bounds judged by each replica over the calls of
    the last ``window_s`` seconds once at least ``min_requests`` of them finished there.

    A breach of any bound set (None: not checked) rolls the canary back. ``max_error_rate``:
    share of calls that failed on the server's side; ``max_ttft_p95_s`` / ``max_tpot_p95_s``:
    95th percentile of time to first token / per output token; ``min_quality``: mean score in
    [0, 1] of the calls that were scored (by ``scorer`` or by user feedback), checked once
    ``min_requests`` scores are in the window. ``max_concurrent_requests``: the canary's own
    cap on calls in flight (None: its traffic share of the active revision's limit)."""

    window_s: float = 300.0
    min_requests: int = 20
    max_error_rate: float | None = 0.05
    max_ttft_p95_s: float | None = None
    max_tpot_p95_s: float | None = None
    min_quality: float | None = None
    scorer: str | None = None
    max_concurrent_requests: int | None = None

    def __post_init__(self) -> None:
        _number("window_s", self.window_s, 0.0, 7 * 86400.0, open_lo=True)
        if (
            not isinstance(self.min_requests, int)
            or isinstance(self.min_requests, bool)
            or not 1 <= self.min_requests <= 1_000_000
        ):
            raise RegistryError(
                f"min_requests must be an integer in [1, 1000000], got {self.min_requests!r}"
            )
        _number("max_error_rate", self.max_error_rate, 0.0, 1.0)
        _number("max_ttft_p95_s", self.max_ttft_p95_s, 0.0, 3600.0, open_lo=True)
        _number("max_tpot_p95_s", self.max_tpot_p95_s, 0.0, 3600.0, open_lo=True)
        _number("min_quality", self.min_quality, 0.0, 1.0)
        if self.scorer is not None and (
            not isinstance(self.scorer, str) or not SCORER_RE.fullmatch(self.scorer)
        ):
            raise RegistryError(f"scorer must be a scorer's name (e.g. json), got {self.scorer!r}")
        check_concurrency("max_concurrent_requests", self.max_concurrent_requests)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CanaryPolicy:
        """The policy of ``d`` (unknown keys refused: a typo must not drop a bound)."""
        known = {f.name for f in fields(cls)}
        extra = sorted(set(d) - known)
        if extra:
            raise RegistryError(f"unknown canary policy field(s): {', '.join(extra)}")
        return cls(**dict(d))


@dataclass(frozen=True)
class RollbackEvent:
    """The latest rollback of a release: which revision was stopped, by whom, why, when."""

    revision: str
    actor: str
    reason: str
    at: float


@dataclass(frozen=True)
class Release:
    """A logical adapter name: the active revision, an optional canary, the previous one;
    the canary's health policy and the release's latest rollback."""

    name: str
    active_revision: str | None
    canary_revision: str | None
    canary_weight: float
    previous_revision: str | None
    tenant: str | None = None  # owner; None = shared
    canary_policy: CanaryPolicy | None = None
    last_rollback: RollbackEvent | None = None


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
