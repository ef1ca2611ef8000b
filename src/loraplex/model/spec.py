"""``ModelConfig``: the typed shape and numerics of a decoder, whatever its architecture.

It lives apart from its parsing (``model/config.py``) because the parser looks architectures up
in the registry, whose classes are built from this config: the split keeps imports acyclic.
``loraplex.model.config`` re-exports it, and that is where callers import it from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loraplex.checkpoint.modules import (
    LinearAttentionSpec,
    MoESpec,
    projection_shapes,
    vocab_module_shapes,
)


@dataclass(frozen=True)
class ModelConfig:
    """The shape and numerics of a decoder (the fields every architecture shares).

    An architecture with more to say subclasses it (its class's ``config_class``) and fills the
    extra fields from its ``config_fields`` hook."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    torch_dtype: str | None
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    hidden_act: str = "silu"
    """The gated MLP's activation (``model.layers.ACTIVATIONS`` names the supported ones)."""
    layer_norm_widths: tuple[int, ...] = ()
    """The width of each norm weight of a layer (empty: Llama's two of ``hidden_size``; Qwen3
    adds its q/k norms of ``head_dim``, Gemma has four of ``hidden_size``); filled in by
    ``parse_model_config`` from the architecture's checkpoint names."""
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    generation_defaults: dict[str, Any] = field(default_factory=dict, compare=False)
    """Default sampling parameters from generation_config.json (SamplingParams field names:
    temperature, top_p, top_k, min_p, repetition_penalty, max_tokens), for the fields a request
    leaves out; empty with ``--generation-config vllm``."""
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """proj name -> (d_in, d_out) of the seven adaptable projections."""
        return projection_shapes(
            self.hidden_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.intermediate_size,
        )

    def layer_module_shapes(self, layer: int) -> dict[str, tuple[int, int]]:
        """The adaptable modules of ``layer`` -> (d_in, d_out): the seven projections, or a MoE
        layer's attention, router and expert projections (one expert's shapes)."""
        return self.module_shapes

    def layer_norm_params(self, layer: int) -> int:
        """Parameters of ``layer``'s norms (``layer_norm_widths``, Llama's two of
        ``hidden_size`` where empty; Gemma 4's differ by layer)."""
        return sum(self.layer_norm_widths or (self.hidden_size, self.hidden_size))

    def kv_layer_shapes(self) -> list[tuple[int, int]]:
        """Each layer's ``(kv_heads, head_dim)`` in the KV cache (Gemma 4's full-attention
        layers have their own)."""
        return [(self.num_kv_heads, self.head_dim)] * self.num_layers

    def layer_modules(self) -> tuple[dict[str, tuple[int, int]], ...]:
        """Each layer's adaptable modules where layers differ (``BaseModelSpec.layer_modules``;
        empty: every layer has :attr:`module_shapes`, or a MoE layer's)."""
        return ()

    def outer_module_shapes(self) -> dict[str, tuple[int, int]]:
        """The adaptable modules outside the layers -> (d_in, d_out): the embedding and the
        head (and Gemma 4's ``per_layer_model_projection``)."""
        return vocab_module_shapes(self.vocab_size, self.hidden_size)

    def module_experts(self, proj: str) -> int:
        """Experts behind module ``proj`` (0: an ordinary module)."""
        return 0

    def moe_spec(self) -> MoESpec | None:
        """The sparse blocks, for a MoE decoder (None: dense)."""
        return None

    def linear_spec(self) -> LinearAttentionSpec | None:
        """The linear-attention layers, for a hybrid decoder (None: attention only)."""
        return None

    def layer_bias_params(self) -> int:
        """Bias parameters of one layer's projections (q/k/v, o, gate/up, down)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        d, inter = self.hidden_size, self.intermediate_size
        return (q + 2 * kv) * self.qkv_bias + d * self.o_bias + (2 * inter + d) * self.mlp_bias

    def num_parameters(self) -> int:
        """Parameters of the text model as loaded: projections, their biases, norms, the
        embedding and an untied LM head."""
        norms = sum(self.layer_norm_widths or (self.hidden_size, self.hidden_size))
        projections = sum(a * b for a, b in self.module_shapes.values())
        per_layer = projections + self.layer_bias_params() + norms
        embed = self.vocab_size * self.hidden_size
        return (
            self.num_layers * per_layer
            + embed * (1 if self.tie_word_embeddings else 2)
            + self.hidden_size
        )
