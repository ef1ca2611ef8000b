"""The tensor names PEFT saves in an adapter and what the checks need of each tensor.

``lora_A`` / ``lora_B`` of a decoder layer's projection or of the LM head, PEFT's
``lora_embedding_A`` / ``lora_embedding_B`` of the token embedding, a MoE block's router, its
experts one by one (``experts.{e}.gate_proj``, Mixtral's ``experts.{e}.w1``) or packed
(``target_parameters``), and PEFT's copies of the base's embedding matrices saved beside a LoRA
on them; whatever else an adapter holds is refused with the reason (:func:`unknown_tensor_error`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from loraplex.checkpoint.modules import (
    EMBED_TOKENS,
    LM_HEAD,
    PER_LAYER_MODEL_PROJECTION,
    VOCAB_LAYER,
)
from loraplex.lora.peft.errors import FormatError

_DECODER = r"(?:model\.)?(?:language_model\.)?(?:model\.)?"
"""What precedes ``layers.N`` / ``embed_tokens``: ``model.`` for a causal LM, and
``model.language_model.`` (transformers 5) or ``language_model.model.`` (older) for the
language model of a multimodal checkpoint."""
# base_model.model.model.layers.3.self_attn.q_proj.lora_A[.default].weight; the MLP block is
# Llama 4's feed_forward there, and a MoE's shared expert mlp.shared_expert.gate_proj
TENSOR_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?"
    rf"(?P<module>{_DECODER}layers\.(?P<layer>\d+)\.(?:(?P<block>self_attn|linear_attn|mlp|feed_forward)\.)?"
    r"(?P<proj>(?:shared_expert\.)?[^.]+))\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)
# base_model.model.model.per_layer_model_projection.lora_A[.default].weight (Gemma 4)
OUTER_KEY_RE = re.compile(
    rf"^(?:base_model\.model\.)?(?P<module>{_DECODER}{PER_LAYER_MODEL_PROJECTION})"
    r"\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)
# base_model.model.model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.lora_A...
OTHER_TOWER_RE = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?(?:vision_tower|multi_modal_projector|audio_tower|embed_vision|embed_audio)\."
)
"""Tensors of a multimodal checkpoint's non-text towers (skipped on a text-only base)."""
_EMBED_MODULE = rf"{_DECODER}embed_tokens"
_HEAD_MODULE = r"(?:language_model\.)?lm_head"
# base_model.model.model.embed_tokens.lora_embedding_A[.default]  (PEFT's nn.Parameter names)
EMBED_KEY_RE = re.compile(
    rf"^(?:base_model\.model\.)?(?P<module>{_EMBED_MODULE})\.lora_embedding_(?P<ab>[AB])"
    r"(?:\.[^.]+)?$"
)
# base_model.model.lm_head.lora_A[.default].weight
HEAD_KEY_RE = re.compile(
    rf"^(?:base_model\.model\.)?(?P<module>{_HEAD_MODULE})\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)
# base_model.model.model.embed_tokens.base_layer.weight: PEFT's save_embedding_layers="auto"
# saves the base's own (frozen) matrix beside an embedding / lm_head LoRA
BASE_COPY_RE = re.compile(
    rf"^(?:base_model\.model\.)?(?P<module>{_EMBED_MODULE}|{_HEAD_MODULE})\.base_layer\.weight$"
)
_VOCAB_WEIGHT_RE = re.compile(
    rf"^(?:base_model\.model\.)?(?:{_EMBED_MODULE}|{_HEAD_MODULE})(?:\.[^.]+)?\.weight$"
)


_MOE_BLOCK = r"(?P<block>mlp|block_sparse_moe|feed_forward)"
# base_model.model.model.layers.3.mlp.experts.5.gate_proj.lora_A[.default].weight (per expert)
EXPERT_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?"
    rf"(?P<module>{_DECODER}layers\.(?P<layer>\d+)\.{_MOE_BLOCK}\.experts\.(?P<expert>\d+)"
    r"\.(?P<proj>[^.]+))\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)
# base_model.model.model.layers.3.mlp.experts[.base_layer].lora_A[.default].weight: PEFT's
# target_parameters on the packed parameters, one ParamWrapper around the other (which is
# inner depends on PEFT's order; the shapes say which parameter each pair adapts); Gemma 4's
# experts sit directly under the layer (layers.3.experts)
PACKED_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?"
    rf"(?P<module>{_DECODER}layers\.(?P<layer>\d+)\.(?:{_MOE_BLOCK}\.)?experts)"
    r"(?P<inner>(?:\.base_layer)*)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)
# base_model.model.model.layers.3.mlp.gate.lora_A[.default].weight (the router; Llama 4's
# feed_forward.router; Gemma 4's router.proj, directly under the layer)
ROUTER_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?"
    rf"(?P<module>{_DECODER}layers\.(?P<layer>\d+)\.(?:{_MOE_BLOCK}\.(?:gate|router)|router\.proj))"
    r"\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)


@dataclass(frozen=True)
class TensorKey:
    """A tensor name PEFT saves for one LoRA factor of an adaptable module."""

    module: str  # e.g. "model.layers.3.self_attn.q_proj" (what patterns are matched against)
    layer: int  # VOCAB_LAYER for embed_tokens / lm_head
    block: str  # self_attn | mlp (Llama 4's feed_forward too); "" for embed_tokens / lm_head
    proj: str
    ab: str  # "A" | "B"


def parse_tensor_key(name: str) -> TensorKey | None:
    """The parts of ``...layers.N.{self_attn,mlp}.<proj>.lora_{A,B}[.<adapter>].weight`` (or
    ``...layers.N.<proj>...``: Gemma 4's per-layer input modules),
    ``...embed_tokens.lora_embedding_{A,B}[.<adapter>]``, ``...lm_head.lora_{A,B}[.<adapter>].weight``
    or ``...per_layer_model_projection.lora_{A,B}[.<adapter>].weight``."""
    m = TENSOR_KEY_RE.match(name)
    if m is not None:
        block = "mlp" if m["block"] == "feed_forward" else (m["block"] or "")
        return TensorKey(m["module"], int(m["layer"]), block, m["proj"], m["ab"])
    outer = ((EMBED_TOKENS, EMBED_KEY_RE), (LM_HEAD, HEAD_KEY_RE),
             (PER_LAYER_MODEL_PROJECTION, OUTER_KEY_RE))  # fmt: skip
    for proj, pattern in outer:
        m = pattern.match(name)
        if m is not None:
            return TensorKey(m["module"], VOCAB_LAYER, "", proj, m["ab"])
    return None


def parse_base_copy(name: str) -> str | None:
    """``embed_tokens`` / ``lm_head`` when ``name`` is PEFT's copy of that base matrix
    (``...embed_tokens.base_layer.weight``), else None."""
    m = BASE_COPY_RE.match(name)
    if m is None:
        return None
    return LM_HEAD if m["module"].endswith(LM_HEAD) else EMBED_TOKENS


def unknown_tensor_error(name: str) -> FormatError:
    """Why a tensor whose name :func:`parse_tensor_key` does not parse is refused."""
    if "lora_magnitude_vector" in name:
        why = "DoRA magnitude vectors are not supported"
    elif "modules_to_save" in name:
        why = "modules_to_save weights are not supported"
    elif "trainable_tokens" in name:
        why = "trainable tokens are not supported"
    elif ".lora_" in name and name.endswith(".bias"):
        why = "LoRA bias (lora_bias) is not supported"
    elif ".embed_tokens.lora_" in name:
        why = "an embed_tokens LoRA is PEFT's lora_embedding_A / lora_embedding_B"
    elif _VOCAB_WEIGHT_RE.match(name):
        module = LM_HEAD if LM_HEAD in name else EMBED_TOKENS
        why = (
            f"full replacement weights for {module} (modules_to_save, or a resized "
            "vocabulary) are not served, only LoRA A/B"
        )
    else:
        return FormatError(
            "unsupported_tensor",
            f"tensor {name!r} is not a LoRA A/B weight of a module we understand",
        )
    return FormatError("unsupported_tensor", f"tensor {name!r}: {why}")


@dataclass(frozen=True)
class TensorMeta:
    """What the layout check needs of one tensor (no data)."""

    shape: tuple[int, ...]
    dtype: str  # str(torch dtype), e.g. "torch.float32"
    floating: bool


def check_factor_meta(a_name: str, a: TensorMeta, b_name: str, b: TensorMeta) -> None:
    """Both factors of a LoRA pair are 2-D floating-point tensors."""
    for tname, t in ((a_name, a), (b_name, b)):
        if not t.floating:
            raise FormatError(
                "unsupported_dtype", f"tensor {tname!r}: dtype {t.dtype} is not floating point"
            )
        if len(t.shape) != 2:
            raise FormatError(
                "shape_mismatch", f"tensor {tname!r}: expected 2-D, got shape {list(t.shape)}"
            )
