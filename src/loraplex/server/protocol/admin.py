"""The bodies of the adapter routes: vLLM's load and unload, loraplex's pin and evict, and the
registry's admin operations (register, promote, canary, rollback, disable) and feedback."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from loraplex.registry.records import MAX_CONCURRENT_REQUESTS
from loraplex.server.protocol.base import Body, Text
from loraplex.warm import WarmPolicy


class LoadLoRAAdapterRequest(Body):
    """vLLM's ``POST /v1/load_lora_adapter`` body."""

    lora_name: Text = Field(min_length=1)
    lora_path: Text = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(Body):
    """vLLM's ``POST /v1/unload_lora_adapter`` body."""

    lora_name: Text = Field(min_length=1)
    lora_int_id: int | None = None


class PinLoRAAdapterRequest(Body):
    """``POST /v1/pin_lora_adapter``: never evict the adapter (``device``: keep its slot too)."""

    lora_name: str = Field(min_length=1)
    device: bool = False


class EvictLoRAAdapterRequest(Body):
    """``POST /v1/evict_lora_adapter``: drop the adapter's copies from ``tiers`` (default all)."""

    lora_name: str = Field(min_length=1)
    tiers: list[Literal["device", "host", "disk"]] | None = None


class _AdminBody(BaseModel):
    """Admin bodies refuse unknown fields: a typo must not silently change what is registered."""

    model_config = ConfigDict(extra="forbid", strict=True)


class RegisterAdapterRequest(_AdminBody):
    """``POST /v1/admin/adapters``: register (validate) a revision; optionally stage or activate."""

    name: Text = Field(min_length=1, max_length=200)
    path: Text = Field(min_length=1)
    revision: Text | None = Field(default=None, min_length=1, max_length=100)
    tenant: Text | None = None
    source_uri: Text | None = None
    priority: int = 0
    slo_class: Text | None = None
    warm_policy: WarmPolicy = "on-demand"
    # a warm policy string or a window schedule ({"device": "Mon-Fri 08:00-18:00", "tz": ...});
    # dict first as in every such union: typing caches one member order per set of members
    warm: dict[str, Any] | Text | None = None
    signature: Text | None = None
    stage: bool = False
    activate: bool = False
    max_concurrent_requests: int | None = Field(default=None, ge=1, le=MAX_CONCURRENT_REQUESTS)


class PromoteAdapterRequest(_AdminBody):
    """``POST /v1/admin/adapters/{name}/promote``: make ``revision`` (default: the canary) active."""

    revision: Text | None = None


class CanaryPolicyBody(_AdminBody):
    """A canary's health bounds and concurrency cap (see :class:`loraplex.registry.CanaryPolicy`;
    the registry checks the values)."""

    window_s: float = 300.0
    min_requests: int = 20
    max_error_rate: float | None = 0.05
    max_ttft_p95_s: float | None = None
    max_tpot_p95_s: float | None = None
    min_quality: float | None = None
    scorer: Text | None = None
    max_concurrent_requests: int | None = None


class CanaryAdapterRequest(_AdminBody):
    """``POST /v1/admin/adapters/{name}/canary``: send ``weight`` of the traffic to ``revision``."""

    revision: Text = Field(min_length=1)
    weight: float = Field(gt=0, le=1)
    policy: CanaryPolicyBody | None = None  # health bounds: rolled back automatically on a breach


class RollbackAdapterRequest(_AdminBody):
    """``POST /v1/admin/adapters/{name}/rollback``: why (recorded in the audit log)."""

    reason: Text = Field(default="manual", min_length=1, max_length=500)


class AdapterFeedbackRequest(_AdminBody):
    """``POST /v1/adapters/{name}/feedback``: a user's score in [0, 1] of a response served by
    ``revision`` (the ``x-loraplex-adapter`` header names it): the canary's quality signal."""

    revision: str = Field(min_length=1, max_length=100)
    score: float = Field(ge=0, le=1)


class DisableAdapterRequest(_AdminBody):
    """``POST /v1/admin/adapters/{name}/disable``: take ``revision`` (default: the active one) out
    of service."""

    revision: Text | None = None
