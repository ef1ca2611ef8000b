"""Errors of the registry; each message names the reason."""

from __future__ import annotations

from loraplex.types import LoraplexError


class RegistryError(LoraplexError, ValueError):
    """Base of every registry error (bad argument, name owned by another tenant, database)."""


class NotFoundError(RegistryError):
    """Unknown adapter, revision, tenant or key."""


class TransitionError(RegistryError):
    """An illegal lifecycle move; the message names from, to and the allowed moves."""


class ValidationError(RegistryError):
    """An adapter failed validation; ``reason`` is a short code such as ``sha256_mismatch``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
