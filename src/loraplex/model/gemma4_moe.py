"""Gemma 4's MoE variant (``enable_moe_block``: the 26B-A4B): Gemma 4's layers
(``model/gemma4.py``) with a sparse block (``model/moe.py``) beside each layer's dense MLP.

Both read the same residual ``h`` (after attention) and their sum is post-normed into it, as
transformers' ``Gemma4TextDecoderLayer``::

    h1 = post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(h)))
    r  = norm(h) * router.scale * D ** -0.5               # no-weight RMS norm, then a scale
    w, e = top-k of softmax(router.proj(r)) (float32), renormalised, * per_expert_scale[e]
    h2 = post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(h), w, e))
    h += post_feedforward_layernorm(h1 + h2)

then the per-layer input and ``layer_scalar`` as the dense model. The experts are packed
(``experts.gate_up_proj [E, 2 I, D]``, ``experts.down_proj [E, D, I]``), Gemma's GeGLU; they and
the router sit directly under the layer (``model.layers.N.router.proj``,
``model.layers.N.experts``: ``MoESpec.block`` ""). The routing weights stay float32 (times the
model-dtype ``per_expert_scale``), as in transformers.

Adapters may target everything the dense model adapts, the router (``router.proj``: PEFT's
``all-linear`` takes it, a linear) and the experts (PEFT's ``target_parameters``
``experts.gate_up_proj`` / ``experts.down_proj``).

Tensor parallelism: Gemma 4's per-layer cut (``gemma4.py``) and the sparse block's (each
expert's columns; the router, its scales and the three extra norms whole; the block's output
summed over the ranks before its post-norm).

The architecture names are the dense model's (``Gemma4ForCausalLM``,
``Gemma4ForConditionalGeneration``): ``model/registry.py::model_class`` picks these classes
where ``enable_moe_block`` is set (:meth:`Gemma4MoeForCausalLM.serves`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from loraplex.checkpoint import gemma4_layers
from loraplex.checkpoint.modules import MoESpec
from loraplex.model.gemma4 import (
    GEMMA4_LAYER_WEIGHTS,
    Gemma4Config,
    Gemma4ForCausalLM,
    Gemma4ForConditionalGeneration,
)
from loraplex.model.layers import DecoderLayer, GatedMLP, LayerStep
from loraplex.model.moe import MoEConfig, MoEDecoderForCausalLM, SparseMoE, moe_config_fields
from loraplex.model.spec import ModelConfig
from loraplex.types import ModelLoadError

MOE_NORMS: Mapping[str, tuple[str, int]] = {
    "post_feedforward_layernorm_1": ("post_mlp_1", 0),  # the dense MLP's output
    "pre_feedforward_layernorm_2": ("ln2_moe", 0),  # the experts' input
    "post_feedforward_layernorm_2": ("post_moe", 0),  # the experts' output
}
GEMMA4_MOE_LAYER_WEIGHTS: Mapping[str, tuple[str, int]] = {**GEMMA4_LAYER_WEIGHTS, **MOE_NORMS}
_ROUTER_SCALES = ("router.scale", "router.per_expert_scale")  # [D], [E]: layer attributes
_OWN = re.compile(
    r"model\.layers\.(\d+)\.(router\.proj\.weight|experts\.gate_up_proj|experts\.down_proj"
    r"|router\.scale|router\.per_expert_scale)"
)
_AS_MOE = {  # Gemma 4's name -> the sparse block's canonical one (``moe._MOE_TENSOR``)
    "router.proj.weight": "mlp.gate.weight",
    "experts.gate_up_proj": "mlp.experts.gate_up_proj",
    "experts.down_proj": "mlp.experts.down_proj",
}


@dataclass(frozen=True)
class Gemma4MoeConfig(Gemma4Config, MoEConfig):
    """Gemma 4's per-layer fields and the sparse blocks' (one in every layer, beside its
    MLP)."""

    def moe_spec(self) -> MoESpec | None:
        spec = super().moe_spec()
        return None if spec is None else replace(spec, dense_mlp=True)

    def layer_module_shapes(self, layer: int) -> dict[str, tuple[int, int]]:
        """Gemma 4's modules of ``layer`` (its dense MLP kept) and the sparse block's."""
        spec = self.moe_spec()
        assert spec is not None
        return {**super().layer_module_shapes(layer), **spec.shapes}

    def layer_modules(self) -> tuple[dict[str, tuple[int, int]], ...]:
        """Every layer's modules (none is the plain seven projections: each has a router and
        experts beside its MLP)."""
        return tuple(self.layer_module_shapes(i) for i in range(self.num_layers))

    def layer_norm_params(self, layer: int) -> int:
        """Gemma 4's norms, the three of the sparse block and the router's scales."""
        d = self.hidden_size
        return super().layer_norm_params(layer) + 4 * d + self.num_experts


class Gemma4SparseMoE(SparseMoE):
    """The sparse block of a Gemma 4 layer: called with the residual ``h``, it routes its own
    norm of it and runs the experts on ``pre_feedforward_layernorm_2(h)``."""

    def __init__(self, cfg: MoEConfig, *args: Any) -> None:
        super().__init__(cfg, *args)
        self.eps = cfg.rms_norm_eps
        self.root = cfg.hidden_size**-0.5

    def __call__(
        self, L: DecoderLayer, i: int, x: torch.Tensor, step: LayerStep,
        router_x: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """x: the residual [T, D] -> the experts' weighted sum [T, D] (before its post-norm)."""
        assert router_x is None
        normed = F.rms_norm(x.float(), (x.shape[1],), None, self.eps).to(x.dtype)  # [T, D]
        r = normed * L.router_scale * self.root  # as transformers: two products, model dtype
        return super().__call__(L, i, L.ln2_moe(x), step, router_x=r)


class Gemma4MoeForCausalLM(Gemma4ForCausalLM, MoEDecoderForCausalLM):
    """Gemma 4 text with the MoE block (see the module docstring)."""

    config_class = Gemma4MoeConfig
    layer_weights = GEMMA4_MOE_LAYER_WEIGHTS
    sparse_class = Gemma4SparseMoE
    serves_moe_block = True
    cfg: Gemma4MoeConfig

    @classmethod
    def serves(cls, text: Mapping[str, Any]) -> bool:
        """Whether this class (not the dense one) serves the text config ``text``."""
        return bool(text.get("enable_moe_block"))

    @classmethod
    def config_fields(cls, c: Mapping[str, Any], source: str) -> dict[str, Any]:
        spec = MoESpec.from_hf_config({**c, "model_type": gemma4_layers.MODEL_TYPE})
        if spec is None or spec.num_experts < 1:
            raise ModelLoadError(f"{source}: enable_moe_block needs num_experts >= 1")
        top_k = int(c.get("top_k_experts") or 0)
        if not 1 <= top_k <= spec.num_experts:
            raise ModelLoadError(
                f"{source}: top_k_experts must be in [1, num_experts={spec.num_experts}], "
                f"got {top_k}"
            )
        moe = moe_config_fields(
            {**c, "num_experts_per_tok": c.get("top_k_experts")}, source,
            num_experts=spec.num_experts, inter=spec.intermediate, sparse=spec.layers,
            norm_topk_prob=True, block=spec.block, in_model_dtype=False,
            router=spec.router_name,
        )  # fmt: skip
        return {**super().config_fields(c, source), **moe}

    def layer_weights_of(self, layer: int) -> Mapping[str, tuple[str, int]]:
        return {**super().layer_weights_of(layer), **MOE_NORMS}

    @classmethod
    def norm_dims(cls, c: ModelConfig) -> dict[str, int]:
        return {**super().norm_dims(c), **dict.fromkeys(("post_mlp_1", "ln2_moe", "post_moe"),
                                                        c.hidden_size)}  # fmt: skip

    def layer_norm_dims(self, layer: int) -> dict[str, int]:
        d = self.cfg.hidden_size
        return {**super().layer_norm_dims(layer), "post_mlp_1": d, "ln2_moe": d, "post_moe": d}

    def take_tensor(
        self, key: str, read: Callable[[], torch.Tensor], shape: tuple[int, ...]
    ) -> bool:
        """The router's scales (layer attributes, whole on every rank); the router and the
        packed experts under their canonical names (``MoEDecoderForCausalLM.take_tensor``)."""
        m = _OWN.fullmatch(key)
        if m is None or int(m.group(1)) >= self.cfg.num_layers:
            return super().take_tensor(key, read, shape)
        layer, name = int(m.group(1)), m.group(2)
        if name in _ROUTER_SCALES:
            c = self.full_cfg
            self._check(key, shape, (c.hidden_size if name == "router.scale" else c.num_experts,))
            self._moe_parts[(layer, name)] = read()
            self._moe_seen[(layer, name)] = {0}
            return True
        return super().take_tensor(f"model.layers.{layer}.{_AS_MOE[name]}", read, shape)

    def check_own_tensors(self, src: object) -> None:
        for layer in range(self.cfg.num_layers):
            for name in _ROUTER_SCALES:
                if (layer, name) not in self._moe_seen:
                    raise ModelLoadError(f"{src}: missing tensor 'model.layers.{layer}.{name}'")
        super().check_own_tensors(src)

    def build_own(self) -> None:
        for layer, L in enumerate(self.layers):
            L.router_scale = self._moe_parts.pop((layer, "router.scale"))  # [D]
            L.per_expert_scale = self._moe_parts.pop((layer, "router.per_expert_scale"))  # [E]
        super().build_own()

    def feed_forward(
        self, L: DecoderLayer, i: int, mlp: GatedMLP, h: torch.Tensor, x: torch.Tensor,
        step: LayerStep,
    ) -> torch.Tensor:  # fmt: skip
        """The MLP's and the sparse block's outputs, each post-normed, summed."""
        return L.post_mlp_1(mlp(L, i, x, step)) + L.post_moe(self.moe(L, i, h, step))

    def row_parallel_blocks(self) -> tuple[Any, ...]:
        return (*super().row_parallel_blocks(), self.moe)


class Gemma4MoeForConditionalGeneration(Gemma4MoeForCausalLM, Gemma4ForConditionalGeneration):
    """The language model of a Gemma 4 MoE multimodal checkpoint (text prompts only)."""

    model_type = "gemma4"
