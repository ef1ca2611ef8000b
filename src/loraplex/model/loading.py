"""Loading a decoder from an HF safetensors checkpoint: :func:`load_model`.

The architecture's class (``model/registry.py``) gives the module tree and says how the
checkpoint names its tensors (its hooks: ``checkpoint_name``, ``layer_weights_of``,
``norm_dims``, ``take_tensor``, ``check_own_tensors``, ``build_own``); ``model/checkpoint_files.py``
reads the tensors out of the files. This module puts them into the model:

- dense: each tensor checked against the shape ``config.json`` implies and read straight into
  its final buffer; the parts of one fused slot (q/k/v, gate/up) concatenated into one weight;
- quantized: a quantized checkpoint's tensors of one projection unpacked together
  (``model/quant/formats.py``) and its slot's parts fused; ``--quantization int8/int4``
  quantizes each weight as soon as it is read (and the embedding and LM head at the end);
- tensor-parallel: an empty model of the rank's shard, each tensor checked whole and then cut
  to the rank's part (``model/tensor_parallel/sharding.py``).

Every missing, unexpected or misshapen tensor is a ``ModelLoadError`` naming the tensor.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from loraplex.model.checkpoint_files import iter_checkpoint
from loraplex.model.decoder import LINEAR_SLOTS, DecoderForCausalLM
from loraplex.model.layers import ProjectionGroup
from loraplex.model.linear import Linear, select_linear_factory
from loraplex.model.quant.formats import QuantSpec, is_quantized_tensor, unpack_projection
from loraplex.model.quant.kernels import QuantKernels
from loraplex.model.quant.weights import FP8Weight, QuantizedEmbedding, QuantWeight
from loraplex.model.registry import model_class
from loraplex.model.spec import ModelConfig
from loraplex.model.tensor_parallel.sharding import TensorParallel, VocabShard
from loraplex.types import ModelLoadError

TOP_WEIGHTS = {
    "model.embed_tokens.weight": "embed_tokens",
    "model.norm.weight": "norm",
    "lm_head.weight": "lm_head",
}
"""Canonical names of the tensors outside the layers (see ``checkpoint_name``)."""

_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.(.+)\.([A-Za-z_]+)")

Tensors = dict[str, torch.Tensor]


def load_model(
    model_dir: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    quant: QuantSpec | None = None,
    tp: TensorParallel | None = None,
) -> DecoderForCausalLM:
    """The decoder of ``cfg.architecture`` (parsed by ``parse_model_config``, which refused any
    other) with the checkpoint's weights, loaded tensor by tensor into their final buffers.
    ``quant``: the checkpoint's quantization format, or int8/int4 to quantize at load. ``tp``:
    load only this tensor-parallel rank's shard (each tensor checked whole, then cut)."""
    cls = model_class(cfg.architecture, cfg.raw)
    if quant is not None and not cls.supports_quantization:
        raise ModelLoadError(
            f"{cfg.architecture}: quantized bases are not supported for this architecture "
            f"({quant.label}); serve its float checkpoint"
        )
    if quant is not None and not quant.on_the_fly and not cls.supports_quantized_checkpoints:
        raise ModelLoadError(
            f"{cfg.architecture}: quantized checkpoints ({quant.label}) are not supported for "
            "this architecture; serve its float checkpoint (--quantization int8/int4 quantizes "
            "it at load)"
        )
    model = cls(cfg, dtype, device) if tp is None else _sharded(cls, cfg, dtype, device, tp, quant)
    model.quant = quant
    top, layers = CheckpointReader(model).read(Path(model_dir))
    _build(model, top, layers)
    model.build_own()
    return model


def _sharded(
    cls: type[DecoderForCausalLM],
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel,
    quant: QuantSpec | None,
) -> DecoderForCausalLM:
    """An empty model of rank ``tp.rank``'s shard (its blocks sum their row-parallel outputs
    over the ranks; its logits are gathered on rank 0)."""
    where = f"--tensor-parallel-size {tp.size}"
    if not cls.supports_tensor_parallel:
        raise ModelLoadError(f"{where}: {cfg.architecture} does not shard yet; use 1")
    if quant is not None:
        raise ModelLoadError(
            f"{where}: quantized bases ({quant.label}) do not shard yet; serve the float "
            "checkpoint, or --tensor-parallel-size 1"
        )
    model = cls(cls.shard_config(cfg, tp.layout), dtype, device)
    model.tp, model.full_cfg = tp, cfg
    for block in model.row_parallel_blocks():
        block.reduce = tp.all_reduce
    model._gather_logits = functools.partial(tp.gather_vocab, vocab=cfg.vocab_size)
    return model


class CheckpointReader:
    """One read of a checkpoint into a model's buffers: per tensor, its canonical name (the
    architecture's ``checkpoint_name``), the shape the (whole) config implies, the fusing of a
    slot's parts, this rank's cut and the quantization; then the check that nothing is missing."""

    def __init__(self, model: DecoderForCausalLM) -> None:
        self.model = model
        self._groups: dict[int, tuple[ProjectionGroup, ...]] = {}

    def groups(self, layer: int) -> tuple[ProjectionGroup, ...]:
        """``layer``'s projection groups as the checkpoint has them (whole under tensor
        parallelism: ``whole_projection_groups``)."""
        got = self._groups.get(layer)
        if got is None:
            m = self.model
            whole = m.tp is not None
            got = m.whole_projection_groups(layer) if whole else m.layer_projection_groups(layer)
            self._groups[layer] = got
        return got

    def offsets(self, layer: int) -> dict[str, int]:
        """Each projection's first column in its (whole) slot of ``layer``: where the rank's
        cut starts."""
        return {p: lo for _, _, parts in self.groups(layer) for p, lo, _ in parts}

    def read(self, model_dir: Path) -> tuple[Tensors, list[Tensors]]:
        """(top-level tensors by attribute, per layer ``{"<slot>.<weight|bias>": tensor}``)."""
        m = self.model
        cfg, dtype, device = m.cfg, m.dtype, m.device
        top: Tensors = {}
        layers: list[Tensors] = [{} for _ in range(cfg.num_layers)]
        pending: dict[tuple[int, str], dict[int, torch.Tensor]] = {}  # parts of fused slots
        quantized: dict[tuple[int, str], Tensors] = {}  # (layer, module) -> tensors
        packed = m.quant if m.quant is not None and not m.quant.on_the_fly else None
        for name, st in iter_checkpoint(model_dir):
            key = m.checkpoint_name(name)
            if key is None or (key == "lm_head.weight" and cfg.tie_word_embeddings):
                continue  # a tied head is the embedding
            shape = tuple(st.entries[name].shape)
            if packed is not None and self._take_quantized(key, st.entries[name].dtype, packed):
                q = _LAYER_TENSOR.fullmatch(key)
                assert q is not None
                quantized.setdefault((int(q.group(1)), q.group(2)), {})[q.group(3)] = st.read(
                    name
                )  # raw dtype: unpacked once all of the module's tensors are in
                continue
            if m.take_tensor(
                key, functools.partial(st.read, name, dtype=dtype, device=device), shape
            ):
                continue
            if key in TOP_WEIGHTS:
                self._check_shape(st.entries[name].shape, self._top_shape(key), name, model_dir)
                t = st.read(name, dtype, device)
                if m.tp is not None and key != "model.norm.weight":
                    t = m.tp.shard_vocab(t)  # the rank's vocabulary rows
                top[TOP_WEIGHTS[key]] = t
                continue
            lm = _LAYER_KEY.fullmatch(key)
            entry = m.layer_weights_of(int(lm.group(1))).get(lm.group(2)) if lm else None
            if lm is None or entry is None:
                raise ModelLoadError(
                    f"{model_dir}: unexpected tensor {name!r} for {cfg.architecture}"
                )
            idx, kind = int(lm.group(1)), lm.group(3)
            if idx >= cfg.num_layers:
                raise ModelLoadError(
                    f"{model_dir}: unexpected tensor {name} (layer {idx} >= {cfg.num_layers})"
                )
            slot, part = entry
            nparts = Counter(s for s, _ in m.layer_weights_of(idx).values())
            want = self._layer_shape(slot, part, nparts[slot], kind, name, model_dir, idx)
            self._check_shape(st.entries[name].shape, want, name, model_dir)
            t = st.read(name, dtype, device)
            if nparts[slot] == 1:
                t = self._shard_slot(idx, slot, kind, t)
                layers[idx][f"{slot}.{kind}"] = self._quantize_at_load(t, slot, kind, name)
                continue
            got = pending.setdefault((idx, f"{slot}.{kind}"), {})
            got[part] = t
            if len(got) == nparts[slot]:
                fused = self._shard_slot(
                    idx, slot, kind, torch.cat([got[p] for p in range(nparts[slot])])
                )
                layers[idx][f"{slot}.{kind}"] = self._quantize_at_load(fused, slot, kind, name)
                del pending[(idx, f"{slot}.{kind}")]
        if packed is not None:
            self._assemble_quantized(packed, quantized, layers, model_dir)
        self._check_complete(top, layers, pending, model_dir)
        m.check_own_tensors(model_dir)
        return top, layers

    def _shard_slot(self, layer: int, slot: str, kind: str, t: Any) -> Any:
        """This rank's part of a fused slot's full tensor (as it is on one device)."""
        m = self.model
        if m.tp is None or slot not in LINEAR_SLOTS:
            return t
        return m.shard_slot(layer, slot, kind, t, self.offsets(layer))

    def _quantize_at_load(self, t: torch.Tensor, slot: str, kind: str, name: str) -> Any:
        """A projection weight quantized as soon as it is read (``--quantization int8/int4``),
        so a float copy of only one slot is ever resident; anything else as it is."""
        spec = self.model.quant
        if spec is None or not spec.on_the_fly or kind != "weight" or slot not in LINEAR_SLOTS:
            return t
        try:
            return QuantWeight.quantize(t, spec.bits or 8, spec.group_size)
        except ValueError as e:
            raise ModelLoadError(f"--quantization {spec.label}: {name}: {e}") from e

    def _take_quantized(self, key: str, dtype: str, spec: QuantSpec) -> bool:
        """Whether ``key`` is a tensor of a quantized projection (it is then unpacked with its
        module's others by ``_assemble_quantized``)."""
        m = _LAYER_TENSOR.fullmatch(key)
        if m is None or int(m.group(1)) >= self.model.cfg.num_layers:
            return False
        entry = self.model.layer_weights_of(int(m.group(1))).get(m.group(2))
        return (
            entry is not None
            and entry[0] in LINEAR_SLOTS
            and is_quantized_tensor(spec, m.group(3), dtype)
        )

    def _assemble_quantized(
        self,
        spec: QuantSpec,
        quantized: dict[tuple[int, str], Tensors],
        layers: list[Tensors],
        src: object,
    ) -> None:
        """Unpack each quantized projection and fuse a slot's parts (q/k/v, gate/up) into one
        weight in ``layers[i]["<slot>.weight"]``; every part of a slot must be quantized."""
        weights_of = self.model.layer_weights_of
        by_slot: dict[tuple[int, str], dict[int, QuantWeight | FP8Weight]] = {}
        for (idx, module), tensors in quantized.items():
            weights = weights_of(idx)
            slot, part = weights[module]
            nparts = sum(1 for s, _ in weights.values() if s == slot)
            n, k = self._layer_shape(slot, part, nparts, "weight", module, src, idx)
            where = f"{src}: model.layers.{idx}.{module}"
            weight = unpack_projection(spec, tensors, n, k, where)
            by_slot.setdefault((idx, slot), {})[part] = weight
        for (idx, slot), parts in by_slot.items():
            modules = [m for m, (s, _) in weights_of(idx).items() if s == slot]
            if len(parts) != len(modules):
                plain = [m for m, (s, p) in weights_of(idx).items() if s == slot and p not in parts]
                raise ModelLoadError(
                    f"{src}: layer {idx}: {plain} not quantized while the other projections "
                    f"sharing their input are ({spec.label}); loraplex fuses them into one GEMM"
                )
            ordered = [parts[p] for p in sorted(parts)]
            try:
                fused = type(ordered[0]).cat(ordered) if len(ordered) > 1 else ordered[0]  # type: ignore[attr-defined]
            except ValueError as e:
                raise ModelLoadError(f"{src}: layer {idx} {slot}: {e}") from e
            layers[idx][f"{slot}.weight"] = fused  # type: ignore[assignment]

    def _top_shape(self, key: str) -> tuple[int, ...]:
        c = self.model.full_cfg
        return (c.hidden_size,) if key == "model.norm.weight" else (c.vocab_size, c.hidden_size)

    def _layer_shape(
        self, slot: str, part: int, nparts: int, kind: str, name: str, src: object, layer: int
    ) -> tuple[int, ...]:
        """The shape config.json implies for part ``part`` of ``slot`` (``nparts`` parts) in
        ``layer`` (whose groups and norms may be its own: ``layer_projection_groups``)."""
        m = self.model
        group = next((g for g in self.groups(layer) if g[0] == slot), None)
        if group is None:  # a norm: a weight of its width, never a bias
            if kind != "weight":
                raise ModelLoadError(f"{src}: unexpected tensor {name!r}")
            return (m.layer_norm_dims(layer)[slot],)
        _, d_in, cols = group
        lo, hi = (cols[part][1], cols[part][2]) if nparts == len(cols) else (0, cols[-1][2])
        return (hi - lo, d_in) if kind == "weight" else (hi - lo,)

    @staticmethod
    def _check_shape(shape: tuple[int, ...], want: tuple[int, ...], name: str, src: object) -> None:
        if tuple(shape) != want:
            raise ModelLoadError(
                f"{src}: tensor {name!r} has shape {tuple(shape)}, config.json implies {want}"
            )

    def _check_complete(
        self,
        top: Tensors,
        layers: list[Tensors],
        pending: dict[tuple[int, str], dict[int, torch.Tensor]],
        src: object,
    ) -> None:
        """Every tensor the config needs is there: each weight, the biases it asks for, and
        every part of a fused bias the checkpoint started."""
        c = self.model.cfg
        for key, attr in TOP_WEIGHTS.items():
            if attr not in top and not (attr == "lm_head" and c.tie_word_embeddings):
                raise ModelLoadError(f"{src}: missing tensor {key!r}")
        biased = {"qkv": c.qkv_bias, "o": c.o_bias, "gate_up": c.mlp_bias, "down": c.mlp_bias}
        for idx, have in enumerate(layers):
            missing = []
            for module, (slot, part) in self.model.layer_weights_of(idx).items():
                for kind in ("weight", "bias"):
                    key = f"{slot}.{kind}"
                    started = pending.get((idx, key))
                    needed = kind == "weight" or biased.get(slot, False) or started is not None
                    if key not in have and needed and part not in (started or {}):
                        missing.append(f"model.layers.{idx}.{module}.{kind}")
            if missing:
                raise ModelLoadError(f"{src}: layer {idx} is missing tensor(s) {missing}")


def _build(model: DecoderForCausalLM, top: Tensors, layers: list[Tensors]) -> None:
    """Choose the linear implementation once and build every norm and projection of ``model``
    from the tensors read (the architecture's own ones follow: ``build_own``)."""
    c, norm = model.cfg, model.norm_class
    probe = (2 * c.intermediate_size, c.hidden_size)  # gate/up: the largest projection
    model.linear_impl, make = select_linear_factory(model.device, model.dtype, probe=probe)
    model.make_linear = make
    projection = make
    if model.quant is not None:
        model.quant_kernels = QuantKernels(model.device, model.dtype)
        projection = _quantized_factory(model.quant_kernels, make)
    model.make_projection = projection
    for L, w in zip(model.layers, layers, strict=True):
        for slot in LINEAR_SLOTS:
            if f"{slot}.weight" in w:  # a MoE layer has no dense gate_up / down
                weight, bias = w.pop(f"{slot}.weight"), w.pop(f"{slot}.bias", None)
                setattr(L, slot, projection(weight, bias))
        if model.qk_norm and "q_norm.weight" in w:  # a hybrid's linear layers have none
            q, k = w.pop("q_norm.weight"), w.pop("k_norm.weight")
            L.qk_norm = norm.per_head(q, k, c.num_heads, c.num_kv_heads, c.rms_norm_eps)
        for key in list(w):
            setattr(L, key.partition(".")[0], norm(w.pop(key), c.rms_norm_eps))
    model.embed_tokens = top["embed_tokens"]
    model.norm = norm(top["norm"], c.rms_norm_eps)
    if model.quant is not None and model.quant.on_the_fly:
        _quantize_vocab(model, top)
    else:  # a tied head shares the embedding (a packed backend makes the head its own
        # copy); it stays in the model dtype in a quantized checkpoint, as formats leave it
        model.head = make(top.get("lm_head", model.embed_tokens), None)
    if model.quant_kernels is not None:
        assert model.quant is not None
        model.linear_impl = f"{model.quant.label}: {model.quant_kernels.summary() or 'dequant'}"
    if model.tp is not None:  # looked up masked and summed over the ranks
        model.embed_tokens = VocabShard(model.embed_tokens, model.tp)  # type: ignore[assignment]


def _quantize_vocab(model: DecoderForCausalLM, top: Tensors) -> None:
    """``--quantization int8/int4``: the embedding and the LM head as int8, one scale per row
    (the head's rows are the logits' and the lookup's, so per-row scales keep each token's row
    exact to its own range); a tied pair stays one matrix. These two matrices are a large share
    of a small model's bytes (a quarter of SmolLM2-135M's); int8 keeps them at a byte a weight,
    twice the precision of the projections' int4."""
    assert model.quant_kernels is not None
    emb = QuantWeight.quantize(top.pop("embed_tokens"), 8, None)
    model.embed_tokens = QuantizedEmbedding(emb, model.dtype)  # type: ignore[assignment]
    head = emb if "lm_head" not in top else QuantWeight.quantize(top.pop("lm_head"), 8, None)
    model.head = model.quant_kernels(head)
    if head is emb and getattr(model.head, "quant", None) is None:
        # the head's kernel keeps the matrix only in its own layout: look rows up there
        model.embed_tokens = QuantizedEmbedding(model.head, model.dtype)  # type: ignore[assignment]


def _quantized_factory(
    kernels: QuantKernels, make: Callable[..., Linear]
) -> Callable[[Any, torch.Tensor | None], Linear]:
    """The projections' Linear factory on a quantized base: a quantized weight (the
    checkpoint's, or quantized at load by ``--quantization int8/int4``) goes to its kernel; one
    the checkpoint left in float (``ignore``) stays float."""

    def build(weight: Any, bias: torch.Tensor | None) -> Linear:
        if isinstance(weight, (QuantWeight, FP8Weight)):  # a checkpoint's, or at load
            return kernels(replace(weight, bias=bias))
        return make(weight, bias)  # a projection the checkpoint left in float

    return build
