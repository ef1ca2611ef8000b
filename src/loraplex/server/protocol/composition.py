"""The request fields that name the adapters a call runs with beyond ``model``, and their scales.

Three spellings, one meaning (``y = W x + sum_i scale_i * (alpha_i / r_i) * B_i A_i x``):

- ``lora_scale`` (vLLM PR #52757's ``LoRARequest.lora_scale``): the scale of the adapter
  ``model`` names, 1.0 by default, on top of its own alpha / r. A scale is not a new adapter.
- ``merged_adapters`` (LoRAX): ``{"ids": [...], "weights": [...], "merge_strategy": "linear",
  "majority_sign_method": ..., "density": ...}``. ``linear`` (or no strategy: LoRAX's default)
  is served exactly, as the weighted sum of the adapters' deltas (``weights`` default to 1
  each); ``density`` and ``majority_sign_method`` are checked as LoRAX's client checks them
  and have no effect on it. The strategies that change the
  weights (``ties``, ``dare_linear``, ``dare_ties``, PEFT's ``cat``, ``svd``, ...) are registry
  operations, not per-request arithmetic: the 400 names where to find them.
- ``lora_requests`` (after vLLM RFC #51940 and vllm-omni's ``lora_requests``): a list of
  ``{"lora_name": ..., "lora_scale": ...}`` (``name`` / ``scale`` are accepted too).

Every list is bounded by :data:`~loraplex.types.MAX_COMPOSED_ADAPTERS` before its items are
validated; every scale is finite and at most :data:`MAX_LORA_SCALE` in magnitude. Resolving the
names (tenant, active revision, canary, base model) is the server's
(:mod:`loraplex.server.composition`).
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AliasChoices, BeforeValidator, Field

from loraplex.server.protocol.base import Body, Text
from loraplex.types import MAX_COMPOSED_ADAPTERS, InvalidRequestError

MAX_LORA_SCALE = 100.0
"""Largest magnitude of a per-request adapter scale: far beyond any useful strength (a delta
100 times its trained size), small enough that no float16 activation overflows from it alone."""

LINEAR = "linear"
WEIGHT_MERGES = ("ties", "dare_linear", "dare_ties", "cat", "svd", "ties_svd", "dare_linear_svd",
                 "dare_ties_svd", "magnitude_prune", "magnitude_prune_svd")  # fmt: skip
"""Merge strategies (LoRAX's and PEFT's ``add_weighted_adapter``) that write new weights."""
MERGE_ROUTE = "POST /v1/admin/adapters/merge"
MERGE_CLI = "loraplex registry merge"
SIGN_METHODS = ("total", "frequency")


def _bounded(value: Any) -> Any:
    """A list of components: at most MAX_COMPOSED_ADAPTERS, checked before any item is."""
    if isinstance(value, list) and len(value) > MAX_COMPOSED_ADAPTERS:
        raise ValueError(
            f"at most {MAX_COMPOSED_ADAPTERS} adapters can be composed in one request "
            f"(got {len(value)})"
        )
    return value


BoundedNames = Annotated[list[Text], BeforeValidator(_bounded)]
BoundedScales = Annotated[list[float], BeforeValidator(_bounded)]


class MergedAdapters(Body):
    """LoRAX's ``merged_adapters``."""

    ids: BoundedNames
    weights: BoundedScales | None = None
    merge_strategy: Text | None = None  # None: linear (LoRAX's default)
    majority_sign_method: Text | None = None
    density: float | None = None


class LoRAComponent(Body):
    """One entry of ``lora_requests``: an adapter name and its scale."""

    lora_name: Text = Field(validation_alias=AliasChoices("lora_name", "name"))
    lora_scale: float = Field(default=1.0, validation_alias=AliasChoices("lora_scale", "scale"))


LoRAComponents = Annotated[list[LoRAComponent], BeforeValidator(_bounded)]


class AdapterFields(Body):
    """The adapter fields completions and chat share (mixed into their bodies)."""

    lora_scale: float | None = None
    merged_adapters: MergedAdapters | None = None
    lora_requests: LoRAComponents | None = None

    def adapter_asks(self) -> list[tuple[str, float, str]] | None:
        """The adapters this body composes as ``(name, scale, param)`` in request order
        (``param`` names the field for errors), or None when it names only ``model`` (at
        ``lora_scale``: :meth:`model_scale`). 400 for a weight merge, mismatched lengths, a
        name twice, a scale out of bounds, or two ways of composing at once."""
        given = [f for f in ("merged_adapters", "lora_requests") if getattr(self, f) is not None]
        if len(given) > 1:
            raise InvalidRequestError(
                "send either merged_adapters or lora_requests, not both", param="lora_requests"
            )
        if given and self.lora_scale is not None:
            raise InvalidRequestError(
                f"lora_scale scales the adapter `model` names; with {given[0]} give each "
                "adapter its own scale instead",
                param="lora_scale",
            )
        asks: list[tuple[str, float, str]] = []
        if self.merged_adapters is not None:
            m = self.merged_adapters
            _check_merge(m)
            weights = m.weights if m.weights is not None else [1.0] * len(m.ids)
            if len(weights) != len(m.ids):
                raise InvalidRequestError(
                    f"merged_adapters.weights has {len(weights)} values for {len(m.ids)} ids; "
                    "give one weight per id (or none: 1 each)",
                    param="merged_adapters.weights",
                )
            asks = [(n, w, f"merged_adapters.ids[{i}]")
                    for i, (n, w) in enumerate(zip(m.ids, weights, strict=True))]  # fmt: skip
        elif self.lora_requests is not None:
            asks = [(c.lora_name, c.lora_scale, f"lora_requests[{i}]")
                    for i, c in enumerate(self.lora_requests)]  # fmt: skip
        else:
            return None
        if not asks:
            raise InvalidRequestError(f"{given[0]} names no adapter", param=given[0])
        seen: set[str] = set()
        for name, scale, param in asks:
            check_scale(scale, param)
            if name in seen:
                raise InvalidRequestError(
                    f"{param}: adapter `{name[:128]}` is named twice; give it once, with the sum "
                    "of its scales",
                    param=param,
                )
            seen.add(name)
        return asks

    def model_scale(self) -> float:
        """The scale of the adapter ``model`` names (``lora_scale``, 1.0 by default)."""
        scale = 1.0 if self.lora_scale is None else self.lora_scale
        check_scale(scale, "lora_scale")
        return scale


def check_scale(scale: float, param: str) -> None:
    """400 unless ``scale`` is finite with ``|scale| <= MAX_LORA_SCALE``."""
    if not math.isfinite(scale) or abs(scale) > MAX_LORA_SCALE:
        raise InvalidRequestError(
            f"{param}: an adapter scale must be a finite number in "
            f"[-{MAX_LORA_SCALE:g}, {MAX_LORA_SCALE:g}] (got {scale})",
            param=param,
        )


def _check_merge(m: MergedAdapters) -> None:
    """400 for a strategy that is not per-request arithmetic, or bad strategy parameters."""
    strategy = m.merge_strategy or LINEAR
    if strategy != LINEAR:
        known = "" if strategy in WEIGHT_MERGES else (
            f" (strategies: {LINEAR}, {', '.join(WEIGHT_MERGES)})"
        )  # fmt: skip
        raise InvalidRequestError(
            f"merged_adapters.merge_strategy {strategy[:64]!r} is not served per request{known}: "
            "it changes the adapters' weights, so it is a registry operation that writes a new, "
            f"signed and versioned adapter: `{MERGE_ROUTE}` (admin) or `{MERGE_CLI}`; then "
            f"request the merged adapter by name. merge_strategy {LINEAR!r} is served exactly, "
            "as the weighted sum of the adapters' deltas",
            param="merged_adapters.merge_strategy",
        )
    if m.majority_sign_method is not None and m.majority_sign_method not in SIGN_METHODS:
        raise InvalidRequestError(
            f"merged_adapters.majority_sign_method must be one of {', '.join(SIGN_METHODS)} "
            f"(got {m.majority_sign_method[:64]!r})",
            param="merged_adapters.majority_sign_method",
        )
    if m.density is not None and not (math.isfinite(m.density) and 0 <= m.density <= 1):
        raise InvalidRequestError(  # LoRAX's client always sends one; linear does not use it
            f"merged_adapters.density must be in [0, 1] (got {m.density})",
            param="merged_adapters.density",
        )
