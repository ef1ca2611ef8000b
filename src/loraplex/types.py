"""Core value types shared by every layer, and the errors callers act on. No torch, no internal
imports.

The adapter errors below are raised by the cache and its stores (which re-export them where
they were defined before) and mapped to status codes by the server, which may not import the
cache: so they live here, at the bottom layer.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

BASE_NAMESPACE = b"loraplex-base"
"""Prefix-cache namespace of requests served by the base model (no adapter)."""

PUSHED_SCHEME = "pushed"
"""The ``source_uri`` scheme of an adapter whose bytes were pushed (HTTP or in-process), not
read from a directory: ``pushed://<sha256>``. Its copies live in host memory and, when asked,
the disk tier, found by digest; there is no file to read again."""


def pushed_source(sha256: str) -> str:
    """The ``source_uri`` of pushed bytes with adapter digest ``sha256``."""
    return f"{PUSHED_SCHEME}://{sha256}"


def is_pushed_source(source_uri: str) -> bool:
    """Whether ``source_uri`` names pushed bytes (see :data:`PUSHED_SCHEME`)."""
    return source_uri.startswith(f"{PUSHED_SCHEME}://")


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


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """What to serve: one adapter revision and where its bytes come from.

    Built once where a catalog resolves a request (the server's registry view, or the engine's
    local catalog for offline ``LoRARequest`` s) and the only adapter input of the cache and the
    engine. ``ref.sha256`` is the key of every cache tier and is verified against the bytes read;
    the name is for people and errors. ``source_uri`` is a local directory, a ``file://`` URI or
    an object-store URI (``s3://...``). ``tenant`` and ``priority`` feed residency decisions
    (tenant budgets, the policy's SLO weight); ``warm_policy`` is one of
    ``loraplex.warm.WARM_POLICIES`` (used by start-up warming). ``allow_pickle``: whether the
    weights may be read from ``adapter_model.bin`` (a pickle) when there is no safetensors file;
    False unless the catalog that built the spec found only a ``.bin`` (the registry registers
    safetensors only, so specs of registered revisions never allow it).
    """

    ref: AdapterRef
    source_uri: str
    tenant: str | None = None
    priority: int = 0
    warm_policy: str = "on-demand"
    allow_pickle: bool = False
    slo_class: str | None = None  # the manifest's SLO class (scheduling; see EngineConfig)

    @property
    def sha256(self) -> str:
        return self.ref.sha256

    @property
    def name(self) -> str:
        return self.ref.name


MAX_COMPOSED_ADAPTERS = 4
"""The most adapters one request may compose (each costs one more LoRA pass over its tokens)."""

MAX_ADAPTER_SCALE = 100.0
"""The largest ``|scale|`` a request may give an adapter (``lora_scale``, a composition's
weights): far past any useful strength (1.0 is the adapter as trained), small enough that a
scaled delta stays well inside every float dtype's range."""


def check_adapter_scale(scale: object, *, param: str = "lora_scale") -> float:
    """``scale`` as a float when it is a real number, finite and ``|scale| <=``
    :data:`MAX_ADAPTER_SCALE`; else :class:`InvalidRequestError` naming ``param``."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise InvalidRequestError(
            f"{param} must be a number, got {type(scale).__name__}", param=param
        )
    value = float(scale)
    if not math.isfinite(value) or abs(value) > MAX_ADAPTER_SCALE:
        raise InvalidRequestError(
            f"{param} must be finite and within [-{MAX_ADAPTER_SCALE:g}, {MAX_ADAPTER_SCALE:g}], "
            f"got {scale!r}",
            param=param,
        )
    return value


@dataclass(frozen=True, slots=True)
class ScaledAdapter:
    """One component of a request's adapters: an adapter and the scale its delta is added with
    (on top of its own alpha / r; 1.0 is the adapter as trained, 0 adds nothing, a negative
    scale subtracts it)."""

    spec: AdapterSpec
    scale: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "scale", check_adapter_scale(self.scale, param="scale"))


@dataclass(frozen=True, slots=True)
class AdapterComposition:
    """The adapters one request runs with, each with its scale::

        y = W x + sum_i scale_i * (alpha_i / r_i) * B_i A_i x

    exact for any mix of ranks and target modules: every component is an ordinary resident
    adapter (no merged weights, no new slot). A single adapter at a scale other than 1.0 (a
    per-request ``lora_scale``) is a composition of one. Built where a catalog resolves a
    request (the server's registry view, or the engine's local catalog for offline requests);
    at most :data:`MAX_COMPOSED_ADAPTERS` components, each a distinct digest.
    """

    components: tuple[ScaledAdapter, ...]

    def __post_init__(self) -> None:
        # InvalidRequestError is a ValueError: callers catching ValueError still do
        if not self.components:
            raise InvalidRequestError("an adapter composition needs at least one component")
        if len(self.components) > MAX_COMPOSED_ADAPTERS:
            raise InvalidRequestError(
                f"an adapter composition has at most {MAX_COMPOSED_ADAPTERS} components, "
                f"got {len(self.components)}"
            )
        digests = [c.spec.sha256 for c in self.components]
        if len(set(digests)) != len(digests):
            twice = next(c.spec.name for c in self.components if digests.count(c.spec.sha256) > 1)
            raise InvalidRequestError(f"an adapter composition names one adapter twice ({twice!r})")

    @property
    def name(self) -> str:
        """For people, metrics and logs: ``alpha*1+style*0.5``."""
        return "+".join(f"{c.spec.name}*{c.scale:g}" for c in self.components)


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class LoraplexError(Exception):
    """Base of every error loraplex raises on purpose; the message names the problem."""


class InvalidRequestError(LoraplexError, ValueError):
    """The request itself is invalid (bad parameters, prompt too long, ...).

    ``param`` names the request field at fault when there is one (OpenAI's error ``param``).
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class AdapterError(LoraplexError, ValueError):
    """An adapter cannot be used: missing, corrupt, unsupported or incompatible."""


class ModelLoadError(LoraplexError, ValueError):
    """A base model directory cannot be loaded: missing file, unsupported architecture, ..."""


# -- adapter errors that callers tell apart (raised by the cache, mapped by the server) ----------
class AdapterCapacityError(AdapterError):
    """No room for an adapter in a tier without breaking a hard constraint (every resident
    adapter in use or pinned), even after waiting. Transient: servers answer 503 + Retry-After."""

    def __init__(self, message: str, *, tier: str = "") -> None:
        super().__init__(message)
        self.tier = tier


class AdapterLoadTimeoutError(AdapterCapacityError):
    """A request gave up waiting for a load of its adapter that another request started (the
    bounded wait of single flight); the load goes on for later requests. Transient: 503 +
    Retry-After, like any capacity error."""


class AdapterInUseError(AdapterError):
    """An admin eviction was refused: the adapter has in-flight requests or is pinned (409)."""


class StoreError(AdapterError):
    """An object store could not serve a request; the message names store, URI and cause."""

    def __init__(self, message: str, *, store: str = "", uri: str = "") -> None:
        super().__init__(message)
        self.store = store
        self.uri = uri


class StoreNotFoundError(StoreError):
    """The adapter (or one of its required files, or the bucket) does not exist."""


class StorePermissionError(StoreError):
    """Refused: a URI outside the configured root/bucket/prefix, or access denied by the store."""


class StoreUnavailableError(StoreError):
    """The store did not answer: endpoint unreachable, timed out, or the transfer broke off."""


class AdapterCopyError(AdapterError):
    """A copy of an adapter in one tier cannot be used. ``deleted`` says if it was removed."""

    def __init__(self, message: str, *, name: str = "", tier: str = "", path: str = "") -> None:
        super().__init__(message)
        self.name = name
        self.tier = tier
        self.path = path
        self.deleted = False

    def mark_deleted(self) -> None:
        """Record (in the message too) that the owner removed the bad copy."""
        self.deleted = True
        self.args = (f"{self.args[0]}; the bad copy was deleted",)


class AdapterCorruptError(AdapterCopyError):
    """The copy's files are missing, truncated or do not parse."""


class AdapterIntegrityError(AdapterCopyError):
    """The copy parses but its content digest is not the expected sha256."""

    def __init__(
        self,
        message: str,
        *,
        name: str = "",
        tier: str = "",
        path: str = "",
        expected: str = "",
        actual: str = "",
    ) -> None:
        super().__init__(message, name=name, tier=tier, path=path)
        self.expected = expected
        self.actual = actual
