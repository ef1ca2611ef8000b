"""GPT-OSS (``GptOssForCausalLM``, 20b and 120b): Llama's pre-norm decoder with a sparse block in
every layer. What differs from Llama:

- attention: biases on q/k/v/o; one learned sink logit per query head (``self_attn.sinks``)
  that joins each softmax row and is dropped after it (``attention.sink_attend``; each layer's
  prefill and decode attention functions are bound to its sinks at load, decode through the
  model's ``LayerOps.decode_attention``: the C kernel on CPU); ``sliding_attention`` layers
  (window 128) alternate with full ones (``layer_types``: the shared window masks and KV
  groups);
- rotary: YaRN (``rotary.YaRNRotaryEmbedding``, its attention factor on cos/sin);
- RMSNorm: the scale multiplied in float32 before the cast (``norms.Float32ScaleRMSNorm``);
- the sparse block (``moe.SparseMoE`` options): the router ``mlp.router`` has a bias and routes
  by the top-k logits, weighted by their softmax; experts have biases and a clamped SwiGLU
  (``moe.clamped_swiglu``); the checkpoint packs them ``gate_up_proj [E, D, 2 I]`` with gate
  and up interleaved (even / odd columns) and ``down_proj [E, I, D]``, both transposed from
  loraplex's ``[E, out, in]``; they load de-interleaved (gate rows, then up rows);
- MXFP4 experts (the released checkpoints, ``quantization_config.quant_method: mxfp4``):
  ``*_blocks [E, out, in / 32, 16]`` (two FP4 e2m1 values a byte, low nibble first) and
  ``*_scales [E, out, in / 32]`` (e8m0: ``2 ** (s - 127)`` per 32 values), dequantized at load
  to the model dtype (:func:`dequantize_mxfp4`; exact: every FP4 value times a power of two
  is representable in float32 and bfloat16).

Adapters: LoRA on q/k/v/o, PEFT's ``target_parameters`` on ``mlp.experts.gate_up_proj`` /
``mlp.experts.down_proj`` (their ``B`` rows interleaved as the base's columns:
``MoESpec.gate_up_interleaved``), ``lm_head`` and ``embed_tokens``. The router is no Linear
(PEFT cannot target it as a module) and ``target_parameters`` on it is refused naming it.

Tensor parallelism (``model/tensor_parallel/sharding.py``): each rank keeps its query heads'
sinks (a sink joins only its own head's softmax), its rows of the q/k/v biases and its columns
of every expert's gate/up weights and bias (gate, then up; the clamped SwiGLU is per column);
the o and down experts' biases are added by rank 0 alone (before the all-reduce); the router
is whole on every rank. MXFP4 experts are dequantized whole, then cut. Windows and YaRN are
per head and need nothing.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from loraplex.model.attention import sink_attend
from loraplex.model.layer_ops import LayerOps
from loraplex.model.moe import MoEConfig, MoEDecoderForCausalLM, moe_config_fields
from loraplex.model.norms import Float32ScaleRMSNorm
from loraplex.types import ModelLoadError

FP4_VALUES = tuple(s * m for s in (1.0, -1.0) for m in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0))
"""The 16 FP4 (e2m1) values by their 4-bit code."""

_TENSOR = re.compile(
    r"model\.layers\.(?P<layer>\d+)\.(?:self_attn\.(?P<sinks>sinks)"
    r"|mlp\.router\.(?P<router>weight|bias)"
    r"|mlp\.experts\.(?P<param>gate_up_proj|down_proj)(?P<kind>|_bias|_blocks|_scales))"
)
"""GPT-OSS's own tensors: sinks, the router, the packed experts (float, or MXFP4)."""


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 ``blocks [..., G, 16]`` (uint8, low nibble the even value) and e8m0 ``scales
    [..., G]`` -> float32 ``[..., G * 32]``: ``value[32 g + j] = FP4[code j of block g] *
    2 ** (scales[g] - 127)``."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    b = blocks.to(torch.uint8)
    vals = torch.stack((lut[(b & 0x0F).int()], lut[(b >> 4).int()]), dim=-1)  # [..., G, 16, 2]
    vals = vals.flatten(-2)  # [..., G, 32]
    exp = scales.to(torch.int32) - 127  # [..., G]
    return torch.ldexp(vals, exp[..., None]).flatten(-2)  # [..., G * 32]


@dataclass(frozen=True)
class GptOssConfig(MoEConfig):
    """``MoEConfig`` whose layers also hold one attention sink per query head."""

    def layer_bias_params(self) -> int:
        return super().layer_bias_params() + self.num_heads  # + self_attn.sinks [H]


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """Gate (even) then up (odd) entries along dim 1: ``[E, 2 I, ...]``."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


class GptOssForCausalLM(MoEDecoderForCausalLM):
    """gpt-oss-20b, gpt-oss-120b and their fine-tunes."""

    model_type = "gpt_oss"
    config_class = GptOssConfig
    norm_class = Float32ScaleRMSNorm
    own_quant_methods: ClassVar[frozenset[str]] = frozenset({"mxfp4"})

    @classmethod
    def config_fields(cls, c: Mapping[str, Any], source: str) -> dict[str, Any]:
        layers = tuple(range(int(c["num_hidden_layers"])))
        fields = moe_config_fields(
            c, source, num_experts=int(c.get("num_local_experts") or 0),
            inter=int(c["intermediate_size"]), sparse=layers, norm_topk_prob=False,
            block="mlp", in_model_dtype=True,
        )  # fmt: skip
        fields.update(
            packed_only=True,
            softmax_after_topk=True,
            router_bias=True,
            expert_bias=True,
            gate_up_interleaved=True,
            swiglu_limit=float(c.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(c.get("swiglu_alpha", 1.702)),
        )
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        if rope.get("rope_type") == "yarn" and rope.get("factor") is None:  # HF's default
            original = rope.get("original_max_position_embeddings")
            if not original:
                raise ModelLoadError(f"{source}: yarn rope needs original_max_position_embeddings")
            factor = int(c.get("max_position_embeddings", 2048)) / int(original)
            fields["rope_scaling"] = {**rope, "factor": factor}
        return fields

    def __init__(self, cfg: Any, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(cfg, dtype, device)
        self._mxfp4: dict[tuple[int, str], dict[str, torch.Tensor]] = {}

    def take_tensor(
        self, key: str, read: Callable[[], torch.Tensor], shape: tuple[int, ...]
    ) -> bool:
        m = _TENSOR.fullmatch(key)
        if m is None:
            return super().take_tensor(key, read, shape)
        c, layer = self.full_cfg, int(m["layer"])  # the checkpoint's (whole) shapes
        E, inter, D = c.num_experts, c.moe_intermediate_size, c.hidden_size
        if layer >= c.num_layers:
            raise ModelLoadError(f"unexpected tensor {key!r} (layer {layer} >= {c.num_layers})")
        if m["sinks"]:
            self._check(key, shape, (c.num_heads,))
            return self._keep(layer, "sinks", read())
        if m["router"]:
            want = (E, D) if m["router"] == "weight" else (E,)
            self._check(key, shape, want)
            return self._keep(layer, "router" if m["router"] == "weight" else "router_bias", read())
        gate_up = m["param"] == "gate_up_proj"
        out, d_in = (2 * inter, D) if gate_up else (D, inter)
        slot = "w_gate_up" if gate_up else "w_down"
        kind = m["kind"]
        if kind == "_bias":
            self._check(key, shape, (E, out))
            bias = "b" + slot[1:]
            return self._keep(layer, bias, self._ours(bias, read()))  # [E, out]
        if kind == "":  # float: [E, in, out], transposed from ours
            self._check(key, shape, (E, d_in, out))
            return self._keep(layer, slot, self._ours(slot, read().transpose(1, 2)))
        if d_in % 32:
            raise ModelLoadError(f"tensor {key!r}: MXFP4 needs in-features divisible by 32")
        want = (E, out, d_in // 32, 16) if kind == "_blocks" else (E, out, d_in // 32)
        self._check(key, shape, want)
        parts = self._mxfp4.setdefault((layer, slot), {})
        parts[kind] = read(dtype=None).to(torch.uint8)  # the codes as stored
        if len(parts) == 2:
            del self._mxfp4[(layer, slot)]
            blocks, scales = parts["_blocks"], parts["_scales"]
            w = None  # [E, out_r, in_r], one expert's float32 at a time
            for e in range(E):
                one = self._ours(slot, dequantize_mxfp4(blocks[e : e + 1], scales[e : e + 1]))
                assert one is not None  # [1, out_r, in_r]
                if w is None:
                    w = torch.empty(E, *one.shape[1:], dtype=self.dtype, device=self.device)
                w[e] = one[0]
            self._keep(layer, slot, w)
        return True

    def _ours(self, slot: str, t: torch.Tensor) -> torch.Tensor | None:
        """An expert slot's weight ``[E, out, in]`` or bias ``[E, out]`` (the checkpoint's rows)
        as this rank keeps it, on the model's device: gate rows before up rows, its columns of
        every expert (``TensorParallel.shard_experts``; None: the down experts' bias on a rank
        other than 0). Cut as it is read, so a rank never holds every layer's whole experts."""
        if slot.endswith("gate_up"):
            t = _deinterleave(t)
        if self.tp is not None:
            cut = self.tp.shard_experts(slot, t, self.full_cfg)
            if cut is None:
                return None
            t = cut
        return t.contiguous().to(self.device)

    def _rank_experts(self, layer: int, slot: str) -> torch.Tensor | None:
        return self._moe_parts.pop((layer, slot))  # the rank's already (``_ours``)

    def _keep(self, layer: int, slot: str, t: torch.Tensor | None) -> bool:
        E = self.cfg.num_experts
        self._moe_parts[(layer, slot)] = t  # type: ignore[assignment]  # None: a rank's b_down
        n = {"w_gate_up": 2 * E, "w_down": E}.get(slot, 1)
        self._moe_seen[(layer, slot)] = set(range(n))
        return True

    def check_own_tensors(self, src: object) -> None:
        if self._mxfp4:
            (layer, slot), parts = next(iter(self._mxfp4.items()))
            have = next(iter(parts))
            raise ModelLoadError(f"{src}: layer {layer} {slot}: MXFP4 {have} without its pair")
        for layer in range(self.cfg.num_layers):
            if (layer, "sinks") not in self._moe_parts:
                raise ModelLoadError(f"{src}: layer {layer} is missing self_attn.sinks")
        super().check_own_tensors(src)

    def build_own(self) -> None:
        for i, L in enumerate(self.layers):
            L.sinks = self._own_heads(self._moe_parts.pop((i, "sinks")))  # [H_r]: its heads
            L.attend = functools.partial(sink_attend, sinks=L.sinks)
        self._bind_decode()
        super().build_own()

    def _own_heads(self, sinks: torch.Tensor) -> torch.Tensor:
        """The sinks of this rank's query heads (``sinks [H]`` whole; all of them on one
        device): head ``h``'s sink joins only head ``h``'s softmax, so it goes with the head."""
        if self.tp is None:
            return sinks
        h = self.cfg.num_heads  # query heads per rank
        return sinks[self.tp.rank * h : (self.tp.rank + 1) * h].contiguous()  # [H / size]

    def _bind_decode(self) -> None:
        """Each layer's decode attention: the model's ops' with the layer's sinks."""
        for L in self.layers:
            L.decode = functools.partial(self.ops.decode_attention, sinks=L.sinks)

    def use_layer_ops(self, ops: LayerOps) -> None:
        super().use_layer_ops(ops)
        self._bind_decode()
