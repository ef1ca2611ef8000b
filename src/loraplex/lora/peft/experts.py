"""The expert LoRA tensors of an adapter for a mixture-of-experts base, checked as
:func:`~loraplex.lora.peft.layout.check_layout` checks modules: per-expert keys or PEFT's
``target_parameters`` on the packed experts, of the base's shapes and expert count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from loraplex.checkpoint.modules import (
    EXPERT_CHECKPOINT_NAMES,
    EXPERT_PROJ_NAMES,
    PACKED_EXPERT_PARAMS,
    ROUTER,
    BaseModelSpec,
)
from loraplex.lora.peft.errors import FormatError
from loraplex.lora.peft.targets import LoraSettings
from loraplex.lora.peft.tensors import (
    EXPERT_KEY_RE,
    PACKED_KEY_RE,
    TensorMeta,
    check_factor_meta,
)


@dataclass(frozen=True)
class ExpertFactors:
    """The LoRA factors of one expert (per-expert keys: ``A [r, d_in]``, ``B [d_out, r]``), or of
    every expert at once (PEFT's ``target_parameters``: ``A [E r, d_in]`` expert-major,
    ``B [d_out, r E]`` rank-major: expert ``e``'s columns are ``e, E + e, 2 E + e, ...``)."""

    a_name: str
    b_name: str
    rank: int  # of one expert
    scale: float


@dataclass(frozen=True)
class ExpertModuleLayout:
    """One expert projection of one layer (every expert of it) as the tensors describe it:
    ``per_expert`` (keys per expert; None for an expert the config leaves alone, whose delta
    is zero) or ``packed`` (``target_parameters``), never both."""

    module: str  # the module key PEFT saw (per expert: the first expert's)
    num_experts: int
    rank: int  # rows per expert: the largest expert's rank
    per_expert: tuple[ExpertFactors | None, ...] | None = None
    packed: ExpertFactors | None = None
    b_rows: tuple[int, int, int] | None = None
    """The rows ``(start, stop, step)`` of the packed ``B`` this projection takes
    (``gate_up_proj``: gate's, up's; every other row of each where they interleave)."""
    in_out: bool = False
    """The packed parameter is stored ``[E, d_in, d_out]`` (``MoESpec.packed_in_out``): PEFT's
    ``A [E r, d_out]`` then expands and its ``B [d_in, r E]`` shrinks (``b_rows``: of ``A``'s
    columns)."""

    @property
    def tensor_names(self) -> tuple[str, ...]:
        factors = [self.packed] if self.packed is not None else list(self.per_expert or ())
        return tuple(n for f in factors if f is not None for n in (f.a_name, f.b_name))


class ExpertTensors:
    """The expert LoRA tensors of an adapter for a MoE base, collected by name and then checked
    as ``check_layout`` checks modules: per-expert keys (``experts.{e}.gate_proj``, Mixtral's
    ``experts.{e}.w1``) or PEFT's ``target_parameters`` on the packed parameters, each targeted
    by the config, of the base's shapes and expert count, of the configured rank; and every
    expert module the config targets present (not for ``all-linear``: on transformers 5 the
    experts are no linears, and PEFT's ``all-linear`` leaves them out)."""

    def __init__(
        self,
        spec: BaseModelSpec,
        settings: LoraSettings,
        tensors: Mapping[str, TensorMeta],
        max_rank: int,
    ) -> None:
        assert spec.moe is not None
        self.moe, self.settings, self.tensors, self.max_rank = spec.moe, settings, tensors, max_rank
        # (layer, proj) -> expert -> {"A": name, "B": name}; module key of each
        self.per_expert: dict[tuple[int, str], dict[int, dict[str, str]]] = {}
        self.expert_modules: dict[tuple[int, str, int], str] = {}
        # layer -> wrapper depth -> {"A": name, "B": name}; the module key of each layer
        self.packed: dict[int, dict[int, dict[str, str]]] = {}
        self.packed_modules: dict[int, str] = {}

    @property
    def any(self) -> bool:
        return bool(self.per_expert or self.packed)

    @property
    def modules(self) -> list[str]:
        return [*self.expert_modules.values(), *self.packed_modules.values()]

    def _add(self, slot: dict[str, str], ab: str, name: str) -> None:
        if ab in slot:
            raise FormatError("unsupported_tensor", f"tensor {name!r} duplicates {slot[ab]!r}")
        slot[ab] = name

    def collect(self, name: str) -> bool:
        """Take ``name`` if it is an expert LoRA tensor (False: not one)."""
        m = EXPERT_KEY_RE.match(name)
        if m is not None:
            layer, expert = int(m["layer"]), int(m["expert"])
            proj = EXPERT_CHECKPOINT_NAMES[m["block"]].get(m["proj"])
            if proj is None:
                names = ", ".join(EXPERT_CHECKPOINT_NAMES[m["block"]])
                raise FormatError(
                    "unsupported_target",
                    f"tensor {name!r}: expert module {m['proj']!r} is not supported (supported "
                    f"under {m['block']}: {names})",
                )
            self._check_where(name, layer, expert)
            self._add(self.per_expert.setdefault((layer, proj), {}).setdefault(expert, {}),
                      m["ab"], name)  # fmt: skip
            self.expert_modules[(layer, proj, expert)] = m["module"]
            return True
        m = PACKED_KEY_RE.match(name)
        if m is not None:
            layer = int(m["layer"])
            self._check_where(name, layer, 0)
            depth = m["inner"].count(".base_layer")
            self._add(self.packed.setdefault(layer, {}).setdefault(depth, {}), m["ab"], name)
            self.packed_modules[layer] = m["module"]
            return True
        return False

    def _check_where(self, name: str, layer: int, expert: int) -> None:
        moe = self.moe
        if layer not in moe.layers:
            raise FormatError(
                "shape_mismatch",
                f"tensor {name!r}: layer {layer} of the base model has no experts "
                f"(its sparse layers: {list(moe.layers)})",
            )
        if expert >= moe.num_experts:
            raise FormatError(
                "shape_mismatch",
                f"tensor {name!r}: expert {expert} >= the base model's num_experts "
                f"{moe.num_experts} (adapter made for a model with more experts?)",
            )

    def _factors(self, mkey: str, a_name: str, b_name: str, experts: int) -> ExpertFactors:
        """Check one A/B pair of ``experts`` experts' rows (1: a per-expert pair)."""
        a, b = self.tensors[a_name], self.tensors[b_name]
        check_factor_meta(a_name, a, b_name, b)
        rows = a.shape[0]
        if b.shape[1] != rows:
            raise FormatError(
                "shape_mismatch",
                f"rank mismatch in {mkey}: {a_name!r} has {rows} rows, {b_name!r} {b.shape[1]}",
            )
        if rows % experts:
            raise FormatError(
                "shape_mismatch",
                f"tensor {a_name!r}: {rows} rows are not a rank for each of the base model's "
                f"{experts} experts (adapter made for a different expert count?)",
            )
        rank = rows // experts
        cfg_rank, scale = self.settings.rank_and_scale(mkey)
        if rank != cfg_rank:
            raise FormatError(
                "shape_mismatch",
                f"tensor {a_name!r}: rank {rank} != configured rank {cfg_rank} "
                f"({self.settings.rank_field(mkey)})",
            )
        if rank > self.max_rank:
            raise FormatError(
                "rank_too_large", f"tensor {a_name!r}: rank {rank} > max_lora_rank {self.max_rank}"
            )
        return ExpertFactors(a_name, b_name, rank, scale)

    def _check_dims(self, mkey: str, f: ExpertFactors, d_in: int, d_out: int) -> None:
        a, b = self.tensors[f.a_name].shape, self.tensors[f.b_name].shape
        if a[1] != d_in or b[0] != d_out:
            raise FormatError(
                "shape_mismatch",
                f"module {mkey}: A {list(a)} and B {list(b)}, expected A [r, d_in={d_in}] and "
                f"B [d_out={d_out}, r] (adapter made for a different base model?)",
            )

    def _complete(self, pair: dict[str, str], mkey: str) -> tuple[str, str]:
        for ab in "AB":
            if ab not in pair:
                raise FormatError("incomplete_adapter", f"module {mkey}: lora_{ab} weight missing")
        return pair["A"], pair["B"]

    def _strict(self) -> bool:
        tm = self.settings.target_modules
        return not (isinstance(tm, str) and tm.lower() == "all-linear")

    def layouts(
        self, prefix: str, router_seen: set[tuple[int, str]]
    ) -> dict[tuple[int, str], ExpertModuleLayout]:
        """The expert modules, each checked; a targeted one without tensors is refused."""
        moe, settings, shapes = self.moe, self.settings, self.moe.shapes
        n = moe.num_experts
        out: dict[tuple[int, str], ExpertModuleLayout] = {}
        block = moe.block
        for layer, depths in sorted(self.packed.items()):
            base = self.packed_modules[layer]
            for pair in depths.values():
                a_name, b_name = self._complete(pair, base)
                d_in, d_out = self.tensors[a_name].shape[1], self.tensors[b_name].shape[0]
                if moe.packed_in_out:  # PEFT took [E, d_in, d_out] for [E, d_out, d_in]
                    d_in, d_out = d_out, d_in
                param = next(
                    (p for p, parts in PACKED_EXPERT_PARAMS.items()
                     if (d_in, d_out) == (shapes[parts[0]][0],
                                          sum(shapes[q][1] for q in parts))),
                    None,
                )  # fmt: skip
                if param is None:
                    raise FormatError(
                        "shape_mismatch",
                        f"tensor {a_name!r}: A {list(self.tensors[a_name].shape)} and B "
                        f"{list(self.tensors[b_name].shape)} fit neither of the base model's "
                        "packed experts (gate_up_proj, down_proj)",
                    )
                mkey = f"{base}.{param}"
                if not settings.is_param_targeted(mkey):
                    raise FormatError(
                        "unsupported_tensor",
                        f"tensor {a_name!r}: parameter {mkey} is not targeted by the config "
                        "(target_parameters / layers_to_transform)",
                    )
                f = self._factors(mkey, a_name, b_name, n)
                lo = 0
                interleaved = moe.gate_up_interleaved and len(PACKED_EXPERT_PARAMS[param]) > 1
                for k, part in enumerate(PACKED_EXPERT_PARAMS[param]):
                    hi = lo + shapes[part][1]
                    rows = (k, d_out, 2) if interleaved else (lo, hi, 1)
                    if (layer, part) in out or (layer, part) in self.per_expert:
                        raise FormatError(
                            "unsupported_tensor",
                            f"module {mkey}: adapted twice (packed and per expert?)",
                        )
                    out[(layer, part)] = ExpertModuleLayout(
                        mkey, n, f.rank, packed=f, b_rows=rows, in_out=moe.packed_in_out
                    )
                    lo = hi
        for (layer, proj), by_expert in sorted(self.per_expert.items()):
            if (layer, proj) in out:
                raise FormatError(
                    "unsupported_tensor",
                    f"layer {layer} {proj}: adapted twice (packed and per expert?)",
                )
            d_in, d_out = shapes[proj]
            factors: list[ExpertFactors | None] = [None] * n
            for e, pair in by_expert.items():
                mkey = self.expert_modules[(layer, proj, e)]
                if not settings.is_targeted(mkey):
                    raise FormatError(
                        "unsupported_tensor",
                        f"tensor {pair.get('A', pair.get('B'))!r}: module {mkey} is not targeted "
                        "by the config (target_modules / layers_to_transform / exclude_modules)",
                    )
                f = self._factors(mkey, *self._complete(pair, mkey), 1)
                self._check_dims(mkey, f, d_in, d_out)
                factors[e] = f
            first = self.expert_modules[(layer, proj, min(by_expert))]
            rank = max(f.rank for f in factors if f is not None)
            out[(layer, proj)] = ExpertModuleLayout(first, n, rank, per_expert=tuple(factors))
        # what the config targets must be there
        names = {v: k for k, v in EXPERT_CHECKPOINT_NAMES[block].items()}
        for layer in moe.layers:
            for param, parts in PACKED_EXPERT_PARAMS.items():
                mkey = f"{prefix}layers.{layer}.{moe.under(f'experts.{param}', moe.v5_block)}"
                if settings.is_param_targeted(mkey) and any((layer, q) not in out for q in parts):
                    raise FormatError(
                        "incomplete_adapter",
                        f"parameter {mkey} is targeted by the config (target_parameters) but "
                        "has no LoRA tensors (adapter made for another model?)",
                    )
            router = f"{prefix}layers.{layer}.{moe.under(moe.router_name)}"
            router_v5 = f"{prefix}layers.{layer}.{moe.under(moe.router_name, moe.v5_block)}"
            wants_router = settings.is_param_targeted(f"{router_v5}.weight") or (
                self._strict() and settings.is_targeted(router)
            )
            if wants_router and (layer, ROUTER) not in router_seen:
                raise FormatError(
                    "incomplete_adapter",
                    f"module {router} is targeted by the config but has no LoRA tensors",
                )
            if not self._strict() or not moe.per_expert_modules:
                continue  # (packed-only experts have no per-expert modules a name could target)
            for proj in EXPERT_PROJ_NAMES:
                if (layer, proj) in out and out[(layer, proj)].packed is not None:
                    continue
                have = self.per_expert.get((layer, proj), {})
                for e in range(moe.num_experts):
                    mkey = f"{prefix}layers.{layer}.{moe.under(f'experts.{e}.{names[proj]}')}"
                    if e not in have and settings.is_targeted(mkey):
                        raise FormatError(
                            "incomplete_adapter",
                            f"module {mkey} is targeted by the config (target_modules / "
                            "layers_to_transform) but has no LoRA tensors (adapter made for a "
                            "model with fewer experts?)",
                        )
        return out
