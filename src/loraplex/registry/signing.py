"""ed25519 signatures over adapter manifests (``Manifest.signed_payload()``).

Keys are configured by the operator as PEM text (``-----BEGIN PUBLIC KEY-----``) or the base64
of the 32 raw public-key bytes; a key's id is ``ed25519:`` + the first 16 hex digits of the
sha256 of its raw bytes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Iterable

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from loraplex.registry.errors import RegistryError


def generate_keypair() -> tuple[str, str]:
    """A fresh ed25519 key pair as ``(private_pem, public_pem)`` (PKCS8 / SubjectPublicKeyInfo)."""
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    return private_pem, _public_pem(key.public_key())


def _public_pem(key: Ed25519PublicKey) -> str:
    return key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()


def load_private_key(private_pem: str | bytes) -> Ed25519PrivateKey:
    """Parse an unencrypted ed25519 private key in PEM; RegistryError if it is not one."""
    data = private_pem.encode() if isinstance(private_pem, str) else private_pem
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise RegistryError(f"not an unencrypted PEM private key ({e})") from e
    if not isinstance(key, Ed25519PrivateKey):
        raise RegistryError(f"signing key must be ed25519, got {type(key).__name__}")
    return key


def load_public_key(text: str | bytes) -> Ed25519PublicKey:
    """Parse a trusted key: PEM text or base64 of the 32 raw bytes."""
    data = text.encode() if isinstance(text, str) else text
    if b"-----BEGIN" in data:
        try:
            key = serialization.load_pem_public_key(data)
        except (ValueError, TypeError) as e:
            raise RegistryError(f"not a PEM public key ({e})") from e
        if not isinstance(key, Ed25519PublicKey):
            raise RegistryError(f"trusted key must be ed25519, got {type(key).__name__}")
        return key
    try:
        raw = base64.b64decode(data.strip(), validate=True)
    except (binascii.Error, ValueError) as e:
        raise RegistryError("trusted key is neither PEM nor base64 of 32 raw bytes") from e
    if len(raw) != 32:
        raise RegistryError(f"raw ed25519 public key must be 32 bytes, got {len(raw)}")
    return Ed25519PublicKey.from_public_bytes(raw)


def key_id(key: Ed25519PublicKey | str | bytes) -> str:
    """``ed25519:<16 hex>``: a short fingerprint of a public key (recorded as ``signed_by``)."""
    if not isinstance(key, Ed25519PublicKey):
        key = load_public_key(key)
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "ed25519:" + hashlib.sha256(raw).hexdigest()[:16]


def public_key_of(private_pem: str | bytes) -> str:
    """The public PEM matching a private PEM."""
    return _public_pem(load_private_key(private_pem).public_key())


def sign(payload: bytes, private_pem: str | bytes) -> str:
    """Base64 ed25519 signature of ``payload``."""
    return base64.b64encode(load_private_key(private_pem).sign(payload)).decode()


def verify(payload: bytes, signature: str, trusted_keys: Iterable[str]) -> str | None:
    """The id of the trusted key whose signature over ``payload`` this is, else None
    (also None for a signature that is not valid base64 of 64 bytes)."""
    try:
        sig = base64.b64decode(signature.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    if len(sig) != 64:
        return None
    for text in trusted_keys:
        key = load_public_key(text)
        try:
            key.verify(sig, payload)
        except InvalidSignature:
            continue
        return key_id(key)
    return None
