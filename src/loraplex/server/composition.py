"""Which adapters, at which scales, serve one call: the body's ``model`` and its composition
fields (:mod:`loraplex.server.protocol.composition`) resolved to a :data:`Served`.

How ``model`` and a composition combine: with ``merged_adapters`` or ``lora_requests`` the
composition is the call's adapters, and ``model`` names either the base model (LoRAX's rule:
``adapter_id`` and ``merged_adapters`` exclude each other) or one of the composed adapters
(the issue's own example, ``model: alpha`` with alpha among the ids: it adds nothing); any
other name is a 400 rather than silently dropped, and says nothing about whether that name
exists. Without them, ``model`` is the adapter, at ``lora_scale``.

Each component is resolved exactly as ``model`` is (:meth:`ServerState.resolve_adapter`):
visible to the caller's tenant (an unknown name and another tenant's give the same 400), its
active revision or its canary by the traffic weight, registered for the served base model,
its files under the allowed roots. A single adapter at scale 1 is the plain
:class:`ServedAdapter`, exactly as before; anything else is a :class:`ServedComposition`, whose
:attr:`~ServedComposition.adapter` is the engine's
:class:`~loraplex.types.AdapterComposition`.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.registry import Principal
from loraplex.server.errors import APIError
from loraplex.server.protocol.composition import AdapterFields
from loraplex.server.state import ServedAdapter, ServerState
from loraplex.types import AdapterComposition, AdapterSpec, InvalidRequestError, ScaledAdapter


@dataclass(frozen=True)
class ServedComposition:
    """Several adapter revisions (or one at a scale other than 1) serving one call, in request
    order, each with its scale and the route (active or canary) its revision was chosen by."""

    parts: tuple[ServedAdapter, ...]
    scales: tuple[float, ...]

    @property
    def adapter(self) -> AdapterComposition:
        """What the engine runs: the sum of the scaled deltas."""
        return AdapterComposition(
            tuple(ScaledAdapter(p.spec, s) for p, s in zip(self.parts, self.scales, strict=True))
        )

    @property
    def name(self) -> str:
        """For metrics and logs: ``alpha*1+style*0.5``."""
        return self.adapter.name


Served = ServedAdapter | ServedComposition
"""The adapters of one call (None where the base model serves it)."""


def parts_of(lora: Served | None) -> tuple[tuple[ServedAdapter, float], ...]:
    """Each adapter revision of a call with its scale (none for the base model)."""
    if lora is None:
        return ()
    if isinstance(lora, ServedAdapter):
        return ((lora, 1.0),)
    return tuple(zip(lora.parts, lora.scales, strict=True))


def engine_adapter(lora: Served | None) -> AdapterSpec | AdapterComposition | None:
    """The ``GenerationRequest.adapter`` of a call."""
    if lora is None:
        return None
    return lora.spec if isinstance(lora, ServedAdapter) else lora.adapter


def served_name(lora: Served | None) -> str | None:
    """The name metrics and logs give a call's adapters (None: the base model)."""
    if lora is None:
        return None
    return lora.spec.name if isinstance(lora, ServedAdapter) else lora.name


def resolve_served(state: ServerState, body: AdapterFields, principal: Principal) -> Served | None:
    """The adapters that serve a call of ``body`` (``model`` plus its composition fields), each
    resolved for ``principal``; None for the base model alone. Every bound is checked before
    anything is resolved; 400s name the field at fault. I/O pool only (it reads the registry
    view and the adapters' files)."""
    model: str = body.model  # type: ignore[attr-defined]
    try:
        asks = body.adapter_asks()
    except InvalidRequestError as e:  # its words name routes, which scrubbing would blank out
        raise APIError(400, str(e), param=e.param) from e
    if asks is None:
        scale = body.model_scale()
        lora = state.resolve_model(model, principal)
        if lora is None:
            if scale != 1.0:
                raise APIError(
                    400,
                    f"lora_scale scales an adapter, and `model` names the base model `{model}`",
                    param="lora_scale",
                )
            return None
        return lora if scale == 1.0 else ServedComposition((lora,), (scale,))
    field = asks[0][2].partition("[")[0].partition(".")[0]
    if model not in state.base_names and model not in {name for name, _, _ in asks}:
        raise APIError(
            400,
            f"`model` is {model[:256]!r}, which is neither the base model nor one of the adapters "
            f"{field} composes; name the base model (`{state.base_names[0]}`) or one of them",
            param="model",
        )
    parts = tuple(state.resolve_adapter(name, principal, param=p) for name, _, p in asks)
    scales = tuple(float(s) for _, s, _ in asks)
    by_digest: dict[str, str] = {}
    for (name, _, param), part in zip(asks, parts, strict=True):
        other = by_digest.setdefault(part.spec.sha256, name)
        if other != name:
            raise APIError(
                400,
                f"{param}: adapters `{other}` and `{name}` are the same weights (sha256 "
                f"{part.spec.sha256[:12]}...); name them once, with the sum of their scales",
                param=param,
            )
    if len(parts) == 1 and scales[0] == 1.0:
        return parts[0]
    return ServedComposition(parts, scales)
