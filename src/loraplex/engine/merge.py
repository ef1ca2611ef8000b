"""One adapter merged into the base weights while it is the only one running (dLoRA's insight).

When every sequence of ``after_steps`` consecutive steps uses the same adapter, a background
thread builds merged copies of only the fused projections the adapter targets::

    W' = (W + scale * B @ A)   in float32, then cast to the model dtype (as PEFT's merge)

packed with the model's own Linear factory. Before each run the model runner tells the merger
the step's lone adapter (:meth:`AdapterMerger.before_step`); the merger swaps those Linear
objects into the decoder layers and the runner treats that adapter's tokens as base tokens (no
LoRA ops); a step with a second adapter or a base request first swaps the original objects back.
Base weights are never written: unmerging is restoring references, so base outputs stay exact.
Switches never wait for a merge: until the build is ready the adapter runs unmerged. The last
build is kept (keyed by the adapter's digest), so a burst that resumes re-merges at once.

An adapter's LoRA on ``embed_tokens`` / ``lm_head`` is never merged: its tokens keep the
gathered path for those two modules (:func:`vocab_modules`; the runner plans only them). A merged
copy would be a second ``[vocab, hidden]`` matrix per module (often the largest tensor of a
small model), a tied model's one matrix would have to become two (the head's delta must never
reach the lookup), and where the delta enters an embedding depends on the architecture's
embedding scale; the gathered path costs two small ops per step.

A MoE layer's router and experts stay gathered too (:func:`vocab_modules` names them with the
vocabulary modules, and so does its shared expert): a merged copy would be every expert of the layer (an expert adapter of a
30B-A3B base would copy most of the base), while the gathered path reads only the experts the
step's tokens chose, and only their LoRA rows. The attention projections merge as in a dense
model. A linear-attention layer's projections (Qwen3.5) stay gathered as well: they are not
fused slots of the merger; so do Gemma 4's per-layer input modules (beside the fused
projections: its ``per_layer_model_projection``, each layer's input gate and projection).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from loraplex.checkpoint.modules import (
    EXPERT_PROJ_NAMES,
    LINEAR_ATTN_PROJ_NAMES,
    PER_LAYER_INPUT_PROJ_NAMES,
    ROUTER,
    SHARED_EXPERT_GATE,
    SHARED_EXPERT_PROJ_NAMES,
    VOCAB_LAYER,
)
from loraplex.model.decoder import DecoderForCausalLM
from loraplex.model.linear import Linear, LinearFactory, dense_weight

if TYPE_CHECKING:
    from loraplex.lora.adapter import LoRAModuleWeights

GroupKey = tuple[int, str]
"""``(layer index, fused Linear attribute)``: ``qkv``, ``o``, ``gate_up`` or ``down``."""


def projection_rows(model: DecoderForCausalLM, layer: int) -> dict[str, tuple[str, int, int]]:
    """proj name -> (fused Linear attribute, first output row, input features) in ``layer``."""
    return {
        proj: (attr, lo, d_in)
        for attr, d_in, parts in model.layer_projection_groups(layer)
        for proj, lo, _ in parts
    }


def targeted_groups(
    model: DecoderForCausalLM, weights: Mapping[tuple[int, str], LoRAModuleWeights]
) -> set[GroupKey]:
    """The fused projections an adapter's modules fall in (embed_tokens / lm_head: none)."""
    gathered = vocab_modules(weights)
    return {
        (layer, projection_rows(model, layer)[proj][0])
        for layer, proj in weights
        if (layer, proj) not in gathered
    }


_GATHERED_PROJS = frozenset(
    (
        ROUTER,
        *EXPERT_PROJ_NAMES,
        *SHARED_EXPERT_PROJ_NAMES,
        SHARED_EXPERT_GATE,
        *LINEAR_ATTN_PROJ_NAMES,
        *PER_LAYER_INPUT_PROJ_NAMES,
    )
)


def vocab_modules(weights: Mapping[tuple[int, str], object]) -> frozenset[tuple[int, str]]:
    """The adapter's modules that stay gathered when it runs merged: ``embed_tokens`` /
    ``lm_head``, a MoE layer's router and experts, Gemma 4's per-layer input modules (module
    docstring)."""
    return frozenset(k for k in weights if k[0] == VOCAB_LAYER or k[1] in _GATHERED_PROJS)


def build_merged(
    model: DecoderForCausalLM,
    base: Mapping[GroupKey, Linear],
    weights: Mapping[tuple[int, str], LoRAModuleWeights],
    make: LinearFactory,
) -> dict[GroupKey, Linear]:
    """Merged Linears for every fused projection ``weights`` touch, from the ``base`` Linears
    of those projections (the others stay shared). Reads the base, never writes it."""
    groups: dict[GroupKey, list[tuple[int, LoRAModuleWeights]]] = {}
    in_features: dict[GroupKey, int] = {}
    gathered = vocab_modules(weights)
    for (layer, proj), w in weights.items():
        if (layer, proj) in gathered:
            continue  # stays on the gathered path (module docstring)
        group, first, d_in = projection_rows(model, layer)[proj]
        groups.setdefault((layer, group), []).append((first, w))
        in_features[(layer, group)] = d_in
    out: dict[GroupKey, Linear] = {}
    with torch.inference_mode():
        for key, mods in groups.items():
            w0, bias = dense_weight(base[key], in_features[key])
            merged = w0.to(torch.float32)  # [out, in]
            if merged.data_ptr() == w0.data_ptr():
                merged = merged.clone()  # never write the base weight
            for first, w in mods:
                a = w.a.to(device=merged.device, dtype=torch.float32)  # [r, in]
                b = w.b.to(device=merged.device, dtype=torch.float32)  # [d_out, r]
                merged[first : first + b.shape[0]].addmm_(b, a, alpha=float(w.scale))
            out[key] = make(merged.to(model.dtype), bias)
    return out


@dataclass
class _Build:
    digest: str
    done: threading.Event = field(default_factory=threading.Event)
    linears: dict[GroupKey, Linear] | None = None
    error: BaseException | None = None


class AdapterMerger:
    """The merge policy and the swaps (called by the runner, on the engine thread); builds run
    on a background thread."""

    def __init__(self, model: DecoderForCausalLM, make: LinearFactory, after_steps: int) -> None:
        if after_steps < 1:
            raise ValueError(f"after_steps must be >= 1, got {after_steps}")
        self.model = model
        self.make = make
        self.after_steps = after_steps
        self.merged_digest: str | None = None  # installed now
        self.merges = 0  # installs (for reports and tests)
        self._originals: dict[GroupKey, Linear] = {}
        self._build: _Build | None = None  # the latest build, in flight or done
        self._streak_digest: str | None = None
        self._streak = 0

    def before_step(
        self, digest: str | None, weights: Mapping[tuple[int, str], LoRAModuleWeights] | None
    ) -> bool:
        """Called before each step with the one adapter every sequence of the step uses
        (``digest`` and its ``weights``; None when the step has base sequences or several
        adapters). Unmerges when the step is not that merged adapter's alone, starts a build
        after ``after_steps`` single-adapter steps and installs a finished one. Returns whether
        the step runs merged (the runner must then treat that adapter's tokens as base)."""
        if digest != self.merged_digest:
            self.unmerge()
        if digest is None or weights is None:
            self._streak_digest, self._streak = None, 0
            return False
        if digest == self._streak_digest:
            self._streak += 1
        else:
            self._streak_digest, self._streak = digest, 1
        if self.merged_digest == digest:
            return True
        if self._streak < self.after_steps:
            return False
        build = self._build
        if build is None or build.digest != digest:
            self._start(digest, weights)  # the older build (another adapter) is dropped
            return False
        if not build.done.is_set():
            return False
        if build.error is not None:
            self._build = None
            raise build.error
        assert build.linears is not None
        self._install(digest, build.linears)
        return True

    def unmerge(self) -> None:
        """Put the base Linear objects back (a reference swap; the base weights were never
        written)."""
        for (layer, group), lin in self._originals.items():
            setattr(self.model.layers[layer], group, lin)
        self._originals = {}
        self.merged_digest = None

    def wait_build(self, timeout: float) -> bool:
        """Wait for the build in flight (tests and benchmarks); True when none is pending."""
        build = self._build
        return build is None or build.done.wait(timeout)

    def _start(self, digest: str, weights: Mapping[tuple[int, str], LoRAModuleWeights]) -> None:
        build = _Build(digest)
        self._build = build
        assert self.merged_digest is None  # the layers hold the base Linears now
        layers = self.model.layers
        base = {k: getattr(layers[k[0]], k[1]) for k in targeted_groups(self.model, weights)}

        def run() -> None:
            try:
                build.linears = build_merged(self.model, base, weights, self.make)
            except BaseException as e:  # raised on the engine thread by before_step
                build.error = e
            build.done.set()

        threading.Thread(target=run, name="loraplex-lora-merge", daemon=True).start()

    def _install(self, digest: str, linears: Mapping[GroupKey, Linear]) -> None:
        for (layer, group), lin in linears.items():
            L = self.model.layers[layer]
            self._originals[(layer, group)] = getattr(L, group)
            setattr(L, group, lin)
        self.merged_digest = digest
        self.merges += 1
