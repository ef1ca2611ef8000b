"""What the planner needs of an adapter: its rank per (layer, module) on a base, from a PEFT
config (with the loader's own module selection) or a PEFT directory (its weights' header, no
tensor data read), and its parameters by part."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraplex.checkpoint.modules import (
    ATTN_PROJ_NAMES,
    EMBED_TOKENS,
    EXPERT_CHECKPOINT_NAMES,
    FUSED_PROJ_NAMES,
    LAYER_MODULE_ORDER,
    LINEAR_ATTN_PROJ_NAMES,
    PACKED_EXPERT_PARAMS,
    PER_LAYER_INPUT_PROJ_NAMES,
    PER_LAYER_MODEL_PROJECTION,
    ROUTER,
    SHARED_EXPERT_GATE,
    SHARED_EXPERT_PROJ_NAMES,
    VOCAB_LAYER,
    VOCAB_MODULES,
    module_key,
    vocab_module_key,
)
from loraplex.checkpoint.safetensors import SafetensorsError, TensorInfo, safetensors_header
from loraplex.lora.peft.config import parse_lora_config
from loraplex.lora.peft.errors import FormatError
from loraplex.lora.peft.files import CONFIG_NAME, SAFETENSORS_NAME
from loraplex.lora.peft.targets import LoraSettings
from loraplex.lora.peft.tensors import EXPERT_KEY_RE, OTHER_TOWER_RE, ROUTER_KEY_RE
from loraplex.tools.plan.model_shape import (
    ALL_FUSED,
    PACKED_GATE_UP,
    ModelShape,
    PlanError,
    read_json_object,
)

PARTS = ("attention", "mlp", "router", "experts", "vocab", "per_layer")
"""An adapter's parts, as reported: attention projections, a dense MLP's, the router of a sparse
layer, its experts, ``embed_tokens`` / ``lm_head``, and Gemma 4's per-layer input modules."""
PART_NAMES = {"attention": "attention", "mlp": "dense MLP", "router": "router",
              "experts": "experts", "vocab": "embed_tokens/lm_head",
              "per_layer": "per-layer inputs"}  # fmt: skip


def part_of(proj: str) -> str:
    """The part (:data:`PARTS`) a module of an adapter belongs to."""
    if proj in VOCAB_MODULES:
        return "vocab"
    if proj in (*PER_LAYER_INPUT_PROJ_NAMES, PER_LAYER_MODEL_PROJECTION):
        return "per_layer"
    if proj == ROUTER:
        return "router"
    if proj.startswith("experts."):
        return "experts"
    return "attention" if proj in ATTN_PROJ_NAMES else "mlp"


@dataclass
class AdapterShape:
    """An adapter's rank per (layer, module) it adapts; ``file_*`` from its safetensors.

    An expert module (``experts.gate_proj`` / ``experts.up_proj`` / ``experts.down_proj`` of
    per-expert keys, or PEFT's packed ``experts.gate_up_proj`` / ``experts.down_proj``) holds
    every expert's factors: ``modules`` has its largest expert's rank (the rows it takes in a
    slot), ``expert_ranks`` each expert's (0: an expert it leaves alone)."""

    name: str
    modules: dict[tuple[int, str], int]  # (layer, proj) -> rank
    file_params: int | None = None
    file_bytes: int | None = None
    notes: list[str] = field(default_factory=list)
    expert_ranks: dict[tuple[int, str], tuple[int, ...]] = field(default_factory=dict)
    packed: set[tuple[int, str]] = field(default_factory=set)
    """The expert modules of PEFT's ``target_parameters`` (the others: per-expert keys)."""
    alora: bool = False
    """An activated LoRA (``alora_invocation_tokens``): the KV before its invocation is the base
    model's, shared (``loraplex.tools.plan.sharing``)."""

    @property
    def expert_layout(self) -> str | None:
        """``per_expert``, ``packed`` (``target_parameters``), ``mixed``, or None (no experts)."""
        per = any(key not in self.packed for key in self.expert_ranks)
        if self.packed:
            return "mixed" if per else "packed"
        return "per_expert" if per else None

    @property
    def max_rank(self) -> int:
        return max(self.modules.values(), default=0)

    @property
    def targets(self) -> list[str]:
        names = (*VOCAB_MODULES, *LAYER_MODULE_ORDER, *FUSED_PROJ_NAMES, PACKED_GATE_UP,
                 PER_LAYER_MODEL_PROJECTION)  # fmt: skip
        return [p for p in names if any(q == p for _, q in self.modules)]

    @property
    def layers(self) -> int:
        return len({layer for layer, _ in self.modules if layer != VOCAB_LAYER})

    @property
    def adapted_experts(self) -> int:
        """The most experts any one expert module adapts (0: no expert modules)."""
        return max((sum(r > 0 for r in rs) for rs in self.expert_ranks.values()), default=0)

    def module_params(self, m: ModelShape, key: tuple[int, str]) -> int:
        """One module's parameters: r x (d_in + d_out), an expert module's summed over its
        experts."""
        ranks = self.expert_ranks.get(key)
        dims = m.dims(key[1], key[0])
        return sum(dims) * (sum(ranks) if ranks is not None else self.modules[key])

    def params(self, m: ModelShape) -> int:
        return sum(self.module_params(m, key) for key in self.modules)

    def part_params(self, m: ModelShape) -> dict[str, int]:
        """Parameters by part (:data:`PARTS`; the parts it has)."""
        out = dict.fromkeys(PARTS, 0)
        for key in self.modules:
            out[part_of(key[1])] += self.module_params(m, key)
        return {p: n for p, n in out.items() if n}

    def decode_params(self, m: ModelShape, tokens: int = 1) -> int:
        """Parameters a decode step with ``tokens`` tokens of this adapter reads in full: all
        but an embedding LoRA's A, which is gathered by token id (a few rows); a fused module's
        LoRA as the engine holds it, split into its parts (A once per part, B by rows); of an
        expert module only the experts the tokens route to, at most
        ``min(adapted experts, tokens x top-k)`` (its largest ranks)."""
        r_embed = self.modules.get((VOCAB_LAYER, EMBED_TOKENS), 0)
        read = m.experts_read(tokens)
        total = 0
        for key, r in self.modules.items():
            split = sum(sum(m.dims(q, key[0])) for q in ALL_FUSED.get(key[1], (key[1],)))
            ranks = self.expert_ranks.get(key)
            total += split * (r if ranks is None else sum(sorted(ranks, reverse=True)[:read]))
        return total - r_embed * m.vocab_size


PER_EXPERT_NOTE = (
    "experts counted per expert (the layout PEFT saves where experts are linears, "
    "transformers 4); PEFT on transformers 5 trains these targets on the packed experts "
    "instead (target_parameters, gate_up_proj at rank 2r: slots of 2r rows)"
)
"""The note on a per-expert adapter priced from its config alone (no weights file)."""


def _is_all_linear(targets: Any) -> bool:
    return isinstance(targets, str) and targets.lower() == "all-linear"


def _sparse_layer_modules(
    settings: LoraSettings, m: ModelShape, layer: int, a: AdapterShape
) -> None:
    """Add the router and expert modules of sparse ``layer`` the config targets, as the loader
    reads the config: the router by ``target_modules`` (``gate``) or ``target_parameters``
    (``mlp.gate.weight``), the packed experts by ``target_parameters``, the per-expert modules
    by ``target_modules`` expert by expert (``all-linear`` as it was while experts and router
    were linears: all of them); packed wins where both name a projection."""
    pre, block, n = f"model.layers.{layer}", m.moe_block, m.num_experts
    moe = m.moe
    assert moe is not None
    router = f"{pre}.{moe.under(moe.router_name)}"
    router_v5 = f"{pre}.{moe.under(moe.router_name, moe.v5_block)}"
    if settings.is_targeted(router):
        a.modules[(layer, ROUTER)] = int(settings.rank_of(router))
    elif settings.is_param_targeted(f"{router_v5}.weight"):
        a.modules[(layer, ROUTER)] = int(settings.rank_of(router_v5))
    shared = (*SHARED_EXPERT_PROJ_NAMES, *((SHARED_EXPERT_GATE,) if moe.shared_gate else ()))
    for proj in shared if moe.shared_intermediate else ():
        if settings.is_targeted(full := f"{pre}.{block}.{proj}"):
            a.modules[(layer, proj)] = int(settings.rank_of(full))
    packed: set[str] = set()
    for param, parts in PACKED_EXPERT_PARAMS.items():
        full = f"{pre}.{moe.under(f'experts.{param}', moe.v5_block)}"
        if settings.is_param_targeted(full):
            name = PACKED_GATE_UP if len(parts) > 1 else parts[0]
            r = int(settings.rank_of(full))
            a.modules[(layer, name)], a.expert_ranks[(layer, name)] = r, (r,) * n
            a.packed.add((layer, name))
            packed.update(parts)
    for ckpt, proj in EXPERT_CHECKPOINT_NAMES[block].items():
        if proj in packed or not moe.per_expert_modules:  # packed-only experts: no
            continue  # per-expert keys
        keys = [f"{pre}.{block}.experts.{e}.{ckpt}" for e in range(n)]
        ranks = tuple(int(settings.rank_of(k)) if settings.is_targeted(k) else 0 for k in keys)
        if any(ranks):
            a.modules[(layer, proj)], a.expert_ranks[(layer, proj)] = max(ranks), ranks


def adapter_from_config(cfg: dict[str, Any], m: ModelShape, name: str) -> AdapterShape:
    """(layer, module) -> rank for a PEFT LoraConfig (``r``/``rank``, ``target_modules``,
    ``exclude_modules``, ``layers_to_transform``/``layers_pattern``, ``rank_pattern``; on a MoE
    base also ``target_parameters`` on the packed experts and the router) applied to the
    model's layers with the loader's own module selection (``LoraSettings``)."""
    r = cfg.get("r", cfg.get("rank"))
    targets = cfg.get("target_modules")
    params = cfg.get("target_parameters")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise PlanError(f"adapter {name}: rank (r) must be an integer >= 1, got {r!r}")
    if params:
        try:  # the loader's rules for target_parameters
            parse_lora_config({"peft_type": "LORA", "r": r, "target_modules": targets,
                               "target_parameters": params})  # fmt: skip
        except FormatError as e:
            raise PlanError(f"adapter {name}: {e}") from None
        if not m.is_moe:
            raise PlanError(
                f"adapter {name}: target_parameters {params!r} name a mixture-of-experts base's "
                f"experts or router; {m.name} is a dense model"
            )
    elif not (isinstance(targets, str) or (isinstance(targets, list) and targets)):
        raise PlanError(f"adapter {name}: target_modules must be a string or a non-empty list")
    layers = cfg.get("layers_to_transform")
    wanted = [layers] if isinstance(layers, int) else (layers or [])
    if not set(wanted) <= set(range(m.num_layers)):
        raise PlanError(
            f"adapter {name}: layers_to_transform {sorted(wanted)} beyond the model's "
            f"{m.num_layers} layers"
        )
    settings = LoraSettings.of({**cfg, "r": r, "target_modules": targets or []})
    a = AdapterShape(name, {}, alora=bool(cfg.get("alora_invocation_tokens")))
    sparse = set(m.sparse)
    block_shapes = m.moe.shapes if m.moe is not None else {}
    dense_mlp = m.moe is not None and m.moe.dense_mlp  # Gemma 4: the MLP beside the block
    try:
        for v in m.outer_modules:
            full = vocab_module_key(v)
            if settings.is_targeted(full):
                a.modules[(VOCAB_LAYER, v)] = int(settings.rank_of(full))
        for layer in range(m.num_layers):
            for p in m.layer_adapter_projs(layer):
                own = p in (*ATTN_PROJ_NAMES, *LINEAR_ATTN_PROJ_NAMES) or (
                    dense_mlp and p not in block_shapes
                )
                if layer in sparse and not own:
                    continue  # a sparse layer's block (router, experts, shared): below
                full = module_key(layer, p, mlp=m.moe.mlp_block if m.moe else "mlp")
                if settings.is_targeted(full):
                    a.modules[(layer, p)] = int(settings.rank_of(full))
            if layer in sparse:
                _sparse_layer_modules(settings, m, layer, a)
    except (re.error, TypeError, ValueError) as e:
        raise PlanError(
            f"adapter {name}: bad target_modules / exclude_modules / rank_pattern ({e})"
        ) from None
    if not a.modules:
        what = f"target_modules {targets!r}"
        what += f" / target_parameters {params!r}" if params else ""
        raise PlanError(
            f"adapter {name}: {what} match none of the model's modules "
            f"({', '.join(m.adapter_names)}): this adapter would change nothing"
        )
    if a.expert_layout in ("per_expert", "mixed"):
        a.notes.append(PER_EXPERT_NOTE)
    return a


def _header_experts(header: dict[str, TensorInfo], m: ModelShape, a: AdapterShape) -> None:
    """Replace the router and per-expert modules of an ``all-linear`` adapter on a MoE base
    (which the loader serves if present and does not require) by those its weights hold, ranks
    from the A shapes."""
    moe_layers = set(m.sparse)
    for key in [k for k in a.expert_ranks if k not in a.packed]:
        del a.modules[key], a.expert_ranks[key]
    for key in [k for k in a.modules if k[1] == ROUTER]:
        del a.modules[key]
    ranks: dict[tuple[int, str], list[int]] = {}
    for key, t in header.items():
        if (hit := EXPERT_KEY_RE.match(key)) is not None and hit["ab"] == "A":
            layer, e = int(hit["layer"]), int(hit["expert"])
            proj = EXPERT_CHECKPOINT_NAMES[hit["block"]].get(hit["proj"])
            if proj is not None and layer in moe_layers and e < m.num_experts:
                ranks.setdefault((layer, proj), [0] * m.num_experts)[e] = int(t.shape[0])
        elif (hit := ROUTER_KEY_RE.match(key)) is not None and hit["ab"] == "A":
            if int(hit["layer"]) in moe_layers:
                a.modules[(int(hit["layer"]), ROUTER)] = int(t.shape[0])
    for key, rs in ranks.items():
        if key not in a.expert_ranks:  # packed wins, as in the config
            a.modules[key], a.expert_ranks[key] = max(rs), tuple(rs)


def _read_header(path: Path) -> dict[str, TensorInfo]:
    try:
        return safetensors_header(path)
    except (OSError, SafetensorsError) as e:
        raise PlanError(f"cannot read the safetensors header of {path}: {e}") from None


def _safetensors_stats(
    path: Path | dict[str, TensorInfo], text_only: bool = False
) -> tuple[int, int]:
    """(LoRA parameters, their bytes) from a safetensors header (no tensor data read); on a
    multimodal base's language model, of the text backbone only (what is served)."""
    header = _read_header(path) if isinstance(path, Path) else path
    lora = [
        t
        for key, t in header.items()
        if "lora_" in key and not (text_only and OTHER_TOWER_RE.match(key))
    ]
    return sum(math.prod(t.shape) for t in lora), sum(t.nbytes for t in lora)


def adapter_from_path(spec: str, m: ModelShape) -> AdapterShape:
    """A PEFT directory, its adapter_config.json, or a JSON manifest (``r``/``rank`` and
    ``target_modules``, or an ``adapter_config`` / ``config`` object holding them)."""
    p = Path(spec)
    cfg_path = p / CONFIG_NAME if p.is_dir() else p
    if not cfg_path.is_file():
        raise PlanError(f"--adapter {spec!r}: no such PEFT directory or JSON file")
    cfg = read_json_object(cfg_path)
    for key in ("adapter_config", "config"):
        if "r" not in cfg and "rank" not in cfg and isinstance(cfg.get(key), dict):
            cfg = cfg[key]
    name = p.name if p.is_dir() else cfg_path.stem
    a = adapter_from_config(cfg, m, name)
    weights = cfg_path.parent / SAFETENSORS_NAME
    if weights.is_file():
        header = _read_header(weights)
        a.notes = [n for n in a.notes if n != PER_EXPERT_NOTE]  # the weights say what is there
        if m.is_moe and _is_all_linear(cfg.get("target_modules")):
            _header_experts(header, m, a)
        a.file_params, a.file_bytes = _safetensors_stats(header, m.text_only)
        if a.file_params != a.params(m):
            a.notes.append(
                f"its weights hold {a.file_params:,} LoRA parameters but its config on this "
                f"model gives {a.params(m):,}: made for another base model?"
            )
    return a
