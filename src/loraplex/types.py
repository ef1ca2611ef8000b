"""Core value types shared by every layer. No torch, no internal imports."""

from __future__ import annotations

import enum
from dataclasses import dataclass

BASE_NAMESPACE = b"loraplex-base"
"""Prefix-cache namespace of requests served by the base model (no adapter)."""


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """The one identity of an adapter: name, revision and sha256 of its weights + config.

    Every cache key (device slots, host cache, prefix-cache block hashes) uses ``sha256``;
    ``name`` and ``revision`` are for people and reports.
    """

    name: str
    revision: str
    sha256: str

    def __post_init__(self) -> None:
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError(
                f"AdapterRef.sha256 must be 64 lowercase hex digits, got {self.sha256!r}"
            )

    @property
    def namespace(self) -> bytes:
        """Prefix-cache namespace: the content digest, never the name."""
        return bytes.fromhex(self.sha256)

    @property
    def short(self) -> str:
        return f"{self.name}@{self.revision}#{self.sha256[:12]}"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class LoraplexError(Exception):
    """Base of every error loraplex raises on purpose; the message names the problem."""


class InvalidRequestError(LoraplexError, ValueError):
    """The request itself is invalid (bad parameters, prompt too long, ...)."""


class AdapterError(LoraplexError, ValueError):
    """An adapter cannot be used: missing, corrupt, unsupported or incompatible."""


class ModelLoadError(LoraplexError, ValueError):
    """A base model directory cannot be loaded: missing file, unsupported architecture, ..."""
