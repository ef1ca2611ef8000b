"""Errors of the registry; each message names the reason."""

from __future__ import annotations

from loraplex.types import LoraplexError


class RegistryError(LoraplexError, ValueError):
    """Base of every registry error (bad argument, name owned by another tenant, database)."""


class RegistryUnavailableError(RegistryError):
    """The registry database cannot be reached (down, refusing connections, unreadable file,
    connection lost): transient, a server answers 503 + Retry-After. The message names neither
    the driver's text nor a URL with a password; ``detail`` keeps the driver's first line for
    the operator's logs and command-line errors."""

    def __init__(self, message: str, *, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


class NotFoundError(RegistryError):
    """Unknown adapter, revision, tenant or key."""


class TransitionError(RegistryError):
    """An illegal lifecycle move; the message names from, to and the allowed moves."""


class ValidationError(RegistryError):
    """An adapter failed validation; ``reason`` is a short code such as ``sha256_mismatch``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class ConflictError(RegistryError):
    """The change conflicts with what is recorded (a revision label already names other
    content, or this content already has another label): HTTP 409."""
