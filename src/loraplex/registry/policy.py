"""What the operator allows (:class:`RegistryPolicy`) and its two checks on a new adapter: where
its files may come from (:func:`check_source`) and who must have signed it
(:func:`check_signature`). Both raise :class:`ValidationError` with a machine-readable reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loraplex.lora.peft.files import ADAPTER_FILES
from loraplex.paths import contained, first_outside
from loraplex.registry.errors import RegistryError, ValidationError
from loraplex.registry.signing import load_public_key
from loraplex.registry.signing import verify as verify_signature


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


def check_source(
    policy: RegistryPolicy, path: str | Path, source_uri: str | None, allow_any_source: bool
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
        prefixes = [p if p.endswith("/") else p + "/" for p in policy.allowed_prefixes]
        if not any(source_uri.startswith(p) for p in prefixes):
            allowed = ", ".join(policy.allowed_prefixes) or "none configured"
            raise ValidationError(
                "source_not_allowed",
                f"{source_uri!r} is not under an allowed prefix ({allowed})",
            )
        return resolved, source_uri
    roots = policy.allowed_roots
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


def check_signature(policy: RegistryPolicy, payload: bytes, signature: str | None) -> str | None:
    """The id of the trusted key that signed ``payload``; raises bad_signature / unsigned."""
    if signature is None:
        if policy.require_signatures:
            raise ValidationError("unsigned", "this registry requires signed manifests")
        return None
    if not isinstance(signature, str) or not signature.strip():
        raise ValidationError("bad_signature", "empty signature")
    if not policy.trusted_keys:
        raise ValidationError("bad_signature", "signature given but no trusted keys configured")
    signer = verify_signature(payload, signature, policy.trusted_keys)
    if signer is None:
        raise ValidationError(
            "bad_signature", "the signature does not verify against any trusted key"
        )
    return signer
