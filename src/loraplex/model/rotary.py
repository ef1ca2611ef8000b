"""Rotary position embeddings by ``rope_type`` (``ROPE_TYPES``) and ``apply_rotary``.

One class per rope type; an instance holds cos/sin tables for one base, grown on demand.
Every type may rotate only the first ``partial_rotary_factor`` of each head (Phi-4-mini: 0.75),
except ``proportional`` (Gemma 4), whose zero frequencies leave the rest of both halves as is;
LongRoPE (Phi-3/4 128k) keeps a short and a long factor set and picks one per sequence.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from loraplex.types import ModelLoadError

if TYPE_CHECKING:
    from loraplex.model.attention import AttentionMetadata


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half convention, on the first ``rd`` dims of each head (HF's
    ``apply_rotary_pos_emb``; the rest pass through).  x: [T, heads, hd]; cos, sin: [T, 1, rd]."""
    rd = cos.shape[-1]
    if rd != x.shape[-1]:  # partial rotary: rotate x[..., :rd], keep x[..., rd:]
        return torch.cat((apply_rotary(x[..., :rd], cos, sin), x[..., rd:]), dim=-1)
    half = rd // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


class RotaryEmbedding:
    """Default RoPE: ``inv_freq[i] = base ** (-2i / rd)`` over the ``rd = int(hd *
    partial_rotary_factor)`` rotated dims of a head, with cos/sin tables [positions, rd] grown
    on demand (doubling) in the model dtype.

    Subclasses change the frequencies (:meth:`inv_freq`: linear, llama3) or the tables
    (:meth:`cos_sin`: LongRoPE's two factor sets). One instance per distinct base: an
    architecture with a per-layer base (local vs global layers) builds one per base in its
    decoder's ``layer_rotaries``."""

    def __init__(
        self,
        head_dim: int,
        base: float,
        scaling: Mapping[str, Any] | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.head_dim = head_dim
        self.rotary_dim = self.table_dims(head_dim, scaling)
        """The dims of each head the tables cover (HF: ``int(head_dim * partial_rotary_factor)``)."""
        self.base = base
        self.scaling = scaling
        missing = [k for k in self.required_keys if (scaling or {}).get(k) is None]
        if missing:
            rtype = (scaling or {}).get("rope_type")
            raise ModelLoadError(f"rope_scaling type {rtype!r} is missing {missing}")
        self.attention_factor = self.cos_sin_scale()
        """Scale of the cos/sin tables (LongRoPE's and YaRN's attention factor; 1 for the
        others)."""
        self.dtype = dtype
        self.device = device
        self._len = 0
        self._cos = self._sin = torch.empty(0)

    @staticmethod
    def table_dims(head_dim: int, scaling: Mapping[str, Any] | None) -> int:
        """The dims of a head the cos/sin tables cover (and rotation reads): the first
        ``partial_rotary_factor`` of it."""
        return int(head_dim * float((scaling or {}).get("partial_rotary_factor", 1.0)))

    required_keys: tuple[str, ...] = ()
    """What the ``rope_scaling`` of this type must say (refused at load, naming them)."""

    def cos_sin_scale(self) -> float:
        """The attention factor the cos/sin tables are scaled by (1: none)."""
        return 1.0

    def inv_freq(self) -> torch.Tensor:
        """Inverse frequencies [rd / 2], float32."""
        rd = self.rotary_dim
        return 1.0 / (self.base ** (torch.arange(0, rd, 2, dtype=torch.int64).float() / rd))

    def tables(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for positions ``0..n-1``: [n, rd] each, in the model dtype."""
        return self._tables(n, self.inv_freq())

    def _tables(self, n: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's ``cos(p * f) * attention_factor`` (and sin) in float32, cast to the model
        dtype: [n, rd] each."""
        freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        return cos.to(self.dtype).to(self.device), sin.to(self.dtype).to(self.device)

    def begin_step(self, positions: torch.Tensor, attn: AttentionMetadata) -> None:
        """Note what a step's sequences are before :meth:`cos_sin` (only LongRoPE needs it)."""

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of ``positions [T]``: [T, 1, rd] each (broadcast over heads)."""
        need = int(positions.max()) + 1 if positions.numel() else 1
        if need > self._len:
            n = max(need, 2 * self._len, 256)
            self._cos, self._sin = self.tables(n)
            self._len = n
        return self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1)


class LinearScalingRotaryEmbedding(RotaryEmbedding):
    """``rope_type: linear``: positions divided by ``factor`` (frequencies, equivalently)."""

    def inv_freq(self) -> torch.Tensor:
        assert self.scaling is not None
        return super().inv_freq() / float(self.scaling["factor"])


class Llama3RotaryEmbedding(RotaryEmbedding):
    """``rope_type: llama3``: low frequencies scaled by ``factor``, high ones kept, a smooth
    ramp between (``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``)."""

    def inv_freq(self) -> torch.Tensor:
        assert self.scaling is not None
        rs, inv = self.scaling, super().inv_freq()
        factor = float(rs["factor"])
        low, high = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old_len = float(rs["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)


_LONGROPE_KEYS = ("short_factor", "long_factor", "original_max_position_embeddings", "factor")
"""What a ``longrope`` scaling must say (the architecture's ``config_fields`` resolves
``factor`` and ``original_max_position_embeddings`` from its config.json, as HF does)."""


class LongRoPERotaryEmbedding(RotaryEmbedding):
    required_keys = _LONGROPE_KEYS

    """``rope_type: longrope`` (Phi-3/4 128k, transformers' ``_compute_longrope_parameters``)::

        inv_freq_s[i] = 1 / (short_factor[i] * base ** (2i / rd))   # short sequences
        inv_freq_l[i] = 1 / (long_factor[i] * base ** (2i / rd))    # long ones
        factor = scaling.factor or max_position_embeddings / original_max_position_embeddings
        attention_factor = scaling.attention_factor
                           or (1 if factor <= 1 else sqrt(1 + ln(factor) / ln(original)))
        cos, sin = cos(p * inv_freq) * attention_factor, sin(p * inv_freq) * attention_factor

    Which set: transformers (``dynamic_rope_update``) takes the long set for a whole forward
    call iff ``max(position_ids) + 1 > original_max_position_embeddings``, so the choice is per
    call, not per position, and for a padded batch it is the longest sequence's. Here it is
    made per sequence of the step, as HF would make it for that sequence alone: a sequence's
    tokens of this step all use the long set iff its last position of the step + 1 exceeds
    ``original_max_position_embeddings`` (a whole-prompt prefill: iff the prompt is longer; a
    decode token: iff its own position + 1 is). Like HF's KV cache, keys written by earlier
    steps keep the set of their own step (a chunked prompt's first chunks, a prefix-cache hit).
    The decoder calls :meth:`begin_step` with the step's positions and sequences first."""

    required_keys = _LONGROPE_KEYS

    def __init__(
        self,
        head_dim: int,
        base: float,
        scaling: Mapping[str, Any] | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(head_dim, base, scaling, dtype, device)
        assert scaling is not None
        self.original = int(scaling["original_max_position_embeddings"])
        factor = float(scaling["factor"])
        attn = scaling.get("attention_factor")
        if attn is None:
            attn = (
                1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(self.original))
            )
        self.attention_factor = float(attn)
        self._long_tables = (torch.empty(0), torch.empty(0))
        self._long_rows: torch.Tensor | None = None

    def _factored(self, key: str) -> torch.Tensor:
        assert self.scaling is not None
        ext = torch.tensor(self.scaling[key], dtype=torch.float32)
        rd = self.rotary_dim
        return 1.0 / (ext * self.base ** (torch.arange(0, rd, 2, dtype=torch.int64).float() / rd))

    def inv_freq(self) -> torch.Tensor:
        """The short set's inverse frequencies [rd / 2] (HF's ``original_inv_freq``)."""
        return self._factored("short_factor")

    def begin_step(self, positions: torch.Tensor, attn: AttentionMetadata) -> None:
        """Each token of the step takes the long set iff its sequence's last position in the
        step + 1 exceeds ``original`` (decode tokens: their own; prefill spans: the span's last)."""
        last = positions.clone()  # [T] each token's sequence's last position in the step
        for span in attn.prefills:
            last[span.tok_start : span.tok_end] = positions[span.tok_end - 1]
        self._long_rows = (last + 1 > self.original)[:, None, None]  # [T, 1, 1]

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of ``positions [T]`` from the set :meth:`begin_step` chose per token:
        [T, 1, rd] each. Without a :meth:`begin_step` for these positions, each token by its
        own position (HF's choice for a decode token; for a prompt longer than ``original``
        HF takes the long set from its first position, so decoders call begin_step)."""
        long_rows, self._long_rows = self._long_rows, None
        if long_rows is None or long_rows.shape[0] != positions.shape[0]:
            long_rows = (positions + 1 > self.original)[:, None, None]  # [T, 1, 1]
        short_cos, short_sin = super().cos_sin(positions)  # grows the short tables
        if self._long_tables[0].shape[0] != self._len:
            self._long_tables = self._tables(self._len, self._factored("long_factor"))
        long_cos = self._long_tables[0][positions].unsqueeze(1)
        long_sin = self._long_tables[1][positions].unsqueeze(1)
        return (
            torch.where(long_rows, long_cos, short_cos),
            torch.where(long_rows, long_sin, short_sin),
        )


class ProportionalRotaryEmbedding(RotaryEmbedding):
    """``rope_type: proportional`` (Gemma 4's full-attention layers, transformers'
    ``_compute_proportional_rope_parameters``): the frequencies of a whole head, of which only
    the first ``partial_rotary_factor`` rotate::

        n = int(partial_rotary_factor * hd // 2)              # rotated angles
        inv_freq[i] = base ** (-2i / hd) / factor   for i < n   (exponent over hd, not rd)
        inv_freq[i] = 0                             for n <= i < hd / 2

    and the rotation runs over the whole head (rotate-half pairs ``i`` with ``i + hd / 2``):
    a zero frequency gives cos 1 and sin 0, so dims ``n .. hd/2`` and ``hd/2 + n .. hd`` pass
    through unchanged, as in HF (unlike the other types' partial rotary on the first ``rd``)."""

    @staticmethod
    def table_dims(head_dim: int, scaling: Mapping[str, Any] | None) -> int:
        return head_dim  # tables over the whole head, zeros past the rotated angles

    def inv_freq(self) -> torch.Tensor:
        rs, hd = self.scaling or {}, self.head_dim
        angles = int(float(rs.get("partial_rotary_factor", 1.0)) * hd // 2)
        rotated = 1.0 / (
            self.base ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / hd)
        )
        inv = torch.cat((rotated, torch.zeros(hd // 2 - angles, dtype=torch.float32)))
        return inv / float(rs.get("factor", 1.0))


class YaRNRotaryEmbedding(RotaryEmbedding):
    """``rope_type: yarn`` (GPT-OSS; transformers' ``_compute_yarn_parameters``)::

        pos[i]  = base ** (2i / rd);  extra = 1 / pos;  inter = 1 / (factor * pos)
        low, high = the dims where beta_fast and beta_slow rotations fit in the original length:
                    d(n) = rd ln(original / (2 pi n)) / (2 ln base), floored / ceiled if
                    ``truncate`` (default True), clipped to [0, rd - 1]
        ramp[i] = clamp((i - low) / (high - low), 0, 1)    (high += 0.001 where low == high)
        inv_freq = inter * ramp + extra * (1 - ramp)
        attention_factor = scaling.attention_factor or mscale(factor, mscale) /
                           mscale(factor, mscale_all_dim) (both given) or mscale(factor),
                           mscale(s, m) = 1 if s <= 1 else 0.1 m ln(s) + 1
        cos, sin = cos(p * inv_freq) * attention_factor, sin(...) * attention_factor

    ``factor`` must be set (the architecture's ``config_fields`` fills it from
    ``max_position_embeddings / original_max_position_embeddings`` where HF would)."""

    required_keys = ("factor", "original_max_position_embeddings")

    def cos_sin_scale(self) -> float:
        assert self.scaling is not None
        rs, factor = self.scaling, float(self.scaling["factor"])
        if rs.get("attention_factor") is not None:
            return float(rs["attention_factor"])
        mscale, all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
        if mscale and all_dim:
            return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(all_dim))
        return _yarn_mscale(factor)

    def inv_freq(self) -> torch.Tensor:
        assert self.scaling is not None
        rs, rd, base = self.scaling, self.rotary_dim, self.base
        factor = float(rs["factor"])
        original = float(rs["original_max_position_embeddings"])
        fast, slow = float(rs.get("beta_fast") or 32), float(rs.get("beta_slow") or 1)

        def dim_of(rotations: float) -> float:
            return (rd * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = dim_of(fast), dim_of(slow)
        if rs.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rd - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(rd // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        pos = base ** (torch.arange(0, rd, 2).to(dtype=torch.float) / rd)
        extra_factor = 1 - ramp
        return (1.0 / (factor * pos)) * (1 - extra_factor) + (1.0 / pos) * extra_factor


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's ``mscale`` (Eq. 21): ``0.1 * mscale * ln(scale) + 1``, 1 for ``scale <= 1``."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


ROPE_TYPES: dict[str, type[RotaryEmbedding]] = {
    "default": RotaryEmbedding,
    "linear": LinearScalingRotaryEmbedding,
    "llama3": Llama3RotaryEmbedding,
    "longrope": LongRoPERotaryEmbedding,
    "proportional": ProportionalRotaryEmbedding,
    "yarn": YaRNRotaryEmbedding,
}
"""``rope_scaling.rope_type`` -> its rotary class; ``parse_model_config`` refuses the others."""


def make_rotary(
    head_dim: int,
    base: float,
    scaling: Mapping[str, Any] | None,
    dtype: torch.dtype,
    device: torch.device,
) -> RotaryEmbedding:
    """The rotary embedding for ``scaling`` (None: default RoPE)."""
    rtype = "default" if scaling is None else str(scaling["rope_type"])
    return ROPE_TYPES[rtype](head_dim, base, scaling, dtype, device)
