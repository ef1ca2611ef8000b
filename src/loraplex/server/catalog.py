"""The server's view of the adapter registry: who is calling, which names they may use, and
which revision serves each request.

The registry is the source of truth; :class:`Catalog` keeps an in-memory snapshot of the
servable names (active revision, optional canary) so a request never waits on the database:
reads only look at the snapshot, which the server's background loop (and every change made
through this server) rebuilds when the registry's generation counter moves (checked at most
every ``poll_s``). Callers are :class:`Principal` s: a tenant key sees its own adapters and the
shared ones; operator keys (``--api-key``, ``--admin-api-key``, tenant-less registry keys) see
everything.

Fail closed: once the registry has held any key or tenant (revoked keys count), the snapshot
says auth is required, and it stays so for the catalog's lifetime. With ``signatures`` requiring
them, a revision whose manifest signature does not verify against the trusted keys is left out
of the snapshot (not served), whoever registered it.
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
    CanaryPolicy,
    Manifest,
    Principal,
    Registry,
    RegistryPolicy,
    RollbackEvent,
    Tenant,
    ValidationError,
)
from loraplex.registry.policy import check_signature
from loraplex.server.canary import CanaryMonitor

log = logging.getLogger(__name__)

ANONYMOUS = Principal(key_id="anonymous", tenant=None, scopes=frozenset({"inference"}))
"""The caller when the server has no keys at all (vLLM's default: no auth)."""
STATIC_KEY = Principal(key_id="api-key", tenant=None, scopes=frozenset({"inference"}))
"""A ``--api-key`` key: an operator inference key that sees every adapter."""
ADMIN_KEY = Principal(
    key_id="admin-api-key", tenant=None, scopes=frozenset({"inference", "admin:*"})
)
"""The ``--admin-api-key`` key: every admin scope."""
METRICS_KEY = Principal(key_id="metrics-api-key", tenant=None, scopes=frozenset({"metrics"}))
"""The ``--metrics-api-key`` key: it may read ``/metrics`` and nothing else."""


@dataclass(frozen=True)
class Servable:
    """One model name that can take traffic: its active revision and optional canary (with its
    health policy), and the release's latest rollback."""

    name: str
    active: Manifest
    canary: Manifest | None = None
    canary_weight: float = 0.0
    canary_policy: CanaryPolicy | None = None
    last_rollback: RollbackEvent | None = None

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
    requires_auth: bool = False  # any key (revoked too) or tenant: every route needs a key
    has_admin_keys: bool = False  # any live registry key with an admin scope


class Catalog:
    """Servable names, tenants and key lookups from a :class:`Registry`, cached per generation.

    ``on_change(old, new)`` runs after each rebuild with the previous and new servables (the
    server uses it to retire replaced revisions' cached copies and to apply tenant budgets).
    ``signatures``: when it requires signatures, only revisions whose manifest signature
    verifies against its trusted keys are served.

    Reads never touch the database (they build the first snapshot if none was built yet);
    :meth:`refresh` and :meth:`authenticate` do, so they run off the event loop.
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
        signatures: RegistryPolicy | None = None,
    ) -> None:
        self.registry = registry
        self.base = base
        self.poll_s = poll_s
        self.on_change = on_change
        self.signatures = signatures
        self._clock = clock
        self._refresh_lock = threading.Lock()  # one rebuild at a time (held across queries)
        self._keys_lock = threading.Lock()  # the key cache only (never held across a query)
        self._snap = _Snapshot()
        self._checked = float("-inf")
        self._keys: dict[str, Principal | None] = {}  # sha256(secret) -> principal
        self._key_epoch = 0  # bumped when the key cache is cleared: older lookups are stale
        self._requires_auth = False  # sticky: once closed, closed for good
        self._incompatible_warned: set[str] = set()
        self._unsigned_warned: set[str] = set()

    # -- snapshot ------------------------------------------------------------------------------
    def refresh(self, *, force: bool = False) -> None:
        """Rebuild the snapshot if the registry changed (checked at most every ``poll_s``)."""
        now = self._clock()
        with self._refresh_lock:
            if not force and now - self._checked < self.poll_s:
                return
            self._checked = now
            gen = self.registry.generation()
            if gen == self._snap.generation and not force:
                return
            old = self._snap
            new = self._build(gen, old)
            self._requires_auth = self._requires_auth or new.requires_auth
            with self._keys_lock:
                self._snap = new
                self._keys.clear()
                self._key_epoch += 1
        if self.on_change is not None:
            self.on_change(old.servables, new.servables, new.tenants)

    def _build(self, gen: int, old: _Snapshot) -> _Snapshot:
        servables: dict[str, Servable] = {}
        names_of = {d: set(n) for d, n in old.names_of.items()}
        for rel in self.registry.visible(tenant=None):
            if rel.active_revision is None:
                continue
            active = self.registry.get(rel.name, rel.active_revision)
            if not self._signed(active):
                continue
            canary = None
            if rel.canary_revision is not None and rel.canary_weight > 0:
                canary = self.registry.get(rel.name, rel.canary_revision)
                canary = canary if self._signed(canary) else None
            s = Servable(
                rel.name,
                active,
                canary,
                rel.canary_weight if canary else 0.0,
                rel.canary_policy if canary else None,
                rel.last_rollback,
            )
            servables[rel.name] = s
            for d in s.digests:
                names_of.setdefault(d, set()).add(rel.name)
        tenants = {t.name: t for t in self.registry.list_tenants()}
        keys = self.registry.list_keys()
        live = [k for k in keys if not k.get("revoked")]
        has_admin = any(
            str(scope).startswith("admin:") for k in live for scope in k.get("scopes", ())
        )
        closed = bool(keys or tenants)
        return _Snapshot(gen, servables, tenants, names_of, closed, has_admin)

    def _signed(self, m: Manifest) -> bool:
        """Whether ``m`` may be served under the signature policy (logged once if not)."""
        policy = self.signatures
        if policy is None or not policy.require_signatures:
            return True
        try:
            check_signature(policy, m.signed_payload(), m.signature)
            return True
        except ValidationError as e:
            if m.sha256 not in self._unsigned_warned:
                self._unsigned_warned.add(m.sha256)
                log.warning("adapter %s@%s is not served: %s", m.name, m.revision, e)
            return False

    def _current(self) -> _Snapshot:
        """The snapshot (built now if none was: a catalog read before any refresh)."""
        if self._snap.generation < 0:
            self.refresh(force=True)
        return self._snap

    @property
    def generation(self) -> int:
        return self._snap.generation

    def servables(self) -> dict[str, Servable]:
        return dict(self._current().servables)

    def lookup(self, name: str, principal: Principal) -> Servable | None:
        """The servable ``name`` as ``principal`` may see it; None if unknown or not theirs
        (so a tenant cannot tell another tenant's names from names that do not exist)."""
        s = self._current().servables.get(name)
        if s is None or not s.visible_to(principal):
            return None
        return s

    def visible(self, principal: Principal) -> list[Servable]:
        return [s for s in self._current().servables.values() if s.visible_to(principal)]

    def requires_auth(self) -> bool:
        """Whether the registry has ever held a key or a tenant (then every route but
        ``/health`` needs a valid key, whatever happened to the keys since)."""
        return self._requires_auth or self._current().requires_auth

    def has_admin_keys(self) -> bool:
        return self._current().has_admin_keys

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
        return self._current().tenants.get(name)

    def names_of(self, digest: str) -> list[str]:
        """Names served (now or earlier) with the adapter ``digest``; current ones first."""
        snap = self._snap
        current = sorted(n for n, s in snap.servables.items() if digest in s.digests)
        return current or sorted(snap.names_of.get(digest, ()))

    # -- keys ----------------------------------------------------------------------------------
    def cached_principal(self, secret: str) -> tuple[bool, Principal | None]:
        """(True, principal) when ``secret``'s lookup is cached, else (False, None); never
        queries the registry (safe on the event loop)."""
        h = hashlib.sha256(secret.encode()).hexdigest()
        with self._keys_lock:
            if h in self._keys:
                return True, self._keys[h]
        return False, None

    def authenticate(self, secret: str) -> Principal | None:
        """The registry key ``secret`` belongs to, cached until the registry changes (so a
        revoked key stops working within ``poll_s``). A lookup that began before the cache was
        last cleared is returned but not cached (it may predate a revocation). A registry
        error (the database is unreachable) is raised, never cached."""
        h = hashlib.sha256(secret.encode()).hexdigest()
        with self._keys_lock:
            if h in self._keys:
                return self._keys[h]
            epoch = self._key_epoch
        p = self.registry.authenticate(secret)
        with self._keys_lock:
            if self._key_epoch == epoch:
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


def release_view(sv: Servable, principal: Principal, health: CanaryMonitor) -> dict[str, object]:
    """What ``/v1/adapters`` shows of a name's release beyond its tiers: the canary's health
    policy and this replica's window of it (from ``health``), and the latest rollback (which
    revision, why, and who: ``system:canary-health`` for an automatic one).

    Nothing about other tenants: the window and rollback reason of a shared adapter (whose
    traffic tenants share) are shown only to operators, and an operator's key id reads
    ``operator`` to tenants."""
    out: dict[str, object] = {}
    operator = principal.tenant is None
    mine = operator or sv.active.tenant == principal.tenant
    if sv.canary is not None:
        policy = sv.canary_policy
        out["canary_policy"] = policy.to_dict() if policy is not None else None
        out["canary_health"] = (
            health.stats(sv.name, sv.canary.revision, policy).to_dict()
            if policy is not None and mine
            else None
        )
    ev = sv.last_rollback
    if ev is None:
        out["last_rollback"] = None
    else:
        system = ev.actor.startswith("system:")
        actor = ev.actor if operator or system else "operator"
        reason = ev.reason if mine else ("canary health" if system else "operator")
        out["last_rollback"] = {
            "revision": ev.revision, "actor": actor, "reason": reason, "at": ev.at,
        }  # fmt: skip
    return out
