"""Adapter registry (control plane): versioned manifests, lifecycle, signatures, releases with
canary and rollback, tenants and API keys, audit log. SQLite embedded, PostgreSQL by URL.

Never imports torch (nor the engine, cache or server): the CLI and tools use it standalone.
"""

from loraplex.registry.db import ADAPTER_STATUSES, default_url, loraplex_home
from loraplex.registry.errors import (
    ConflictError,
    NotFoundError,
    RegistryError,
    RegistryUnavailableError,
    TransitionError,
    ValidationError,
)
from loraplex.registry.inspect import BaseModelInfo, base_model_info
from loraplex.registry.lifecycle import TRANSITIONS
from loraplex.registry.policy import RegistryPolicy
from loraplex.registry.records import (
    SCOPES,
    AuditEntry,
    CanaryPolicy,
    Manifest,
    Principal,
    Release,
    RollbackEvent,
    Tenant,
    signed_payload,
)
from loraplex.registry.service import Registry

__all__ = [
    "ADAPTER_STATUSES",
    "SCOPES",
    "TRANSITIONS",
    "AuditEntry",
    "BaseModelInfo",
    "CanaryPolicy",
    "ConflictError",
    "Manifest",
    "NotFoundError",
    "Principal",
    "Registry",
    "RegistryError",
    "RegistryPolicy",
    "RegistryUnavailableError",
    "Release",
    "RollbackEvent",
    "Tenant",
    "TransitionError",
    "ValidationError",
    "base_model_info",
    "default_url",
    "loraplex_home",
    "signed_payload",
]
