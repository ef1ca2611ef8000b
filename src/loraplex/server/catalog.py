"""The server's view of the adapter registry: who is calling, which names they may use, and
which revision serves each request.

The registry is the source of truth; :class:`Catalog` keeps an in-memory snapshot of the
servable names (active revision, optional canary) so a request never waits on the database.
The snapshot is rebuilt when the registry's generation counter moves (checked at most every
``poll_s``, and at once after a change made through this server). Callers are
:class:`Principal` s: a tenant key sees its own adapters and the shared ones; operator keys
(``--api-key``, ``--admin-api-key``, tenant-less registry keys) see everything.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from loraplex.registry import (
    BaseModelInfo,
    Manifest,
    Principal,
    Registry,
    RegistryError,
    Tenant,
)

log = logging.getLogger(__name__)

ANONYMOUS = Principal(key_id="anonymous", tenant=None, scopes=frozenset({"inference"}))
"""The caller when the server has no keys at all (vLLM's default: no auth)."""
STATIC_KEY = Principal(key_id="api-key", tenant=None, scopes=frozenset({"inference"}))
"""A ``--api-key`` key: an operator inference key that sees every adapter."""
ADMIN_KEY = Principal(
    key_id="admin-api-key", tenant=None, scopes=frozenset({"inference", "admin:*"})
)
"""The ``--admin-api-key`` key: every admin scope."""


@dataclass(frozen=True)
class Servable:
    """One model name that can take traffic: its active revision and optional canary."""

    name: str
    active: Manifest
    canary: Manifest | None = None
    canary_weight: float = 0.0

    def visible_to(self, principal: Principal) -> bool:
        """Operators see everything; a tenant its own adapters and the shared ones."""
        return principal.tenant is None or self.active.tenant in (None, principal.tenant)

    def choose(self, u: float) -> tuple[Manifest, str]:
        """The revision for a request with uniform draw ``u`` in [0, 1): the canary with
        probability ``canary_weight``, else the active one."""
        if self.canary is not None and u < self.canary_weight:
            return self.canary, "canary"
        return self.active, "active"

    @property
    def digests(self) -> set[str]:
        return {self.active.sha256} | ({self.canary.sha256} if self.canary else set())


@dataclass
class _Snapshot:
    generation: int = -1
    servables: dict[str, Servable] = field(default_factory=dict)
    tenants: dict[str, Tenant] = field(default_factory=dict)
    names_of: dict[str, set[str]] = field(default_factory=dict)  # digest -> names (ever seen)
    has_keys: bool = False  # any live inference/tenant key: inference then needs a key
    has_admin_keys: bool = False  # any live registry key with an admin scope


class Catalog:
    """Servable names, tenants and key lookups from a :class:`Registry`, cached per generation.

    ``on_change(old, new)`` runs after each rebuild with the previous and new servables (the
    server uses it to retire replaced revisions' cached copies and to apply tenant budgets).
    """

    def __init__(
        self,
        registry: Registry,
        base: BaseModelInfo,
        *,
        poll_s: float = 1.0,
        on_change: Callable[[dict[str, Servable], dict[str, Servable], dict[str, Tenant]], None]
        | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        self.base = base
        self.poll_s = poll_s
        self.on_change = on_change
        self._clock = clock
        self._lock = threading.Lock()
        self._snap = _Snapshot()
        self._checked = float("-inf")
        self._keys: dict[str, Principal | None] = {}  # sha256(secret) -> principal, per generation
        self._incompatible_warned: set[str] = set()

    # -- snapshot ------------------------------------------------------------------------------
    def refresh(self, *, force: bool = False) -> None:
        """Rebuild the snapshot if the registry changed (checked at most every ``poll_s``)."""
        now = self._clock()
        with self._lock:
            if not force and now - self._checked < self.poll_s:
                return
            self._checked = now
            gen = self.registry.generation()
            if gen == self._snap.generation and not force:
                return
            old = self._snap
            new = self._build(gen, old)
            self._snap = new
            self._keys.clear()
        if self.on_change is not None:
            self.on_change(old.servables, new.servables, new.tenants)

    def _build(self, gen: int, old: _Snapshot) -> _Snapshot:
        servables: dict[str, Servable] = {}
        names_of = {d: set(n) for d, n in old.names_of.items()}
        for rel in self.registry.visible(tenant=None):
            if rel.active_revision is None:
                continue
            active = self.registry.get(rel.name, rel.active_revision)
            canary = None
            if rel.canary_revision is not None and rel.canary_weight > 0:
                canary = self.registry.get(rel.name, rel.canary_revision)
            s = Servable(rel.name, active, canary, rel.canary_weight if canary else 0.0)
            servables[rel.name] = s
            for d in s.digests:
                names_of.setdefault(d, set()).add(rel.name)
        tenants = {t.name: t for t in self.registry.list_tenants()}
        keys = [k for k in self.registry.list_keys() if not k.get("revoked")]
        has_admin = any(
            str(scope).startswith("admin:") for k in keys for scope in k.get("scopes", ())
        )
        has_inference = any(k.get("tenant") or "inference" in k.get("scopes", ()) for k in keys)
        return _Snapshot(gen, servables, tenants, names_of, has_inference, has_admin)

    @property
    def generation(self) -> int:
        return self._snap.generation

    def servables(self) -> dict[str, Servable]:
        self.refresh()
        return dict(self._snap.servables)

    def lookup(self, name: str, principal: Principal) -> Servable | None:
        """The servable ``name`` as ``principal`` may see it; None if unknown or not theirs
        (so a tenant cannot tell another tenant's names from names that do not exist)."""
        self.refresh()
        s = self._snap.servables.get(name)
        if s is None or not s.visible_to(principal):
            return None
        return s

    def visible(self, principal: Principal) -> list[Servable]:
        self.refresh()
        return [s for s in self._snap.servables.values() if s.visible_to(principal)]

    def has_keys(self) -> bool:
        self.refresh()
        return self._snap.has_keys

    def has_admin_keys(self) -> bool:
        self.refresh()
        return self._snap.has_admin_keys

    def compatible(self, m: Manifest) -> bool:
        """Whether ``m`` was registered for the base model this server serves (by digest)."""
        ok = m.base_model_digest == self.base.digest
        if not ok and m.sha256 not in self._incompatible_warned:
            self._incompatible_warned.add(m.sha256)
            log.warning(
                "adapter %s@%s was registered for base %s (%s...), this server serves %s (%s...)",
                m.name, m.revision, m.base_model_name, m.base_model_digest[:12],
                self.base.name, self.base.digest[:12],
            )  # fmt: skip
        return ok

    def tenant(self, name: str | None) -> Tenant | None:
        if name is None:
            return None
        self.refresh()
        return self._snap.tenants.get(name)

    def names_of(self, digest: str) -> list[str]:
        """Names served (now or earlier) with the adapter ``digest``; current ones first."""
        snap = self._snap
        current = sorted(n for n, s in snap.servables.items() if digest in s.digests)
        return current or sorted(snap.names_of.get(digest, ()))

    # -- keys ----------------------------------------------------------------------------------
    def authenticate(self, secret: str) -> Principal | None:
        """The registry key ``secret`` belongs to, cached until the registry changes (so a
        revoked key stops working within ``poll_s``)."""
        self.refresh()
        h = hashlib.sha256(secret.encode()).hexdigest()
        with self._lock:
            if h in self._keys:
                return self._keys[h]
        try:
            p = self.registry.authenticate(secret)
        except RegistryError:
            p = None
        with self._lock:
            if len(self._keys) > 10_000:  # bounded: a flood of wrong keys cannot grow it
                self._keys.clear()
            self._keys[h] = p
        return p


def local_source(m: Manifest) -> Path | None:
    """The local directory of a manifest's source, or None for an object-store URI."""
    uri = m.source_uri
    if uri.startswith("file://"):
        return Path(uri[len("file://") :])
    if "://" in uri:
        return None
    return Path(uri)


def retired_digests(old: dict[str, Servable], new: dict[str, Servable]) -> set[str]:
    """Digests that served some name before a change and serve none after it."""
    before: set[str] = set()
    for s in old.values():
        before |= s.digests
    after: set[str] = set()
    for s in new.values():
        after |= s.digests
    return before - after


def digests_of(servables: Iterable[Servable]) -> set[str]:
    out: set[str] = set()
    for s in servables:
        out |= s.digests
    return out


def has_scope(p: Principal, scope: str) -> bool:
    """``scope`` held by ``p``; ``"admin:"`` means any admin scope (read-only admin routes)."""
    if scope == "admin:":
        return any(sc.startswith("admin:") for sc in p.scopes)
    return p.allows(scope)


def registration_order(sv: Servable) -> tuple[float, str]:
    """Sort key: adapters are listed in the order they were first registered (vLLM: the flag
    order)."""
    return (sv.active.created_at, sv.name)
