"""Llama-family decoder (Llama, Mistral, Qwen2) over a flattened token batch with paged KV.

Base GEMMs run once per step for all tokens (q/k/v and gate/up fused); each adapted projection
then adds its gathered LoRA delta for the tokens of every adapter in the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from loraplex.kv.cache import PagedKVCache
from loraplex.lora.plan import LoRABatchPlan
from loraplex.model.attention import AttentionMetadata, paged_attention
from loraplex.model.config import ModelConfig
from loraplex.model.linear import Linear, LinearFactory, select_linear_factory
from loraplex.model.loader import iter_checkpoint
from loraplex.model.lora_binding import LoRABinding
from loraplex.types import ModelLoadError


@dataclass
class ForwardBatch:
    """Tensors for one engine step; tokens of one adapter are contiguous (see the runner)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [S] rows whose next-token logits are needed
    lora_plan: LoRABatchPlan | None = None


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] incl. ``linear`` and Llama-3 ``rope_scaling``."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    factor = float(rs["factor"])
    if rs["rope_type"] == "linear":
        return inv / factor
    # llama3: low frequencies scaled by `factor`, high kept, a smooth ramp between
    low, high = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
    old_len = float(rs["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF-exact RMSNorm: statistics in float32, then scale in the model dtype (one fused
    kernel in float32; low-precision inputs normalise in float32 first, as HF does)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, w.shape, w, eps)
    return w * F.rms_norm(x.float(), w.shape, None, eps).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half convention.  x: [T, heads, hd]; cos, sin: [T, 1, hd]."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


ProjectionGroup = tuple[str, int, tuple[tuple[str, int, int], ...]]
"""``(fused Linear attribute, input features, ((proj, first column, end column), ...))``."""


class DecoderLayer:
    """Weights of one decoder layer (inference only).

    While loading, raw tensors sit in ``w_*``/``b_*``; ``finalize`` turns them into ``Linear``s.
    """

    def __init__(self) -> None:
        self.ln1: torch.Tensor
        self.ln2: torch.Tensor
        self.w_qkv: torch.Tensor  # [q + 2 kv, D]
        self.b_qkv: torch.Tensor | None = None
        self.w_o: torch.Tensor  # [D, q]
        self.b_o: torch.Tensor | None = None
        self.w_gate_up: torch.Tensor  # [2 I, D]
        self.b_gate_up: torch.Tensor | None = None
        self.w_down: torch.Tensor  # [D, I]
        self.b_down: torch.Tensor | None = None
        self.qkv: Linear
        self.o: Linear
        self.gate_up: Linear
        self.down: Linear

    def finalize(self, make: LinearFactory) -> None:
        """Wrap the raw weights in the chosen Linear implementation and drop the raw copies."""
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(self, name, make(getattr(self, f"w_{name}"), getattr(self, f"b_{name}")))
            delattr(self, f"w_{name}")
            setattr(self, f"b_{name}", None)


class LlamaForCausalLM:
    """Inference-only Llama-family decoder reading a paged KV cache."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.layers = [DecoderLayer() for _ in range(cfg.num_layers)]
        self.embed: torch.Tensor
        self.norm: torch.Tensor
        self.lm_head: torch.Tensor
        self.head: Linear
        self.linear_impl = "unset"
        self.lora: LoRABinding | None = None
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        qs, kvs, inter, d = self.q_size, self.kv_size, cfg.intermediate_size, cfg.hidden_size
        self.projection_groups: tuple[ProjectionGroup, ...] = (
            (
                "qkv",
                d,
                (("q_proj", 0, qs), ("k_proj", qs, qs + kvs), ("v_proj", qs + kvs, qs + 2 * kvs)),
            ),
            ("o", qs, (("o_proj", 0, d),)),
            ("gate_up", d, (("gate_proj", 0, inter), ("up_proj", inter, 2 * inter))),
            ("down", inter, (("down_proj", 0, d),)),
        )
        """Each fused Linear (in forward order), its input width and its projections' output
        columns ``(proj, lo, hi)``: the one map of projections to fused weights (LoRA groups,
        merging)."""
        self._rope_len = 0
        self._cos = self._sin = torch.empty(0)

    # -- loading -----------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device
    ) -> LlamaForCausalLM:
        """Load weights tensor by tensor into their final buffers (fusing q/k/v and gate/up)."""
        model = cls(cfg, dtype, device)
        pending: dict[int, dict[str, torch.Tensor]] = {i: {} for i in range(cfg.num_layers)}
        seen: set[str] = set()
        for name, st in iter_checkpoint(Path(model_dir)):
            if name.endswith("rotary_emb.inv_freq"):
                continue
            seen.add(name)
            t = st.read(name, dtype, device)
            if name == "model.embed_tokens.weight":
                model.embed = t
            elif name == "model.norm.weight":
                model.norm = t
            elif name == "lm_head.weight":
                model.lm_head = t
            elif name.startswith("model.layers."):
                parts = name.split(".")
                idx = int(parts[2])
                if idx >= cfg.num_layers:
                    raise ModelLoadError(
                        f"{model_dir}: unexpected tensor {name} (layer {idx} >= {cfg.num_layers})"
                    )
                model._place(idx, ".".join(parts[3:]), t, pending[idx], name, model_dir)
            else:
                raise ModelLoadError(
                    f"{model_dir}: unexpected tensor {name!r} for {cfg.architecture}"
                )
        if cfg.tie_word_embeddings or not hasattr(model, "lm_head"):
            if "lm_head.weight" not in seen and not cfg.tie_word_embeddings:
                raise ModelLoadError(f"{model_dir}: missing tensor 'lm_head.weight'")
            model.lm_head = model.embed
        for what in ("embed", "norm"):
            if not hasattr(model, what):
                key = "model.embed_tokens.weight" if what == "embed" else "model.norm.weight"
                raise ModelLoadError(f"{model_dir}: missing tensor {key!r}")
        for idx, rest in pending.items():
            if rest:
                missing = sorted({"q", "k", "v", "gate", "up"} - {k.split("_")[0] for k in rest})
                raise ModelLoadError(
                    f"{model_dir}: layer {idx} is missing tensors for projection(s) {missing}"
                )
            layer = model.layers[idx]
            for attr in ("ln1", "ln2", "w_qkv", "w_o", "w_gate_up", "w_down"):
                if not hasattr(layer, attr):
                    raise ModelLoadError(f"{model_dir}: layer {idx} is missing its {attr} weight")
        model._check_shapes(model_dir)
        model.finalize()
        return model

    def finalize(self) -> None:
        """Choose the linear implementation once and convert every projection to it."""
        self.linear_impl, make = select_linear_factory(self.device, self.dtype)
        for layer in self.layers:
            layer.finalize(make)
        self.head = make(self.lm_head, None)
        del self.lm_head  # a tied head keeps ``embed`` for lookups; the packed copy is the head's

    def _place(
        self,
        idx: int,
        key: str,
        t: torch.Tensor,
        pending: dict[str, torch.Tensor],
        name: str,
        src: object,
    ) -> None:
        layer = self.layers[idx]
        simple = {
            "input_layernorm.weight": "ln1",
            "post_attention_layernorm.weight": "ln2",
            "self_attn.o_proj.weight": "w_o",
            "self_attn.o_proj.bias": "b_o",
            "mlp.down_proj.weight": "w_down",
            "mlp.down_proj.bias": "b_down",
        }
        if key in simple:
            setattr(layer, simple[key], t)
            return
        groups = {
            "self_attn.q_proj": ("q", "qkv"),
            "self_attn.k_proj": ("k", "qkv"),
            "self_attn.v_proj": ("v", "qkv"),
            "mlp.gate_proj": ("gate", "gate_up"),
            "mlp.up_proj": ("up", "gate_up"),
        }
        mod, _, kind = key.rpartition(".")
        if mod not in groups or kind not in ("weight", "bias"):
            raise ModelLoadError(f"{src}: unexpected tensor {name!r}")
        part, group = groups[mod]
        pending[f"{part}_{kind}"] = t
        order = ("q", "k", "v") if group == "qkv" else ("gate", "up")
        keys = [f"{p}_{kind}" for p in order]
        if all(k in pending for k in keys):
            setattr(
                layer,
                f"{'w' if kind == 'weight' else 'b'}_{group}",
                torch.cat([pending.pop(k) for k in keys]),
            )

    def _check_shapes(self, src: object) -> None:
        c = self.cfg
        qkv = self.q_size + 2 * self.kv_size
        expect = {
            "embed": (self.embed, (c.vocab_size, c.hidden_size)),
            "lm_head": (self.lm_head, (c.vocab_size, c.hidden_size)),
            "norm": (self.norm, (c.hidden_size,)),
        }
        for i, layer in enumerate(self.layers):
            expect[f"layer {i} qkv"] = (layer.w_qkv, (qkv, c.hidden_size))
            expect[f"layer {i} o_proj"] = (layer.w_o, (c.hidden_size, self.q_size))
            expect[f"layer {i} gate/up"] = (
                layer.w_gate_up,
                (2 * c.intermediate_size, c.hidden_size),
            )
            expect[f"layer {i} down_proj"] = (layer.w_down, (c.hidden_size, c.intermediate_size))
            for needed, bias, what in (
                (c.qkv_bias, layer.b_qkv, "q/k/v"),
                (c.o_bias, layer.b_o, "o_proj"),
                (c.mlp_bias, layer.b_down, "down_proj"),
            ):
                if needed and bias is None:
                    raise ModelLoadError(
                        f"{src}: layer {i} has no {what} bias but the config requires one"
                    )
        for what, (t, shape) in expect.items():
            if tuple(t.shape) != shape:
                raise ModelLoadError(
                    f"{src}: {what} weight has shape {tuple(t.shape)}, config expects {shape}"
                )

    # -- forward -----------------------------------------------------------------------------
    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        need = int(positions.max()) + 1 if positions.numel() else 1
        if need > self._rope_len:
            n = max(need, 2 * self._rope_len, 256)
            freqs = torch.outer(torch.arange(n, dtype=torch.float32), rope_inv_freq(self.cfg))
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos = emb.cos().to(self.dtype).to(self.device)
            self._sin = emb.sin().to(self.dtype).to(self.device)
            self._rope_len = n
        return self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1)  # [T, 1, hd]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        """Run all layers for the batch; returns float32 logits [S, vocab] at logits_indices."""
        h = self.hidden_states(batch, cache)  # [T, D]
        return self.compute_logits(h[batch.logits_indices])

    @torch.inference_mode()
    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head over last-layer hidden states.  h: [N, D] -> float32 [N, V]."""
        return self.head(_rms_norm(h, self.norm, self.cfg.rms_norm_eps)).float()

    @torch.inference_mode()
    def hidden_states(self, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        """Run all layers for the batch (writing its KV); returns the last layer's hidden
        states [T, D] before the final norm, for every token (prompt logprobs need them all)."""
        c = self.cfg
        T = batch.input_ids.shape[0]
        hd, qs, kvs = c.head_dim, self.q_size, self.kv_size
        plan = batch.lora_plan if (self.lora is not None and batch.lora_plan is not None) else None
        lora = self.lora
        cos, sin = self._rope(batch.positions)
        h = self.embed[batch.input_ids]  # [T, D]
        qkv_parts, o_parts, gu_parts, down_parts = (g[2] for g in self.projection_groups)
        on_qkv = on_o = on_gu = on_down = False
        if plan is not None:
            on_qkv, on_o, on_gu, on_down = lora.active(
                plan, (qkv_parts, o_parts, gu_parts, down_parts)
            )
        for i, L in enumerate(self.layers):
            x = _rms_norm(h, L.ln1, c.rms_norm_eps)
            qkv = L.qkv(x)  # [T, q + 2 kv]
            if on_qkv:
                lora.add(i, qkv_parts, x, qkv, plan)
            qk = _rotate(qkv[:, : qs + kvs].view(T, -1, hd), cos, sin)  # [T, H + KVH, hd]
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]  # [T, H, hd], [T, KVH, hd]
            v = qkv[:, qs + kvs :].view(T, -1, hd)
            a = paged_attention(q, k, v, i, cache, batch.attn, self.scale).reshape(T, qs)
            o = L.o(a)  # [T, D]
            if on_o:
                lora.add(i, o_parts, a, o, plan)
            h = h + o
            x = _rms_norm(h, L.ln2, c.rms_norm_eps)
            gu = L.gate_up(x)  # [T, 2 I]
            inter = c.intermediate_size
            if on_gu:
                lora.add(i, gu_parts, x, gu, plan)
            act = F.silu(gu[:, :inter]) * gu[:, inter:]  # [T, I]
            d = L.down(act)  # [T, D]
            if on_down:
                lora.add(i, down_parts, act, d, plan)
            h = h + d
        return h  # [T, D]

    @property
    def nbytes(self) -> int:
        """Bytes of the weights as loaded (embedding, norms, projections, head)."""
        shared = getattr(self.head, "weight", None) is self.embed  # tied and unpacked
        total = self.embed.nbytes + self.norm.nbytes + (0 if shared else self.head.nbytes)
        for L in self.layers:
            total += L.ln1.nbytes + L.ln2.nbytes
            total += sum(lin.nbytes for lin in (L.qkv, L.o, L.gate_up, L.down))
        return total
