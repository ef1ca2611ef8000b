"""Merges as registry operations: registered adapters merged (PEFT's ``add_weighted_adapter``:
``ties``, ``dare_linear``, ``dare_ties``, ``cat``, the SVD merges, ...) into a new adapter that is
registered like any other: validated, versioned, with its digest, signed where the registry
wants signatures, and audited.

:func:`merge_adapters` resolves and bounds the inputs (their names, the caller's tenant, one
base model, how many, the rank of the result) before anything is read, has a
:class:`Merger` write the merged PEFT directory, and registers that directory through
:meth:`Registry.register <loraplex.registry.revisions.Revisions.register>`. The registry imports
no torch: the merger (:func:`loraplex.lora.merging.merge_adapter_dirs`) is handed in by the
caller (the server's admin route, the ``loraplex adapters merge`` command).

A merged directory is named by its digest under ``<LORAPLEX_HOME>/merged`` (written to a
temporary name first, then renamed), so the same merge twice is one directory and one revision.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from loraplex.lora.peft.errors import FormatError
from loraplex.lora.peft.merging import MAX_MERGED_ADAPTERS, MergeSpec
from loraplex.registry.checks import NAME_RE, REVISION_RE, TENANT_RE, check_name
from loraplex.registry.db import loraplex_home
from loraplex.registry.errors import NotFoundError, RegistryError, ValidationError
from loraplex.registry.inspect import BaseModelInfo
from loraplex.registry.records import Manifest
from loraplex.registry.service import Registry
from loraplex.types import AdapterError

MERGE_ROUTE = "POST /v1/admin/adapters/merge"
MERGE_COMMAND = "loraplex registry merge"
"""Where a merge is offered (a request asking for one at request time is pointed here)."""

MERGEABLE_STATUSES = ("validated", "staged", "active", "deprecated")
"""Revisions a merge may read (not ``uploaded``, never validated, nor ``disabled``)."""


class Merger(Protocol):
    """Writes the merge of the adapters in ``sources`` (``(directory, sha256)``, each used only
    if its files still have that digest) into the new directory ``out_dir``; raises
    ``FormatError`` for inputs it cannot merge or a result above ``max_rank``."""

    def __call__(
        self, sources: Sequence[tuple[str, str]], spec: MergeSpec, out_dir: Path, *, max_rank: int
    ) -> None: ...


def merged_root() -> Path:
    """``<LORAPLEX_HOME>/merged``: where merged adapters are written by default."""
    return loraplex_home() / "merged"


def parse_ref(ref: object) -> tuple[str, str | None]:
    """``"name"`` (its active revision) or ``"name@revision"`` as ``(name, revision)``."""
    if not isinstance(ref, str):
        raise RegistryError(f"an adapter is named by a string (name or name@revision), got {ref!r}")
    name, at, revision = ref.partition("@")
    check_name("adapter name", name, NAME_RE)
    if at:
        check_name("revision", revision, REVISION_RE)
        return name, revision
    return name, None


def resolve_inputs(
    registry: Registry, refs: Sequence[object], *, tenant: str | None, base: BaseModelInfo
) -> list[Manifest]:
    """The manifests a merge reads, checked: 1 to ``MAX_MERGED_ADAPTERS`` distinct revisions
    the caller may see (a tenant its own and shared ones: another tenant's is unknown, as
    for inference), each mergeable, all for ``base``."""
    if not isinstance(refs, (list, tuple)) or not 1 <= len(refs) <= MAX_MERGED_ADAPTERS:
        raise ValidationError(
            "invalid_merge", f"adapters: name 1 to {MAX_MERGED_ADAPTERS} adapters to merge"
        )
    out: list[Manifest] = []
    for ref in refs:
        name, revision = parse_ref(ref)
        unknown = NotFoundError(f"unknown adapter {ref!r}")
        try:
            owner = registry.release(name).tenant
        except NotFoundError:
            raise unknown from None
        if tenant is not None and owner not in (tenant, None):
            raise unknown  # another tenant's adapter: as if it did not exist
        m = registry.get(name, revision)  # NotFoundError: no such revision, or none active
        if m.status not in MERGEABLE_STATUSES:
            raise ValidationError(
                "invalid_merge", f"{name}@{m.revision} is {m.status} and cannot be merged"
            )
        if m.alora_invocation_tokens is not None:
            raise ValidationError(
                "invalid_merge", f"{name}@{m.revision} is an activated LoRA and cannot be merged"
            )
        if m.base_model_digest != base.digest:
            raise ValidationError(
                "base_model_mismatch",
                f"{name}@{m.revision} was registered for base model {m.base_model_name} "
                f"({m.base_model_digest[:12]}), not {base.name} ({base.digest[:12]}); merge "
                "adapters of one base model",
            )
        if any(o.name == m.name and o.revision == m.revision for o in out):
            raise ValidationError(
                "invalid_merge", f"{name}@{m.revision} is named twice (give it one weight)"
            )
        out.append(m)
    return out


def merge_adapters(
    registry: Registry,
    refs: Sequence[object],
    spec: MergeSpec,
    *,
    name: str,
    base: BaseModelInfo,
    tenant: str | None,
    actor: str,
    merger: Merger,
    out_root: Path | None = None,
    revision: str | None = None,
    signature: str | None = None,
    sign: Callable[[bytes], str] | None = None,
    dry_run: bool = False,
) -> Manifest:
    """Merge the registered adapters ``refs`` by ``spec`` into a new revision of ``name``
    (owned by ``tenant``) and return its manifest (status ``validated``; stage or activate it
    as any other). ``signature`` is a signature made elsewhere over the result's
    ``signed_payload()``; ``sign`` makes one here (the command line's private key).
    ``dry_run`` writes the merged directory and returns the manifest it would get (revision
    ``""``) without registering it: its ``signed_payload()`` is what to sign. Refusals are
    :class:`RegistryError` (``NotFoundError`` for an input the caller may not see,
    ``ValidationError`` with a reason for the rest), raised before any tensor is read where
    the manifests tell."""
    check_name("adapter name", name, NAME_RE)
    if tenant is not None:
        check_name("tenant name", tenant, TENANT_RE)
    if revision is not None:
        check_name("revision", revision, REVISION_RE)
    try:  # the name is free or the tenant's own (checked again when registering)
        owner: str | None = registry.release(name).tenant
    except NotFoundError:
        owner = tenant
    if owner != tenant:
        raise RegistryError(f"adapter name {name!r} is already taken "
                            f"({'shared' if owner is None else 'owned by another tenant'})")  # fmt: skip
    inputs = resolve_inputs(registry, refs, tenant=tenant, base=base)
    if len(inputs) != len(spec.weights):
        raise ValidationError(
            "invalid_merge", f"{len(inputs)} adapters but {len(spec.weights)} weights"
        )
    max_rank = registry.policy.max_rank
    try:
        rank = spec.merged_rank([m.rank for m in inputs])
    except FormatError as e:
        raise ValidationError(e.reason, str(e)) from None
    if rank > max_rank:
        raise ValidationError(
            "rank_too_large",
            f"the merged adapter would have rank {rank}, above this registry's largest, "
            f"{max_rank} (merge fewer adapters, or give svd_rank)",
        )
    root = merged_root() if out_root is None else Path(out_root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root, prefix=".merging-") as tmp:
            work = Path(tmp) / "adapter"
            merger([(m.path, m.sha256) for m in inputs], spec, work, max_rank=max_rank)
            draft, _ = registry.prepare(work, name, base=base, tenant=tenant, allow_any_source=True)
            final = root / draft.sha256
            try:  # an existing directory: the same merge before, the same bytes
                if not final.is_dir():
                    os.replace(work, final)
            except OSError:
                if not final.is_dir():  # not a concurrent merge of the same adapters
                    raise
    except FormatError as e:
        raise ValidationError(e.reason, str(e)) from None
    except AdapterError as e:
        raise ValidationError("sha256_mismatch", str(e)) from None
    except OSError as e:
        raise RegistryError(f"cannot write the merged adapter: {e.strerror or e}") from None
    if sign is not None:
        signature = sign(draft.signed_payload())
    if dry_run:
        return replace(draft, path=str(final), source_uri=str(final), signature=signature)
    m = registry.register(
        final,
        name,
        base=base,
        revision=revision,
        tenant=tenant,
        signature=signature,
        actor=actor,
        allow_any_source=True,  # written here, by the registry's own operation
        sha256=draft.sha256,
    )
    registry.audit(
        actor,
        "merge",
        f"{m.name}@{m.revision}",
        after={
            "inputs": [
                {"name": i.name, "revision": i.revision, "sha256": i.sha256} for i in inputs
            ],
            **spec.to_dict(),
            "sha256": m.sha256,
        },
    )
    return m
