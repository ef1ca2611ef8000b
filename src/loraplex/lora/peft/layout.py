"""What the tensors of an adapter must look like for a base model: :func:`check_layout`
checks a set of tensors (names, shapes and kinds, no data) against the config and the base and
returns each adapted module's layout (its A/B tensors, rank and scale).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from loraplex.checkpoint.modules import (
    EMBED_TOKENS,
    EXPERT_PROJ_NAMES,
    FUSED_PROJ_NAMES,
    LAYER_MODULE_ORDER,
    OUTER_MODULES,
    ROUTER,
    VOCAB_LAYER,
    VOCAB_MODULES,
    BaseModelSpec,
    block_of,
    module_key,
    vocab_module_key,
)
from loraplex.lora.peft.errors import FormatError
from loraplex.lora.peft.experts import ExpertModuleLayout, ExpertTensors
from loraplex.lora.peft.targets import LoraSettings
from loraplex.lora.peft.tensors import (
    OTHER_TOWER_RE,
    ROUTER_KEY_RE,
    TensorKey,
    TensorMeta,
    check_factor_meta,
    parse_base_copy,
    parse_tensor_key,
    unknown_tensor_error,
)


@dataclass(frozen=True)
class ModuleLayout:
    """One adapted projection as the tensors and the config describe it."""

    module: str  # the module key PEFT saw
    a_name: str
    b_name: str
    rank: int
    scale: float
    b_rows: tuple[int, int] | None = None
    """The rows of ``B`` this projection takes when the tensors are a fused module's (Phi-3's
    ``qkv_proj``: q's rows, k's, v's; ``A`` is then shared by the parts); None: all of them."""

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """The tensors this module is served from."""
        return (self.a_name, self.b_name)


Layout = ModuleLayout | ExpertModuleLayout


def _module_order(key: tuple[int, str]) -> tuple[int, int]:
    """Modules in table order: the modules outside the layers first, then layer by layer (a
    fused module where its first part is; the per-layer input modules last)."""
    layer, proj = key
    if layer == VOCAB_LAYER:
        return (layer, OUTER_MODULES.index(proj))
    return (layer, LAYER_MODULE_ORDER.index(FUSED_PROJ_NAMES.get(proj, (proj,))[0]))


def _decoder_prefix(module_keys: Iterable[str]) -> str:
    """What precedes ``layers.N`` / ``embed_tokens`` in the module names PEFT saw
    (``model.``, ``model.language_model.``), for naming the modules it must have seen."""
    for mkey in module_keys:
        for anchor in ("layers.", EMBED_TOKENS):
            if anchor in mkey:
                return mkey.split(anchor)[0]
    return "model."


def check_layout(
    settings: LoraSettings,
    tensors: Mapping[str, TensorMeta],
    spec: BaseModelSpec,
    *,
    max_rank: int,
) -> dict[tuple[int, str], Layout]:
    """Check a set of tensors (name -> shape and kind, no data) against the config and the base.

    Every tensor must be ``lora_A``/``lora_B`` of a projection of a decoder layer or of the LM
    head, or ``lora_embedding_A``/``lora_embedding_B`` of the token embedding; each module has
    both, ``A: [r, d_in]`` and ``B: [d_out, r]`` of the base's shapes (the embedding's ``d_in``
    is the vocabulary) with the configured rank ``r <= max_rank``, the config targets it, and
    every module the config targets has tensors (a half-present adapter, e.g. made for a model
    with fewer layers, is a mismatch). PEFT's copies of the base's embedding / LM head matrix
    (``...base_layer.weight``, saved beside a LoRA on them) must have the base's shape (else the
    vocabulary was resized) and are not served: LoRA training freezes them. Returns
    ``(layer, proj) -> ModuleLayout`` in table order (``(VOCAB_LAYER, name)`` first); a fused
    module of the base (``spec.fused``: Phi-3's ``qkv_proj``) is checked as one module and
    returned as its parts, each with its rows of ``B`` (``b_rows``). On a MoE base
    (``spec.moe``) the sparse layers' router is an ordinary module and their experts come back
    as :class:`ExpertModuleLayout` (:class:`~loraplex.lora.peft.experts.ExpertTensors` checks them).
    """
    pairs: dict[tuple[int, str], dict[str, str]] = {}  # (layer, proj) -> {"A": name, "B": name}
    module_keys: dict[tuple[int, str], str] = {}
    copies: dict[str, str] = {}  # base copy tensor name -> embed_tokens | lm_head
    if settings.target_parameters and spec.moe is None:
        raise FormatError(
            "unsupported_target",
            f"target_parameters {list(settings.target_parameters)} name a MoE's experts or "
            "router, and this base model has none (adapter made for another model?)",
        )
    experts = ExpertTensors(spec, settings, tensors, max_rank) if spec.moe else None
    for name in sorted(tensors):
        if spec.text_only and OTHER_TOWER_RE.match(name):
            continue  # LoRA on the text backbone only (the other towers never run)
        if experts is not None and experts.collect(name):
            continue
        if experts is not None and (m := ROUTER_KEY_RE.match(name)) is not None:
            k = TensorKey(m["module"], int(m["layer"]), m["block"] or "", ROUTER, m["ab"])
            slot = pairs.setdefault((k.layer, ROUTER), {})
            if k.ab in slot:
                raise FormatError(
                    "unsupported_tensor", f"tensor {name!r} duplicates {slot[k.ab]!r}"
                )
            slot[k.ab] = name
            module_keys[(k.layer, ROUTER)] = k.module
            continue
        copied = parse_base_copy(name)
        if copied is not None:
            copies[name] = copied
            continue
        k = parse_tensor_key(name)
        if k is None:
            raise unknown_tensor_error(name)
        if k.layer == VOCAB_LAYER:
            if k.proj not in spec.vocab_shapes:
                raise FormatError(
                    "unsupported_target",
                    f"tensor {name!r}: this base model serves no LoRA on {k.proj}",
                )
        elif k.proj not in spec.layer_shapes(k.layer):
            supported = (*spec.layer_shapes(k.layer), *VOCAB_MODULES)
            where = f" in layer {k.layer}" if spec.moe is not None else ""  # differs by layer
            raise FormatError(
                "unsupported_target",
                f"tensor {name!r}: target module {k.proj!r} is not supported{where} "
                f"(supported: {', '.join(supported)})",
            )
        elif k.block != block_of(k.proj):
            raise FormatError(
                "unsupported_tensor", f"tensor {name!r}: {k.proj} does not belong under {k.block}"
            )
        slot = pairs.setdefault((k.layer, k.proj), {})
        if k.ab in slot:
            raise FormatError("unsupported_tensor", f"tensor {name!r} duplicates {slot[k.ab]!r}")
        slot[k.ab] = name
        module_keys[(k.layer, k.proj)] = k.module
    if not pairs and (experts is None or not experts.any):
        raise FormatError("incomplete_adapter", "no LoRA tensors (lora_A/lora_B weights) found")
    for name, copied in copies.items():
        if (VOCAB_LAYER, copied) not in pairs:
            raise FormatError(
                "unsupported_tensor",
                f"tensor {name!r}: a copy of the base's {copied} matrix without a LoRA on "
                f"{copied} (full replacement weights are not served, only LoRA A/B)",
            )
        vocab = spec.vocab_shapes[copied][0 if copied == EMBED_TOKENS else 1]
        want = [vocab, spec.vocab_shapes[EMBED_TOKENS][1]]
        if list(tensors[name].shape) != want:
            raise FormatError(
                "shape_mismatch",
                f"tensor {name!r}: shape {list(tensors[name].shape)}, the base's {copied} is "
                f"{want} (a resized vocabulary is not served)",
            )

    out: dict[tuple[int, str], ModuleLayout] = {}
    for key in sorted(pairs, key=_module_order):
        layer, proj = key
        mkey, slot = module_keys[key], pairs[key]
        for ab in "AB":
            if ab not in slot:
                what = f"lora_embedding_{ab}" if proj == EMBED_TOKENS else f"lora_{ab} weight"
                raise FormatError("incomplete_adapter", f"module {mkey}: {what} missing")
        a_name, b_name = slot["A"], slot["B"]
        a, b = tensors[a_name], tensors[b_name]
        if layer >= spec.num_layers:
            raise FormatError(
                "shape_mismatch",
                f"tensor {a_name!r}: layer {layer} >= base model num_layers {spec.num_layers}",
            )
        shapes = spec.vocab_shapes if layer == VOCAB_LAYER else spec.layer_shapes(layer)
        if proj not in shapes:
            raise FormatError("shape_mismatch", f"tensor {a_name!r}: base model has no {proj}")
        targeted = settings.is_targeted(mkey)
        if proj == ROUTER:  # target_modules=["gate"], or target_parameters=["mlp.gate.weight"]
            targeted = targeted or settings.is_param_targeted(f"{mkey}.weight")
        if not targeted:
            raise FormatError(
                "unsupported_tensor",
                f"tensor {a_name!r}: module {mkey} is not targeted by the config "
                "(target_modules / layers_to_transform / exclude_modules)",
            )
        check_factor_meta(a_name, a, b_name, b)
        d_in, d_out = shapes[proj]
        rank = a.shape[0]
        if b.shape[1] != rank:
            raise FormatError(
                "shape_mismatch",
                f"rank mismatch in {mkey}: {a_name!r} has rank {rank}, {b_name!r} has {b.shape[1]}",
            )
        if a.shape[1] != d_in:
            raise FormatError(
                "shape_mismatch",
                f"tensor {a_name!r}: shape {list(a.shape)}, expected [r, d_in={d_in}] "
                "(adapter made for a different base model?)",
            )
        if b.shape[0] != d_out:
            raise FormatError(
                "shape_mismatch",
                f"tensor {b_name!r}: shape {list(b.shape)}, expected [d_out={d_out}, r] "
                "(adapter made for a different base model?)",
            )
        cfg_rank, scale = settings.rank_and_scale(mkey)
        if rank != cfg_rank:
            raise FormatError(
                "shape_mismatch",
                f"tensor {a_name!r}: rank {rank} != configured rank {cfg_rank} "
                f"({settings.rank_field(mkey)})",
            )
        if rank > max_rank:
            raise FormatError(
                "rank_too_large", f"tensor {a_name!r}: rank {rank} > max_lora_rank {max_rank}"
            )
        if proj in FUSED_PROJ_NAMES:  # one A/B pair over the parts' rows: A shared, B split
            for part, lo, hi in spec.fused_rows(proj):
                out[(layer, part)] = ModuleLayout(mkey, a_name, b_name, rank, scale, (lo, hi))
        else:
            out[key] = ModuleLayout(mkey, a_name, b_name, rank, scale)

    prefix = _decoder_prefix([*module_keys.values(), *(experts.modules if experts else ())])
    expected = [
        ((layer, proj), module_key(layer, proj, prefix, spec.moe.mlp_block if spec.moe else "mlp"))
        for layer in range(spec.num_layers)
        for proj in spec.layer_shapes(layer)
        if proj not in EXPERT_PROJ_NAMES and proj != ROUTER  # the sparse block's: below
    ]
    expected += [
        ((VOCAB_LAYER, m), vocab_module_key(m, prefix))
        for m in OUTER_MODULES
        if m in VOCAB_MODULES or m in spec.vocab_shapes  # Gemma 4's projection: where it is
    ]
    for key, mkey in expected:
        if key not in pairs and settings.is_targeted(mkey):
            if key[0] == VOCAB_LAYER and key[1] not in spec.vocab_shapes:
                raise FormatError(
                    "unsupported_target",
                    f"module {mkey} is targeted by the config, and this base model serves no "
                    f"LoRA on {key[1]}",
                )
            raise FormatError(
                "incomplete_adapter",
                f"module {mkey} is targeted by the config (target_modules / "
                "layers_to_transform) but has no LoRA tensors "
                "(adapter made for another model?)",
            )
    if experts is not None:
        out.update(experts.layouts(prefix, router_seen={k for k in pairs if k[1] == ROUTER}))
        out = dict(sorted(out.items(), key=lambda kv: _module_order(kv[0])))
    return out
