"""``loraplex adapters ...`` and ``loraplex tenants ...``: the registry from the command line.

    loraplex adapters register NAME PATH --base-model DIR [--stage | --activate] ...
    loraplex adapters list | show NAME | validate NAME | promote NAME | canary NAME REV --weight W
    [--window S --min-requests N --max-error-rate R ...]
    loraplex adapters rollback NAME [--reason TEXT] | disable NAME | audit | keygen --out DIR
    loraplex adapters merge NAME ADAPTER[@REV] ... --base-model DIR --combination-type TYPE
    [--weights W ...] [--density D] [--svd-rank R] ... [--sign-key PRIVATE.pem] [--activate]
    loraplex tenants create NAME [--max-waiting N] [--rate-limit RPS] [--host-bytes 2GiB]
    loraplex tenants list | keys create (--tenant T | --admin) | keys list | keys revoke KEY_ID

``loraplex registry ...`` is the same as ``loraplex adapters ...``.
Every command takes ``--registry-url`` (default ``$LORAPLEX_REGISTRY_URL`` or the SQLite file
in ``$LORAPLEX_HOME``), ``--json`` and ``--actor``. Errors are one line on stderr, exit 2.
Never imports torch: ``merge`` computes with the merger the ``loraplex`` command hands
:func:`main` (:func:`loraplex.lora.merging.merge_adapter_dirs`).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn

from loraplex.config.argtypes import byte_size, fraction, positive_int
from loraplex.lora.peft.errors import FormatError
from loraplex.lora.peft.merging import COMBINATION_TYPES, MAJORITY_SIGN_METHODS, MergeSpec
from loraplex.lora.peft.merging import PARAMS as MERGE_PARAMS
from loraplex.registry import signing
from loraplex.registry.db import ADAPTER_STATUSES
from loraplex.registry.errors import RegistryError, RegistryUnavailableError
from loraplex.registry.inspect import base_model_info
from loraplex.registry.merges import MERGE_COMMAND, Merger, merge_adapters
from loraplex.registry.policy import RegistryPolicy
from loraplex.registry.records import SCOPES, CanaryPolicy, Manifest, Release
from loraplex.registry.service import Registry
from loraplex.types import LoraplexError
from loraplex.warm import WARM_POLICIES


class _Usage(Exception):
    """A command-line syntax error (reported like every other error: one line, exit 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _Usage(message)


# --------------------------------------------------------------------------- output


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table."""
    cells = [[str(h) for h in headers]] + [["-" if v is None else str(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _emit(args: argparse.Namespace, data: Any, human: Callable[[], str]) -> None:
    print(json.dumps(data, indent=2, sort_keys=True) if args.json else human())


def _manifest_table(ms: list[Manifest]) -> str:
    rows = [
        [
            m.name,
            m.revision,
            m.status,
            m.tenant or "(shared)",
            m.sha256[:12],
            m.rank,
            m.dtype,
            ",".join(m.target_modules),
            m.warm_policy if m.warm_schedule is None else f"windows ({m.warm_schedule.tz})",
            _when(m.created_at),
        ]
        for m in ms
    ]
    headers = ["NAME", "REVISION", "STATUS", "TENANT", "SHA256", "RANK", "DTYPE", "TARGETS"]
    return _table([*headers, "WARM", "CREATED"], rows) if ms else "(no adapters)"


def _manifest_text(m: Manifest) -> str:
    d = m.to_dict()
    d["target_modules"] = ", ".join(m.target_modules)
    for k in ("created_at", "activated_at"):
        d[k] = _when(d[k])
    width = max(map(len, d))
    return "\n".join(f"{k.ljust(width)}  {'-' if v is None else v}" for k, v in d.items())


def _release_text(r: Release) -> str:
    canary = f"{r.canary_revision} ({r.canary_weight:.0%})" if r.canary_revision else "-"
    return (
        f"{r.name}: active {r.active_revision or '-'}, canary {canary}, "
        f"previous {r.previous_revision or '-'}"
    )


# --------------------------------------------------------------------------- commands


def _policy(args: argparse.Namespace) -> RegistryPolicy:
    keys = []
    for path in getattr(args, "trusted_key", None) or []:
        try:
            keys.append(Path(path).read_text())
        except OSError as e:
            raise RegistryError(f"cannot read trusted key {path}: {e.strerror or e}") from e
    return RegistryPolicy(
        require_signatures=getattr(args, "require_signatures", False),
        trusted_keys=tuple(keys),
        max_rank=getattr(args, "max_rank", None) or 64,
        allowed_roots=tuple(getattr(args, "allowed_root", None) or ()),
        allowed_prefixes=tuple(getattr(args, "allowed_prefix", None) or ()),
    )


def _open(args: argparse.Namespace) -> Registry:
    return Registry.open(args.registry_url, policy=_policy(args))


def _warm_arg(text: str | None) -> object:
    """``--warm``: a JSON window schedule (``{"device": ...}``) or a warm policy name."""
    if text is None or not text.lstrip().startswith("{"):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RegistryError(f"--warm: not a JSON object ({e.msg})") from None


def _private_key(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        raise RegistryError(f"cannot read signing key {path}: {e.strerror}") from e


def cmd_register(args: argparse.Namespace, reg: Registry) -> int:
    base = base_model_info(args.base_model, args.base_name)
    signature = args.signature
    if args.sign_key:
        private_pem = _private_key(args.sign_key)
        draft, _ = reg.prepare(
            args.path,
            args.name,
            base=base,
            tenant=args.tenant,
            source_uri=args.source_uri,
            allow_any_source=args.allow_any_source,
        )
        signature = signing.sign(draft.signed_payload(), private_pem)
    m = reg.register(
        args.path,
        args.name,
        base=base,
        revision=args.revision,
        tenant=args.tenant,
        source_uri=args.source_uri,
        priority=args.priority,
        slo_class=args.slo_class,
        warm_policy=args.warm_policy,
        signature=signature,
        actor=args.actor,
        allow_any_source=args.allow_any_source,
        sha256=args.sha256,
        max_concurrent_requests=args.max_concurrent_requests,
        warm=_warm_arg(args.warm),
    )
    return _settle(args, reg, m, "registered")


def _settle(args: argparse.Namespace, reg: Registry, m: Manifest, done: str) -> int:
    """A new revision ``m``: ``--activate`` or ``--stage`` it, then show it."""
    if args.activate:
        reg.activate(m.name, m.revision, actor=args.actor)
        m = reg.get(m.name, m.revision)
    elif args.stage and m.status in ("validated", "disabled"):
        m = reg.stage(m.name, m.revision, actor=args.actor)
    _emit(
        args,
        m.to_dict(),
        lambda: f"{done} {m.name}@{m.revision} ({m.status})\n" + _manifest_text(m),
    )
    return 0


def cmd_merge(args: argparse.Namespace, reg: Registry) -> int:
    """Merge registered adapters into a new revision of ``args.name`` (PEFT's
    ``add_weighted_adapter``), signed with ``--sign-key`` if given."""
    merger: Merger | None = args.merger
    if merger is None:
        raise RegistryError(f"merging needs torch: run it as `{MERGE_COMMAND}`")
    try:
        params = {k: getattr(args, k) for k in MERGE_PARAMS}
        spec = MergeSpec.of(args.combination_type, args.weights, len(args.adapters), **params)
    except FormatError as e:
        raise RegistryError(str(e)) from None
    private_pem = _private_key(args.sign_key) if args.sign_key else None
    m = merge_adapters(
        reg,
        args.adapters,
        spec,
        name=args.name,
        base=base_model_info(args.base_model, args.base_name),
        tenant=args.tenant,
        actor=args.actor,
        merger=merger,
        out_root=Path(args.out) if args.out else None,
        revision=args.revision,
        signature=args.signature,
        sign=None if private_pem is None else (lambda p: signing.sign(p, private_pem)),
        dry_run=args.dry_run,
    )
    if args.dry_run:
        data = {**m.to_dict(), "signed_payload": m.signed_payload().decode()}
        _emit(args, data, lambda: f"would register {m.name} ({m.sha256[:12]}) from {m.path}")
        return 0
    return _settle(args, reg, m, "merged into")


def cmd_list(args: argparse.Namespace, reg: Registry) -> int:
    ms = reg.list(tenant=args.tenant, status=args.status)
    _emit(args, [m.to_dict() for m in ms], lambda: _manifest_table(ms))
    return 0


def cmd_show(args: argparse.Namespace, reg: Registry) -> int:
    rel = reg.release(args.name)
    if args.revision is None and rel.active_revision is None:
        ms = [m for m in reg.list() if m.name == args.name]
        data = {"release": asdict(rel), "revisions": [m.to_dict() for m in ms]}
        _emit(args, data, lambda: _release_text(rel) + "\n\n" + _manifest_table(ms))
        return 0
    m = reg.get(args.name, args.revision)
    data = {"release": asdict(rel), "manifest": m.to_dict()}
    _emit(args, data, lambda: _release_text(rel) + "\n\n" + _manifest_text(m))
    return 0


def cmd_validate(args: argparse.Namespace, reg: Registry) -> int:
    revision = args.revision or reg.get(args.name).revision
    m = reg.validate(
        args.name, revision, base=base_model_info(args.base_model, args.base_name), actor=args.actor
    )
    _emit(args, m.to_dict(), lambda: f"{m.name}@{m.revision}: valid ({m.status})")
    return 0


def cmd_promote(args: argparse.Namespace, reg: Registry) -> int:
    rel = reg.promote(args.name, args.revision, actor=args.actor)
    _emit(args, asdict(rel), lambda: "promoted " + _release_text(rel))
    return 0


_POLICY_ARGS = {
    "window": "window_s",
    "min_requests": "min_requests",
    "max_error_rate": "max_error_rate",
    "max_ttft_p95": "max_ttft_p95_s",
    "max_tpot_p95": "max_tpot_p95_s",
    "min_quality": "min_quality",
    "scorer": "scorer",
    "canary_max_concurrent": "max_concurrent_requests",
}


def cmd_canary(args: argparse.Namespace, reg: Registry) -> int:
    given = {f: getattr(args, a) for a, f in _POLICY_ARGS.items() if getattr(args, a) is not None}
    policy = CanaryPolicy(**given) if given else None
    rel = reg.canary(args.name, args.revision, args.weight, actor=args.actor, policy=policy)
    _emit(args, asdict(rel), lambda: "canary set: " + _release_text(rel))
    return 0


def cmd_rollback(args: argparse.Namespace, reg: Registry) -> int:
    rel = reg.rollback(args.name, actor=args.actor, reason=args.reason)
    _emit(args, asdict(rel), lambda: "rolled back: " + _release_text(rel))
    return 0


def cmd_disable(args: argparse.Namespace, reg: Registry) -> int:
    m = reg.disable(args.name, args.revision, actor=args.actor)
    _emit(args, m.to_dict(), lambda: f"disabled {m.name}@{m.revision}")
    return 0


def cmd_audit(args: argparse.Namespace, reg: Registry) -> int:
    entries = reg.audit_log(limit=args.limit, target=args.target)

    def change(e: Any) -> str:
        """The fields an entry changed, ``key old -> new`` (or the refusal reason)."""
        after = e.after or {}
        if "reason" in after:
            return f"refused: {after['reason']}"
        if not e.before:
            return ""
        keys = [k for k in after if k in e.before and e.before[k] != after[k]]
        return ", ".join(f"{k} {e.before[k]} -> {after[k]}" for k in keys)

    rows = [[e.id, _when(e.ts), e.actor, e.action, e.target, change(e)] for e in entries]
    _emit(
        args,
        [asdict(e) for e in entries],
        lambda: (
            _table(["ID", "WHEN", "ACTOR", "ACTION", "TARGET", "CHANGE"], rows)
            if rows
            else "(no audit entries)"
        ),
    )
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        priv, pub = out / "ed25519_private.pem", out / "ed25519_public.pem"
        if priv.exists() and not args.force:
            raise RegistryError(f"{priv} exists (use --force to overwrite)")
        private_pem, public_pem = signing.generate_keypair()
        fd = os.open(priv, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(private_pem)
        pub.write_text(public_pem)
    except OSError as e:
        raise RegistryError(f"cannot write keys to {out}: {e.strerror or e}") from e
    data = {"private_key": str(priv), "public_key": str(pub), "key_id": signing.key_id(public_pem)}
    _emit(
        args,
        data,
        lambda: (
            f"private key {priv} (keep secret)\npublic key  {pub}\nkey id      {data['key_id']}"
        ),
    )
    return 0


def cmd_tenant_create(args: argparse.Namespace, reg: Registry) -> int:
    t = reg.create_tenant(
        args.name,
        max_waiting=args.max_waiting,
        rate_limit_rps=args.rate_limit,
        host_bytes_budget=args.host_bytes,
        actor=args.actor,
    )
    _emit(args, asdict(t), lambda: f"created tenant {t.name}")
    return 0


def cmd_tenant_list(args: argparse.Namespace, reg: Registry) -> int:
    ts = reg.list_tenants()
    rows = [
        [t.name, t.max_waiting, t.rate_limit_rps, t.host_bytes_budget, _when(t.created_at)]
        for t in ts
    ]
    _emit(
        args,
        [asdict(t) for t in ts],
        lambda: (
            _table(["TENANT", "MAX_WAITING", "RATE_LIMIT_RPS", "HOST_BYTES", "CREATED"], rows)
            if rows
            else "(no tenants)"
        ),
    )
    return 0


def cmd_key_create(args: argparse.Namespace, reg: Registry) -> int:
    if args.admin:
        scopes = args.scope or ["admin:*"]
        tenant = None
    else:
        scopes = args.scope or ["inference"]
        tenant = args.tenant
    key_id, secret = reg.create_key(
        tenant, scopes=tuple(scopes), actor=args.actor, label=args.label
    )
    data = {"key_id": key_id, "secret": secret, "tenant": tenant, "scopes": sorted(scopes)}
    _emit(
        args,
        data,
        lambda: (
            f"key {key_id} ({tenant or 'admin'}: {', '.join(sorted(scopes))})\n"
            f"secret: {secret}\n(shown once: store it now; the registry keeps only its hash)"
        ),
    )
    return 0


def cmd_key_list(args: argparse.Namespace, reg: Registry) -> int:
    keys = reg.list_keys(args.tenant)
    rows = [
        [
            k["key_id"],
            k["tenant"] or "(admin)",
            ",".join(k["scopes"]),
            k["label"],
            _when(k["created_at"]),
            "revoked" if k["revoked"] else "live",
        ]
        for k in keys
    ]
    _emit(
        args,
        keys,
        lambda: (
            _table(["KEY_ID", "TENANT", "SCOPES", "LABEL", "CREATED", "STATE"], rows)
            if rows
            else "(no keys)"
        ),
    )
    return 0


def cmd_key_revoke(args: argparse.Namespace, reg: Registry) -> int:
    reg.revoke_key(args.key_id, actor=args.actor)
    _emit(args, {"key_id": args.key_id, "revoked": True}, lambda: f"revoked {args.key_id}")
    return 0


# --------------------------------------------------------------------------- parsers


def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--registry-url",
        default=None,
        help="SQLAlchemy URL (sqlite:///path.db, postgresql+psycopg://...); default "
        "$LORAPLEX_REGISTRY_URL or $LORAPLEX_HOME/registry.db",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--actor",
        default=os.environ.get("USER") or "cli",
        help="who is acting, for the audit log (default $USER)",
    )
    return p


def _policy_opts() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--require-signatures", action="store_true", help="refuse unsigned adapters")
    p.add_argument("--trusted-key", action="append", metavar="FILE", help="ed25519 public key")
    p.add_argument("--allowed-root", action="append", metavar="DIR", help="allowed local root")
    p.add_argument("--allowed-prefix", action="append", metavar="URI", help="allowed store prefix")
    p.add_argument("--max-rank", type=positive_int, default=64, help="largest rank (default 64)")
    return p


def build_parser(command: str) -> argparse.ArgumentParser:
    """``command``: ``adapters`` (or its other name, ``registry``) or ``tenants``."""
    common, policy = _common(), _policy_opts()
    parser = _Parser(prog=f"loraplex {command}")
    sub = parser.add_subparsers(dest="action", required=True, parser_class=_Parser)

    def add(
        name: str, func: Callable[..., int], help_: str, pol: bool = False
    ) -> argparse.ArgumentParser:
        parents = [common, policy] if pol else [common]
        p = sub.add_parser(name, parents=parents, help=help_, description=help_)
        p.set_defaults(func=func)
        return p

    if command in ("adapters", "registry"):
        p = add("register", cmd_register, "validate and record an adapter revision", pol=True)
        p.add_argument("name")
        p.add_argument("path", help="local adapter directory (PEFT, safetensors)")
        p.add_argument("--base-model", required=True, metavar="DIR", help="served base model")
        p.add_argument("--base-name", default=None, help="base model name (default: dir name)")
        p.add_argument("--revision", default=None, help="revision label (default r1, r2, ...)")
        p.add_argument("--tenant", default=None, help="owning tenant (default: shared)")
        p.add_argument("--source-uri", default=None, help="real source, e.g. s3://bucket/x/")
        p.add_argument("--priority", type=int, default=0)
        p.add_argument("--slo-class", default=None)
        p.add_argument("--warm-policy", choices=WARM_POLICIES, default="on-demand")
        p.add_argument("--warm", default=None, metavar="JSON",
                       help='warm windows, e.g. \'{"device": "Mon-Fri 08:00-18:00", '
                       '"tz": "Europe/Berlin"}\' (instead of --warm-policy)')  # fmt: skip
        p.add_argument("--sha256", default=None, help="expected adapter digest")
        sig = p.add_mutually_exclusive_group()
        sig.add_argument("--sign-key", metavar="PRIVATE.pem", help="sign with this ed25519 key")
        sig.add_argument("--signature", metavar="B64", help="signature made elsewhere")
        p.add_argument("--stage", action="store_true", help="stage it after validation")
        p.add_argument("--activate", action="store_true", help="stage and promote it")
        p.add_argument("--max-concurrent-requests", type=int, default=None, metavar="N",
                       help="calls of this revision in flight per replica (excess wait, then 429)")  # fmt: skip
        p.add_argument(
            "--allow-any-source",
            action="store_true",
            help="operator override: skip the allowed roots/prefixes check",
        )
        p = add("merge", cmd_merge, "merge registered adapters into a new revision", pol=True)
        p.add_argument("name", help="the new adapter's name")
        p.add_argument("adapters", nargs="+", metavar="ADAPTER", help="NAME or NAME@REVISION")
        p.add_argument("--base-model", required=True, metavar="DIR", help="served base model")
        p.add_argument("--base-name", default=None, help="base model name (default: dir name)")
        p.add_argument("--combination-type", required=True, choices=COMBINATION_TYPES)
        p.add_argument("--weights", type=float, nargs="+", default=None, metavar="W",
                       help="one per adapter (default 1 each); negative subtracts")  # fmt: skip
        p.add_argument("--density", type=float, default=None, help="fraction kept (ties, dare, "
                       "magnitude_prune)")  # fmt: skip
        p.add_argument("--majority-sign-method", choices=MAJORITY_SIGN_METHODS, default=None)
        p.add_argument("--svd-rank", type=positive_int, default=None)
        p.add_argument("--svd-clamp", type=float, default=None, metavar="QUANTILE")
        p.add_argument("--svd-full-matrices", action=argparse.BooleanOptionalAction, default=None)
        p.add_argument("--seed", type=int, default=None, help="DARE's mask seed (default 0)")
        p.add_argument("--tenant", default=None, help="owning tenant (default: shared)")
        p.add_argument("--revision", default=None, help="revision label (default r1, r2, ...)")
        p.add_argument("--out", default=None, metavar="DIR",
                       help="where merged adapters are written (default $LORAPLEX_HOME/merged)")  # fmt: skip
        sig = p.add_mutually_exclusive_group()
        sig.add_argument("--sign-key", metavar="PRIVATE.pem", help="sign with this ed25519 key")
        sig.add_argument("--signature", metavar="B64", help="signature made elsewhere")
        p.add_argument("--dry-run", action="store_true",
                       help="write the merge and show its manifest and payload to sign; register nothing")  # fmt: skip
        p.add_argument("--stage", action="store_true", help="stage it after validation")
        p.add_argument("--activate", action="store_true", help="stage and promote it")
        p = add("list", cmd_list, "list adapter revisions")
        p.add_argument("--tenant", default=None)
        p.add_argument("--status", choices=ADAPTER_STATUSES, default=None)
        p = add("show", cmd_show, "show a release and one revision")
        p.add_argument("name")
        p.add_argument("--revision", default=None)
        p = add("validate", cmd_validate, "re-check a revision's files now", pol=True)
        p.add_argument("name")
        p.add_argument("--revision", default=None, help="default: the active revision")
        p.add_argument("--base-model", required=True, metavar="DIR")
        p.add_argument("--base-name", default=None)
        p = add("promote", cmd_promote, "make a revision (default: the canary) active")
        p.add_argument("name")
        p.add_argument("--revision", default=None)
        p = add("canary", cmd_canary, "send a share of traffic to a staged revision")
        p.add_argument("name")
        p.add_argument("revision")
        p.add_argument("--weight", type=fraction, required=True, help="share in [0, 1], e.g. 0.1")
        h = p.add_argument_group(
            "health policy (any of these: each replica rolls the canary back on a breach)"
        )
        h.add_argument("--window", type=float, metavar="SECONDS", help="default 300")
        h.add_argument("--min-requests", type=int, metavar="N", help="default 20")
        h.add_argument("--max-error-rate", type=float, metavar="R", help="default 0.05")
        h.add_argument("--max-ttft-p95", type=float, metavar="SECONDS")
        h.add_argument("--max-tpot-p95", type=float, metavar="SECONDS")
        h.add_argument("--min-quality", type=float, metavar="Q", help="mean score in [0, 1]")
        h.add_argument("--scorer", metavar="NAME", help="quality scorer, e.g. json")
        h.add_argument("--canary-max-concurrent", type=int, metavar="N",
                       help="cap on the canary's calls in flight (default: its share)")  # fmt: skip
        p = add("rollback", cmd_rollback, "disable the active revision, restore the previous")
        p.add_argument("name")
        p.add_argument("--reason", default="manual", help="recorded in the audit log")
        p = add("disable", cmd_disable, "disable a revision (default: the active one)")
        p.add_argument("name")
        p.add_argument("--revision", default=None)
        p = add("audit", cmd_audit, "show the audit log, newest first")
        p.add_argument("--target", default=None, help="adapter name (and its revisions)")
        p.add_argument("--limit", type=positive_int, default=50)
        p = add("keygen", cmd_keygen, "write an ed25519 key pair for signing manifests")
        p.add_argument("--out", required=True, metavar="DIR")
        p.add_argument("--force", action="store_true", help="overwrite an existing key")
    else:
        p = add("create", cmd_tenant_create, "create a tenant")
        p.add_argument("name")
        p.add_argument("--max-waiting", type=positive_int, default=None)
        p.add_argument("--rate-limit", type=float, default=None, metavar="RPS")
        p.add_argument("--host-bytes", type=byte_size, default=None, metavar="SIZE")
        add("list", cmd_tenant_list, "list tenants")
        keys = sub.add_parser("keys", help="API keys", description="API keys")
        ksub = keys.add_subparsers(dest="key_action", required=True, parser_class=_Parser)
        p = ksub.add_parser("create", parents=[common], help="create a key (secret shown once)")
        p.set_defaults(func=cmd_key_create)
        who = p.add_mutually_exclusive_group(required=True)
        who.add_argument("--tenant", default=None, help="inference key of this tenant")
        who.add_argument("--admin", action="store_true", help="admin key (no tenant)")
        p.add_argument("--scope", action="append", choices=SCOPES, help="repeatable")
        p.add_argument("--label", default=None)
        p = ksub.add_parser("list", parents=[common], help="list keys (never secrets)")
        p.set_defaults(func=cmd_key_list)
        p.add_argument("--tenant", default=None)
        p = ksub.add_parser("revoke", parents=[common], help="revoke a key")
        p.set_defaults(func=cmd_key_revoke)
        p.add_argument("key_id")
    return parser


def main(argv: list[str] | None = None, *, merger: Merger | None = None) -> int:
    """Entry point: ``argv[0]`` is ``adapters`` (or ``registry``) or ``tenants``, the rest its
    arguments. ``merger`` computes ``merge`` (the registry imports no torch)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in ("adapters", "registry", "tenants"):
        print("loraplex: error: expected 'adapters', 'registry' or 'tenants'", file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    parser = build_parser(command)
    try:
        args = parser.parse_args(rest)
    except _Usage as e:
        print(f"loraplex {command}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)
    args.merger = merger
    try:
        if args.func is cmd_keygen:
            return cmd_keygen(args)
        with _open(args) as reg:
            return args.func(args, reg)
    except BrokenPipeError:  # output piped into e.g. head: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except RegistryUnavailableError as e:
        print(f"loraplex {command}: error: {e} ({e.detail})", file=sys.stderr)
        return 2
    except (LoraplexError, ValueError, OSError) as e:
        print(f"loraplex {command}: error: {e}", file=sys.stderr)
        return 2
