"""The adapter registry: manifests per revision, releases (active + canary), tenants, API keys
and the audit log, behind one :class:`Registry` object over SQLite or PostgreSQL.

Every mutating method runs in one transaction that (1) bumps ``generation`` first, which
serialises writers (a row lock on PostgreSQL, ``BEGIN IMMEDIATE`` on SQLite), (2) changes the
state through :mod:`loraplex.registry.lifecycle`, and (3) writes its audit entry. Slow work
(hashing adapter files) happens before the transaction opens.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from loraplex.config import WARM_POLICIES
from loraplex.lora.peft_format import ADAPTER_FILES
from loraplex.paths import contained, first_outside
from loraplex.registry.db import (
    ADAPTER_STATUSES,
    ApiKeyRow,
    AuditRow,
    RegistryState,
    ReleaseRow,
    RevisionRow,
    TenantRow,
    default_url,
    make_engine,
    run_migrations,
)
from loraplex.registry.errors import (
    NotFoundError,
    RegistryError,
    TransitionError,
    ValidationError,
)
from loraplex.registry.inspect import AdapterInfo, BaseModelInfo, inspect_adapter
from loraplex.registry.lifecycle import check_transition
from loraplex.registry.signing import load_public_key
from loraplex.registry.signing import verify as verify_signature
from loraplex.types import AdapterRef

SCOPES = ("inference", "admin:register", "admin:promote", "admin:pin", "admin:load", "admin:*")

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
REVISION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_AUTO_REV_RE = re.compile(r"r(\d+)")


@dataclass(frozen=True)
class RegistryPolicy:
    """What the operator allows: signatures, trusted keys, max rank, adapter sources.

    Empty ``allowed_roots`` refuses every local source unless it is registered with
    ``allow_any_source=True`` (the operator's own ``--lora-modules``); empty
    ``allowed_prefixes`` likewise refuses every object-store source.
    """

    require_signatures: bool = False
    trusted_keys: tuple[str, ...] = ()  # ed25519 public keys: PEM text or base64 raw
    max_rank: int = 64
    allowed_roots: tuple[str, ...] = ()
    allowed_prefixes: tuple[str, ...] = ()  # e.g. "s3://bucket/adapters/"

    def __post_init__(self) -> None:
        if not isinstance(self.max_rank, int) or self.max_rank <= 0:
            raise RegistryError(f"max_rank must be a positive integer, got {self.max_rank!r}")
        for key in self.trusted_keys:
            load_public_key(key)  # a bad key is an error now, not at first use
        if self.require_signatures and not self.trusted_keys:
            raise RegistryError("require_signatures needs at least one trusted key")


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


_TENANT_LIMITS = tuple(f.name for f in fields(Tenant) if f.name not in ("name", "created_at"))
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


# --------------------------------------------------------------------------- row conversion


_MANIFEST_FIELDS = tuple(f.name for f in fields(Manifest))


def _manifest(row: RevisionRow) -> Manifest:
    values = {f: getattr(row, f) for f in _MANIFEST_FIELDS}
    values["target_modules"] = tuple(json.loads(row.target_modules))
    return Manifest(**values)


def _revision_row(m: Manifest) -> RevisionRow:
    values = {f: getattr(m, f) for f in _MANIFEST_FIELDS}
    values["target_modules"] = json.dumps(list(m.target_modules))
    return RevisionRow(**values)


def _release(row: ReleaseRow) -> Release:
    return Release(**{f.name: getattr(row, f.name) for f in fields(Release)})


def _tenant(row: TenantRow) -> Tenant:
    return Tenant(**{f.name: getattr(row, f.name) for f in fields(Tenant)})


def _release_state(row: ReleaseRow) -> dict[str, Any]:
    return {k: v for k, v in asdict(_release(row)).items() if k not in ("name", "tenant")}


# --------------------------------------------------------------------------- argument checks


def _check_name(kind: str, value: Any, pattern: re.Pattern[str]) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value) or ".." in value:
        raise RegistryError(
            f"invalid {kind} {value!r}: use letters, digits and . _ - "
            f"(starting with a letter or digit){', : and /' if kind == 'adapter name' else ''}"
        )
    return value


def _check_limit(key: str, value: Any) -> Any:
    if value is None:
        return None
    if key == "rate_limit_rps":
        if (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or not math.isfinite(value)
            or value <= 0
        ):
            raise RegistryError(f"rate_limit_rps must be a positive number, got {value!r}")
        return float(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RegistryError(f"{key} must be a non-negative integer, got {value!r}")
    return value


def _safe_url(url: str) -> str:
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # an unparsable URL is shown as given (it has no parsable password)
        return url


class Registry:
    """The registry over one database URL; thread-safe (a session per call)."""

    def __init__(self, url: str, policy: RegistryPolicy) -> None:
        """Use :meth:`open`."""
        self.url = url
        self.policy = policy
        try:
            self._engine = make_engine(url)
            run_migrations(self._engine)
        except RegistryError:
            raise
        except (ArgumentError, ValueError) as e:
            raise RegistryError(f"bad registry URL {_safe_url(url)!r}: {e}") from e
        except (SQLAlchemyError, OSError, ImportError) as e:
            reason = getattr(e, "orig", None) or e
            raise RegistryError(
                f"cannot open registry {_safe_url(url)}: {str(reason).strip().splitlines()[0]}"
            ) from e
        self._sessions = sessionmaker(self._engine, expire_on_commit=False)
        dialect = self._engine.dialect.name
        database = self._engine.url.database
        memory = dialect == "sqlite" and database in (None, "", ":memory:")
        # one shared in-memory connection: every session must take turns
        self._all_lock: threading.RLock | None = threading.RLock() if memory else None
        # SQLite allows one writer: queue in-process writers here instead of busy-waiting
        self._write_lock: threading.Lock | None = threading.Lock() if dialect == "sqlite" else None
        # reads run without BEGIN/ROLLBACK round trips (each query sees committed data)
        self._read_options: dict[str, Any] = (
            {"loraplex_read": True} if dialect == "sqlite" else {"isolation_level": "AUTOCOMMIT"}
        )

    @classmethod
    def open(cls, url: str | None = None, *, policy: RegistryPolicy | None = None) -> Registry:
        """Open (and migrate) the registry at ``url`` (default: ``$LORAPLEX_REGISTRY_URL`` or
        ``sqlite:///<LORAPLEX_HOME>/registry.db``; ``sqlite://`` is in-memory)."""
        return cls(url or default_url(), policy or RegistryPolicy())

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Registry({_safe_url(self.url)!r})"

    # ------------------------------------------------------------------ sessions

    @contextmanager
    def _read(self) -> Iterator[Session]:
        """A read-only session (its transaction is rolled back)."""
        lock = self._all_lock or _NULL_LOCK
        try:
            with lock, self._sessions() as s:
                s.connection(execution_options=self._read_options)
                yield s
                s.rollback()
        except SQLAlchemyError as e:
            raise RegistryError(f"registry database error: {getattr(e, 'orig', None) or e}") from e

    @contextmanager
    def _write(self) -> Iterator[Session]:
        """A write transaction that has already bumped the generation (and so holds the
        writer lock of the database); commits on success, rolls back on any error."""
        lock = self._all_lock or self._write_lock or _NULL_LOCK
        try:
            with lock, self._sessions() as s:
                s.connection(execution_options={"loraplex_write": True})
                s.execute(
                    update(RegistryState)
                    .where(RegistryState.id == 1)
                    .values(generation=RegistryState.generation + 1)
                )
                try:
                    yield s
                    s.commit()
                except BaseException:
                    s.rollback()
                    raise
        except SQLAlchemyError as e:
            raise RegistryError(f"registry database error: {getattr(e, 'orig', None) or e}") from e

    @staticmethod
    def _audit(
        s: Session,
        actor: str,
        action: str,
        target: str,
        before: dict | None = None,
        after: dict | None = None,
    ) -> None:
        if not isinstance(actor, str) or not 0 < len(actor) <= 256:
            raise RegistryError("actor must be a non-empty string of at most 256 characters")
        if len(action) > 64 or len(target) > 256:
            raise RegistryError("audit action (64) or target (256 characters) too long")
        s.add(
            AuditRow(
                ts=time.time(),
                actor=actor,
                action=action,
                target=target,
                before=None if before is None else json.dumps(before, sort_keys=True),
                after=None if after is None else json.dumps(after, sort_keys=True),
            )
        )

    def generation(self) -> int:
        """A counter bumped by every mutation: poll it to know when to re-read."""
        with self._read() as s:
            return int(s.execute(select(RegistryState.generation)).scalar_one())

    # ------------------------------------------------------------------ lookups

    @staticmethod
    def _release_row(s: Session, name: str, *, lock: bool = False) -> ReleaseRow:
        q = select(ReleaseRow).where(ReleaseRow.name == name)
        row = s.execute(q.with_for_update() if lock else q).scalar_one_or_none()
        if row is None:
            raise NotFoundError(f"unknown adapter {name!r}")
        return row

    @staticmethod
    def _revision_row(s: Session, name: str, revision: str) -> RevisionRow:
        row = s.execute(
            select(RevisionRow).where(RevisionRow.name == name, RevisionRow.revision == revision)
        ).scalar_one_or_none()
        if row is None:
            raise NotFoundError(f"adapter {name!r} has no revision {revision!r}")
        return row

    def _row_or_active(self, s: Session, rel: ReleaseRow, revision: str | None) -> RevisionRow:
        if revision is None:
            if rel.active_revision is None:
                raise NotFoundError(f"adapter {rel.name!r} has no active revision")
            revision = rel.active_revision
        return self._revision_row(s, rel.name, revision)

    def get(self, name: str, revision: str | None = None) -> Manifest:
        """One revision's manifest (``revision`` None: the active one)."""
        with self._read() as s:
            return _manifest(self._row_or_active(s, self._release_row(s, name), revision))

    def release(self, name: str) -> Release:
        with self._read() as s:
            return _release(self._release_row(s, name))

    def list(
        self, *, tenant: str | None = None, include_shared: bool = True, status: str | None = None
    ) -> list[Manifest]:
        """Manifests by name and registration order; ``tenant`` None lists every tenant's."""
        q = select(RevisionRow)
        if tenant is not None:
            cond = RevisionRow.tenant == tenant
            q = q.where(cond | RevisionRow.tenant.is_(None) if include_shared else cond)
        if status is not None:
            if status not in ADAPTER_STATUSES:
                raise RegistryError(
                    f"unknown status {status!r} (one of {', '.join(ADAPTER_STATUSES)})"
                )
            q = q.where(RevisionRow.status == status)
        with self._read() as s:
            rows = s.execute(q.order_by(RevisionRow.name, RevisionRow.id)).scalars().all()
            return [_manifest(r) for r in rows]

    def visible(self, *, tenant: str | None) -> list[Release]:
        """Releases with an active revision that ``tenant`` may see (its own and shared)."""
        q = select(ReleaseRow).where(ReleaseRow.active_revision.is_not(None))
        if tenant is not None:
            q = q.where((ReleaseRow.tenant == tenant) | ReleaseRow.tenant.is_(None))
        with self._read() as s:
            return [_release(r) for r in s.execute(q.order_by(ReleaseRow.name)).scalars()]

    # ------------------------------------------------------------------ registration

    def _check_source(
        self, path: str | Path, source_uri: str | None, allow_any_source: bool
    ) -> tuple[Path, str]:
        """Resolved local directory and the source URI to record; refuses ``..``, sources
        outside the allowed roots/prefixes and symlinks leading out of a root."""
        raw = str(path)
        if "\x00" in raw or (source_uri is not None and "\x00" in source_uri):
            raise ValidationError("source_not_allowed", "path contains a NUL byte")
        remote = source_uri is not None and "://" in source_uri
        remote = remote and not str(source_uri).startswith("file://")
        if not allow_any_source:
            if ".." in Path(raw).parts:
                raise ValidationError("path_traversal", f"{raw!r}: '..' is not allowed in paths")
            if remote and ".." in str(source_uri).split("://", 1)[1].split("/"):
                raise ValidationError(
                    "path_traversal", f"{source_uri!r}: '..' is not allowed in source URIs"
                )
        resolved = Path(raw).expanduser().resolve()
        if not resolved.is_dir():
            raise ValidationError("unreadable", f"{raw!r} is not a directory")
        if allow_any_source:
            return resolved, source_uri or str(resolved)
        if remote:
            assert source_uri is not None
            prefixes = [p if p.endswith("/") else p + "/" for p in self.policy.allowed_prefixes]
            if not any(source_uri.startswith(p) for p in prefixes):
                allowed = ", ".join(self.policy.allowed_prefixes) or "none configured"
                raise ValidationError(
                    "source_not_allowed",
                    f"{source_uri!r} is not under an allowed prefix ({allowed})",
                )
            return resolved, source_uri
        roots = self.policy.allowed_roots
        if not roots:
            raise ValidationError(
                "source_not_allowed", f"{raw!r}: no allowed adapter roots are configured"
            )
        if not contained(resolved, roots):
            real_roots = ", ".join(str(Path(r).expanduser().resolve()) for r in roots)
            raise ValidationError(
                "source_not_allowed",
                f"{raw!r} (resolved {str(resolved)!r}) is outside the allowed roots ({real_roots})",
            )
        fname = first_outside(resolved, ADAPTER_FILES, roots)
        if fname is not None:
            raise ValidationError(
                "source_not_allowed", f"{fname} in {raw!r} links outside the allowed roots"
            )
        return resolved, source_uri or str(resolved)

    def _check_signature(self, payload: bytes, signature: str | None) -> str | None:
        """The id of the trusted key that signed ``payload``; raises bad_signature / unsigned."""
        if signature is None:
            if self.policy.require_signatures:
                raise ValidationError("unsigned", "this registry requires signed manifests")
            return None
        if not isinstance(signature, str) or not signature.strip():
            raise ValidationError("bad_signature", "empty signature")
        if not self.policy.trusted_keys:
            raise ValidationError("bad_signature", "signature given but no trusted keys configured")
        signer = verify_signature(payload, signature, self.policy.trusted_keys)
        if signer is None:
            raise ValidationError(
                "bad_signature", "the signature does not verify against any trusted key"
            )
        return signer

    def prepare(
        self,
        path: str | Path,
        name: str,
        *,
        base: BaseModelInfo,
        tenant: str | None = None,
        source_uri: str | None = None,
        allow_any_source: bool = False,
    ) -> tuple[Manifest, Path]:
        """Validate an adapter directory (all checks but the signature) and return the manifest
        it would get (``revision`` "", status "uploaded") with its resolved path; records
        nothing. ``manifest.signed_payload()`` is what to sign."""
        _check_name("adapter name", name, NAME_RE)
        if tenant is not None:
            _check_name("tenant name", tenant, TENANT_RE)
        resolved, src = self._check_source(path, source_uri, allow_any_source)
        info: AdapterInfo = inspect_adapter(resolved, base, max_rank=self.policy.max_rank)
        manifest = Manifest(
            name=name,
            tenant=tenant,
            revision="",
            sha256=info.files.digest,
            weights_sha256=info.files.weights_sha256,
            config_sha256=info.files.config_sha256,
            base_model_name=base.name,
            base_model_digest=base.digest,
            rank=info.rank,
            alpha=info.alpha,
            dtype=info.dtype,
            target_modules=info.target_modules,
            nbytes=info.nbytes,
            source_uri=src,
            path=str(resolved),
        )
        return manifest, resolved

    def register(
        self,
        path: str | Path,
        name: str,
        *,
        base: BaseModelInfo,
        revision: str | None = None,
        tenant: str | None = None,
        source_uri: str | None = None,
        priority: int = 0,
        slo_class: str | None = None,
        warm_policy: str = "on-demand",
        signature: str | None = None,
        actor: str,
        allow_any_source: bool = False,
        sha256: str | None = None,
    ) -> Manifest:
        """Validate the adapter in ``path`` and record it as a ``validated`` revision of
        ``name``. ``sha256`` (optional) is the digest the caller expects. Re-registering the
        same content under ``name`` returns the existing revision. A failed validation
        raises ValidationError and records only an audit entry."""
        if revision is not None:
            _check_name("revision", revision, REVISION_RE)
        if warm_policy not in WARM_POLICIES:
            raise RegistryError(
                f"warm_policy must be one of {', '.join(WARM_POLICIES)}, got {warm_policy!r}"
            )
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise RegistryError(f"priority must be an integer, got {priority!r}")
        if slo_class is not None and (
            not isinstance(slo_class, str) or not 0 < len(slo_class) <= 64
        ):
            raise RegistryError(f"slo_class must be a short string, got {slo_class!r}")
        try:
            draft, _ = self.prepare(
                path,
                name,
                base=base,
                tenant=tenant,
                source_uri=source_uri,
                allow_any_source=allow_any_source,
            )
            if sha256 is not None and sha256 != draft.sha256:
                raise ValidationError(
                    "sha256_mismatch", f"expected digest {sha256}, the files have {draft.sha256}"
                )
            signer = self._check_signature(draft.signed_payload(), signature)
        except ValidationError as e:
            with self._write() as s:
                self._audit(
                    s,
                    actor,
                    "register.refused",
                    name if isinstance(name, str) else repr(name),
                    None,
                    {"reason": e.reason, "error": str(e), "path": str(path), "tenant": tenant},
                )
            raise
        now = time.time()
        with self._write() as s:
            if tenant is not None and s.get(TenantRow, tenant) is None:
                raise NotFoundError(f"unknown tenant {tenant!r}")
            rel = s.execute(
                select(ReleaseRow).where(ReleaseRow.name == name).with_for_update()
            ).scalar_one_or_none()
            if rel is None:
                rel = ReleaseRow(name=name, tenant=tenant, canary_weight=0.0, created_at=now)
                rel.updated_at = now
                s.add(rel)
                s.flush()
            elif rel.tenant != tenant:
                owner = "shared" if rel.tenant is None else "owned by another tenant"
                raise RegistryError(f"adapter name {name!r} is already taken ({owner})")
            same = (
                s.execute(
                    select(RevisionRow)
                    .where(RevisionRow.name == name, RevisionRow.sha256 == draft.sha256)
                    .order_by(RevisionRow.id)
                )
                .scalars()
                .first()
            )
            if same is not None:
                if revision is None or revision == same.revision:
                    # idempotent: the same content is already this revision (no audit noise,
                    # but the transaction still bumped the generation harmlessly)
                    return _manifest(same)
                raise RegistryError(
                    f"adapter {name!r}: this content is already registered as revision "
                    f"{same.revision!r}"
                )
            if revision is None:
                revs = s.execute(select(RevisionRow.revision).where(RevisionRow.name == name))
                nums = [int(m[1]) for (r,) in revs if (m := _AUTO_REV_RE.fullmatch(r))]
                revision = f"r{max(nums, default=0) + 1}"
            elif s.execute(
                select(RevisionRow.id).where(
                    RevisionRow.name == name, RevisionRow.revision == revision
                )
            ).first():
                raise RegistryError(
                    f"adapter {name!r} already has a revision {revision!r} with other content"
                )
            check_transition("uploaded", "validated", f"{name}@{revision}")
            row = _revision_row(
                replace(
                    draft,
                    revision=revision,
                    priority=priority,
                    slo_class=slo_class,
                    warm_policy=warm_policy,
                    status="validated",
                    created_at=now,
                    signature=signature,
                    signed_by=signer,
                )
            )
            s.add(row)
            rel.updated_at = now
            s.flush()
            manifest = _manifest(row)
            self._audit(s, actor, "register", f"{name}@{revision}", None, manifest.to_dict())
            return manifest

    def validate(self, name: str, revision: str, *, base: BaseModelInfo, actor: str) -> Manifest:
        """Re-check a revision's files now against its manifest and ``base``: base digest,
        shapes, digests and file hashes, signature. ``uploaded`` becomes ``validated``; a
        failure is audited and raised (the status is left for the operator to decide)."""
        m = self.get(name, revision)
        target = f"{name}@{revision}"
        try:
            if base.digest != m.base_model_digest:
                raise ValidationError(
                    "base_model_mismatch",
                    f"{target} was registered for base {m.base_model_name} "
                    f"({m.base_model_digest[:12]}), this base {base.name} is {base.digest[:12]}",
                )
            now_path = Path(m.path).resolve()
            if str(now_path) != m.path:
                raise ValidationError(
                    "source_not_allowed",
                    f"{m.path!r} now resolves to {str(now_path)!r} (a link was swapped in)",
                )
            info = inspect_adapter(now_path, base, max_rank=self.policy.max_rank)
            got = (info.files.digest, info.files.weights_sha256, info.files.config_sha256)
            if got != (m.sha256, m.weights_sha256, m.config_sha256):
                raise ValidationError(
                    "sha256_mismatch",
                    f"{target}: the files in {m.path} no longer match the manifest "
                    f"(digest {info.files.digest[:12]} != {m.sha256[:12]})",
                )
            self._check_signature(m.signed_payload(), m.signature)
        except ValidationError as e:
            with self._write() as s:
                self._audit(
                    s, actor, "validate.failed", target, None, {"reason": e.reason, "error": str(e)}
                )
            raise
        with self._write() as s:
            row = self._revision_row(s, name, revision)
            before = _manifest(row)
            if row.status == "uploaded":
                check_transition(row.status, "validated", target)
                row.status = "validated"
            s.flush()
            after = _manifest(row)
            checked = {
                "sha256": m.sha256,
                "base_model_digest": base.digest,
                "signed_by": m.signed_by,
            }
            self._audit(
                s, actor, "validate", target, {"status": before.status},
                {"status": after.status, "verified": checked},
            )  # fmt: skip
            return after

    # ------------------------------------------------------------------ lifecycle

    def stage(self, name: str, revision: str, *, actor: str) -> Manifest:
        """validated (or disabled, to re-enable) -> staged."""
        with self._write() as s:
            self._release_row(s, name, lock=True)
            row = self._revision_row(s, name, revision)
            before = row.status
            check_transition(before, "staged", f"{name}@{revision}")
            row.status = "staged"
            s.flush()
            self._audit(
                s, actor, "stage", f"{name}@{revision}", {"status": before}, {"status": "staged"}
            )
            return _manifest(row)

    def promote(self, name: str, revision: str | None = None, *, actor: str) -> Release:
        """Make ``revision`` (default: the canary) the active one. The old active revision
        becomes ``deprecated`` and is remembered as previous / the new one's rollback target;
        the canary is cleared."""
        return self._promote(name, revision, actor=actor, reenable=False)

    def activate(self, name: str, revision: str, *, actor: str) -> Release:
        """Make ``revision`` active from any status, walking the table in one transaction
        (disabled -> staged -> active re-enables it); a no-op when it is already active.
        For "load this adapter now" callers (vLLM's load after unload of the same files)."""
        return self._promote(name, revision, actor=actor, reenable=True)

    def _promote(self, name: str, revision: str | None, *, actor: str, reenable: bool) -> Release:
        with self._write() as s:
            rel = self._release_row(s, name, lock=True)
            before = _release_state(rel)
            if revision is None:
                if rel.canary_revision is None:
                    raise TransitionError(
                        f"adapter {name!r} has no canary to promote; name a revision"
                    )
                revision = rel.canary_revision
            row = self._revision_row(s, name, revision)
            target = f"{name}@{revision}"
            if reenable and row.status == "active":
                return _release(rel)
            if row.status == "validated" or (reenable and row.status == "disabled"):
                check_transition(row.status, "staged", target)  # ... -> staged -> active
                row.status = "staged"
            check_transition(row.status, "active", target)
            old_rev = rel.active_revision
            if old_rev is not None:
                old = self._revision_row(s, name, old_rev)
                check_transition(old.status, "deprecated", f"{name}@{old_rev}")
                old.status = "deprecated"
                s.flush()  # the one-active index must never see two
            now = time.time()
            row.status = "active"
            row.activated_at = now
            row.rollback_revision = old_rev
            rel.active_revision = revision
            rel.previous_revision = old_rev
            rel.canary_revision = None
            rel.canary_weight = 0.0
            rel.updated_at = now
            s.flush()
            self._audit(s, actor, "promote", name, before, _release_state(rel))
            return _release(rel)

    def canary(self, name: str, revision: str, weight: float, *, actor: str) -> Release:
        """Send a ``weight`` share of ``name``'s traffic to the staged ``revision``."""
        if (
            not isinstance(weight, (int, float))
            or isinstance(weight, bool)
            or not math.isfinite(weight)
            or not 0.0 <= weight <= 1.0
        ):
            raise RegistryError(f"canary weight must be a number in [0, 1], got {weight!r}")
        with self._write() as s:
            rel = self._release_row(s, name, lock=True)
            before = _release_state(rel)
            if rel.active_revision is None:
                raise TransitionError(
                    f"adapter {name!r} has no active revision to split traffic with; promote first"
                )
            if revision == rel.active_revision:
                raise TransitionError(f"{name}@{revision} is the active revision, not a canary")
            row = self._revision_row(s, name, revision)
            target = f"{name}@{revision}"
            if row.status == "validated":
                check_transition("validated", "staged", target)
                row.status = "staged"
            if row.status != "staged":
                raise TransitionError(
                    f"{target}: a canary must be staged (or validated), it is {row.status}"
                )
            rel.canary_revision = revision
            rel.canary_weight = float(weight)
            rel.updated_at = time.time()
            s.flush()
            self._audit(s, actor, "canary", name, before, _release_state(rel))
            return _release(rel)

    def rollback(self, name: str, *, actor: str) -> Release:
        """While a canary runs: stop it (the canary revision is disabled, the active one keeps
        all traffic). Otherwise disable the active revision and re-activate the previous one at
        once. The new previous is the restored revision's own rollback target."""
        with self._write() as s:
            rel = self._release_row(s, name, lock=True)
            before = _release_state(rel)
            if rel.canary_revision is not None:
                canary = self._revision_row(s, name, rel.canary_revision)
                check_transition(canary.status, "disabled", f"{name}@{canary.revision}")
                canary.status = "disabled"
                rel.canary_revision, rel.canary_weight = None, 0.0
                rel.updated_at = time.time()
                s.flush()
                self._audit(s, actor, "rollback", name, before, _release_state(rel))
                return _release(rel)
            if rel.active_revision is None:
                raise TransitionError(f"adapter {name!r} has no active revision to roll back")
            if rel.previous_revision is None:
                raise TransitionError(f"adapter {name!r} has no previous revision to roll back to")
            cur = self._revision_row(s, name, rel.active_revision)
            prev = self._revision_row(s, name, rel.previous_revision)
            check_transition(cur.status, "disabled", f"{name}@{cur.revision}")
            check_transition(prev.status, "active", f"{name}@{prev.revision}")
            cur.status = "disabled"
            s.flush()
            now = time.time()
            prev.status = "active"
            prev.activated_at = now
            back = prev.rollback_revision
            if back is not None:
                back_row = s.execute(
                    select(RevisionRow).where(
                        RevisionRow.name == name, RevisionRow.revision == back
                    )
                ).scalar_one_or_none()
                if back_row is None or back_row.status != "deprecated":
                    back = None
            rel.active_revision = prev.revision
            rel.previous_revision = back
            rel.canary_revision = None
            rel.canary_weight = 0.0
            rel.updated_at = now
            s.flush()
            self._audit(s, actor, "rollback", name, before, _release_state(rel))
            return _release(rel)

    def disable(self, name: str, revision: str | None = None, *, actor: str) -> Manifest:
        """Stop a revision (default: the active one) from serving; ``stage`` re-enables it."""
        with self._write() as s:
            rel = self._release_row(s, name, lock=True)
            row = self._row_or_active(s, rel, revision)
            target = f"{name}@{row.revision}"
            before = {"status": row.status, **_release_state(rel)}
            check_transition(row.status, "disabled", target)
            row.status = "disabled"
            if rel.active_revision == row.revision:
                rel.active_revision = None
            if rel.canary_revision == row.revision:
                rel.canary_revision, rel.canary_weight = None, 0.0
            if rel.previous_revision == row.revision:
                rel.previous_revision = None
            rel.updated_at = time.time()
            s.flush()
            self._audit(
                s, actor, "disable", target, before, {"status": "disabled", **_release_state(rel)}
            )
            return _manifest(row)

    # ------------------------------------------------------------------ tenants and keys

    def create_tenant(
        self,
        name: str,
        *,
        max_waiting: int | None = None,
        rate_limit_rps: float | None = None,
        host_bytes_budget: int | None = None,
        actor: str,
    ) -> Tenant:
        _check_name("tenant name", name, TENANT_RE)
        limits = {
            "max_waiting": _check_limit("max_waiting", max_waiting),
            "rate_limit_rps": _check_limit("rate_limit_rps", rate_limit_rps),
            "host_bytes_budget": _check_limit("host_bytes_budget", host_bytes_budget),
        }
        with self._write() as s:
            if s.get(TenantRow, name) is not None:
                raise RegistryError(f"tenant {name!r} already exists")
            row = TenantRow(name=name, created_at=time.time(), **limits)
            s.add(row)
            s.flush()
            tenant = _tenant(row)
            self._audit(s, actor, "tenant.create", f"tenant:{name}", None, asdict(tenant))
            return tenant

    def update_tenant(self, name: str, *, actor: str, **limits: Any) -> Tenant:
        """Change limits (``max_waiting``, ``rate_limit_rps``, ``host_bytes_budget``; None clears)."""
        unknown = set(limits) - set(_TENANT_LIMITS)
        if unknown:
            raise RegistryError(
                f"unknown tenant limit(s) {sorted(unknown)} (one of {', '.join(_TENANT_LIMITS)})"
            )
        checked = {k: _check_limit(k, v) for k, v in limits.items()}
        with self._write() as s:
            row = s.get(TenantRow, name)
            if row is None:
                raise NotFoundError(f"unknown tenant {name!r}")
            before = asdict(_tenant(row))
            for k, v in checked.items():
                setattr(row, k, v)
            s.flush()
            tenant = _tenant(row)
            self._audit(s, actor, "tenant.update", f"tenant:{name}", before, asdict(tenant))
            return tenant

    def get_tenant(self, name: str) -> Tenant:
        with self._read() as s:
            row = s.get(TenantRow, name)
            if row is None:
                raise NotFoundError(f"unknown tenant {name!r}")
            return _tenant(row)

    def list_tenants(self) -> list[Tenant]:
        with self._read() as s:
            return [
                _tenant(r) for r in s.execute(select(TenantRow).order_by(TenantRow.name)).scalars()
            ]

    def create_key(
        self,
        tenant: str | None,
        *,
        scopes: tuple[str, ...] | list[str] = ("inference",),
        actor: str,
        label: str | None = None,
    ) -> tuple[str, str]:
        """A new API key as ``(key_id, secret)``; the secret is shown only now (the registry
        keeps its sha256). Tenant keys may only hold ``inference``; admin keys have no tenant."""
        scope_set = frozenset(scopes)
        if not scope_set:
            raise RegistryError("a key needs at least one scope")
        bad = sorted(scope_set - set(SCOPES))
        if bad:
            raise RegistryError(f"unknown scope(s) {bad} (one of {', '.join(SCOPES)})")
        if tenant is not None and scope_set != {"inference"}:
            raise RegistryError(
                "tenant keys may only hold the 'inference' scope; admin keys have no tenant"
            )
        if label is not None and (not isinstance(label, str) or len(label) > 256):
            raise RegistryError("label must be a string of at most 256 characters")
        secret = "lpx-" + secrets.token_urlsafe(32)
        key_id = "key_" + secrets.token_hex(6)
        with self._write() as s:
            if tenant is not None and s.get(TenantRow, tenant) is None:
                raise NotFoundError(f"unknown tenant {tenant!r}")
            s.add(
                ApiKeyRow(
                    key_id=key_id,
                    tenant=tenant,
                    secret_sha256=hashlib.sha256(secret.encode()).hexdigest(),
                    scopes=json.dumps(sorted(scope_set)),
                    label=label,
                    created_at=time.time(),
                    created_by=actor,
                    revoked_at=None,
                )
            )
            after = {
                "key_id": key_id,
                "tenant": tenant,
                "scopes": sorted(scope_set),
                "label": label,
            }
            self._audit(s, actor, "key.create", f"key:{key_id}", None, after)
        return key_id, secret

    @staticmethod
    def _key_dict(row: ApiKeyRow) -> dict[str, Any]:
        return {
            "key_id": row.key_id,
            "tenant": row.tenant,
            "scopes": json.loads(row.scopes),
            "label": row.label,
            "created_at": row.created_at,
            "created_by": row.created_by,
            "revoked": row.revoked_at is not None,
            "revoked_at": row.revoked_at,
        }

    def list_keys(self, tenant: str | None = None) -> list[dict]:
        """Keys (never their secret or hash); ``tenant`` None lists all."""
        q = select(ApiKeyRow).order_by(ApiKeyRow.created_at, ApiKeyRow.key_id)
        if tenant is not None:
            q = q.where(ApiKeyRow.tenant == tenant)
        with self._read() as s:
            return [self._key_dict(r) for r in s.execute(q).scalars()]

    def revoke_key(self, key_id: str, *, actor: str) -> None:
        with self._write() as s:
            row = s.get(ApiKeyRow, key_id)
            if row is None:
                raise NotFoundError(f"unknown key {key_id!r}")
            if row.revoked_at is not None:
                raise RegistryError(f"key {key_id!r} is already revoked")
            before = self._key_dict(row)
            row.revoked_at = time.time()
            s.flush()
            self._audit(s, actor, "key.revoke", f"key:{key_id}", before, self._key_dict(row))

    def authenticate(self, secret: str) -> Principal | None:
        """The principal of a live key with this secret, else None."""
        if not isinstance(secret, str) or not secret.startswith("lpx-") or len(secret) > 256:
            return None
        digest = hashlib.sha256(secret.encode()).hexdigest()
        with self._read() as s:
            row = s.execute(
                select(ApiKeyRow).where(ApiKeyRow.secret_sha256 == digest)
            ).scalar_one_or_none()
            if row is None or row.revoked_at is not None:
                return None
            if not hmac.compare_digest(row.secret_sha256, digest):
                return None
            return Principal(row.key_id, row.tenant, frozenset(json.loads(row.scopes)))

    def has_keys(self) -> bool:
        """Whether any non-revoked key exists (a server with none may run open)."""
        with self._read() as s:
            q = select(func.count()).select_from(ApiKeyRow).where(ApiKeyRow.revoked_at.is_(None))
            return bool(s.execute(q).scalar_one())

    # ------------------------------------------------------------------ audit

    def audit(
        self,
        actor: str,
        action: str,
        target: str,
        before: dict | None = None,
        after: dict | None = None,
    ) -> None:
        """Record an admin action done outside the registry (pin, load, ...)."""
        if not isinstance(action, str) or not action or not isinstance(target, str):
            raise RegistryError("audit needs an action and a target")
        with self._write() as s:
            self._audit(s, actor, action, target, before, after)

    def audit_log(self, *, limit: int = 100, target: str | None = None) -> list[AuditEntry]:
        """Newest first; ``target`` matches the name itself and its ``name@revision`` entries."""
        if not isinstance(limit, int) or limit <= 0:
            raise RegistryError(f"limit must be a positive integer, got {limit!r}")
        q = select(AuditRow)
        if target is not None:
            q = q.where(
                (AuditRow.target == target)
                | AuditRow.target.startswith(target + "@", autoescape=True)
            )
        with self._read() as s:
            rows = s.execute(q.order_by(AuditRow.id.desc()).limit(limit)).scalars().all()
            return [
                AuditEntry(
                    r.id,
                    r.ts,
                    r.actor,
                    r.action,
                    r.target,
                    None if r.before is None else json.loads(r.before),
                    None if r.after is None else json.loads(r.after),
                )
                for r in rows
            ]


class _NullLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NULL_LOCK = _NullLock()
