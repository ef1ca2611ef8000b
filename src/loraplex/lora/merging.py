"""Merging LoRA adapters into one new PEFT adapter, with the arithmetic of PEFT's
``add_weighted_adapter`` (the semantics are in :mod:`loraplex.lora.peft.merging`).

Inputs are adapters as read (config + tensors); the output is a PEFT config and tensors that
:func:`write_peft_adapter` saves as ``adapter_config.json`` + ``adapter_model.safetensors``.
Everything is computed in float32 on the CPU, and saved in float32.

Where loraplex departs from PEFT (whose result then differs from the weighted combination it
means), the departure is the intended combination:

- the result adapts exactly the modules some input adapts (``target_modules`` names them in
  full); PEFT takes ``layers_to_transform`` / ``exclude_modules`` from the first adapter, so
  a module only a later adapter reaches outside those layers would be dropped;
- ``use_rslora`` is off in the result (its scale ``lora_alpha / r`` is 1, as PEFT means it);
  PEFT copies the first adapter's ``use_rslora`` and then scales the result by ``sqrt(r)``;
- every module of the result has the config's rank: a module merged at a lower rank (an input
  with ``rank_pattern``, or an SVD rank above the module's dimensions) is padded with zero
  rows of A and columns of B, which change nothing.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from loraplex.checkpoint.modules import EMBED_TOKENS
from loraplex.lora.adapter import read_adapter
from loraplex.lora.peft.activation import invocation_tokens
from loraplex.lora.peft.config import parse_lora_config
from loraplex.lora.peft.files import CONFIG_NAME, SAFETENSORS_NAME
from loraplex.lora.peft.merging import (
    RANDOM_TYPES,
    SAME_RANK_TYPES,
    MergeSpec,
    merge_error,
    module_seed,
)
from loraplex.lora.peft.tensors import parse_base_copy, parse_tensor_key
from loraplex.types import AdapterError

_QUANTILE_MAX = 2**24
"""The most elements ``torch.quantile`` takes; a larger SVD clamp sorts instead."""


@dataclass(frozen=True)
class _Factors:
    """One adapter's LoRA on one module, in float32."""

    a: torch.Tensor  # [r, d_in] (embedding: [r, vocab])
    b: torch.Tensor  # [d_out, r] (embedding: [dim, r])
    scale: float  # alpha / r (or alpha / sqrt(r)) of this module
    embedding: bool


def _config_rank(config: Mapping[str, Any]) -> int:
    """PEFT's rank of an adapter for a merge: ``r``, or the largest ``rank_pattern`` value."""
    return max([config.get("r", 8), *(config.get("rank_pattern") or {}).values()])


def _factors_of(
    config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
) -> dict[str, _Factors]:
    """``module -> factors`` of one adapter; refuses what a merge cannot carry over."""
    settings = parse_lora_config(config)
    if invocation_tokens(dict(config)) is not None:
        raise merge_error("an activated LoRA (alora_invocation_tokens) cannot be merged")
    if settings.target_parameters:
        raise merge_error("adapters on parameters (target_parameters) cannot be merged")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        key = parse_tensor_key(name)
        if key is None:
            if parse_base_copy(name) is not None:
                continue  # PEFT's copy of the base's embedding matrix: not part of the LoRA
            raise merge_error(
                f"cannot merge tensor {name!r}: only the LoRA A/B of linear modules and of the "
                "token embedding are merged (not a MoE's experts)"
            )
        pairs.setdefault(key.module, {})[key.ab] = t
    out = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"} or ab["A"].dim() != 2 or ab["B"].dim() != 2:
            raise merge_error(f"module {module}: needs one 2-D LoRA A and B")
        a, b = ab["A"].to(torch.float32), ab["B"].to(torch.float32)
        if a.shape[0] != b.shape[1]:
            raise merge_error(
                f"module {module}: A {list(a.shape)} and B {list(b.shape)} differ in rank"
            )
        _, scale = settings.rank_and_scale(module)
        out[module] = _Factors(a, b, scale, module.rsplit(".", 1)[-1] == EMBED_TOKENS)
    return out


def merge_lora(
    inputs: Sequence[tuple[Mapping[str, Any], Mapping[str, torch.Tensor]]],
    spec: MergeSpec,
    *,
    max_rank: int,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The merged adapter ``(config, tensors)`` of ``inputs`` (each ``(config, tensors)`` of a
    PEFT LoRA adapter for one base model) by ``spec``; :class:`FormatError` (reason
    ``invalid_merge`` or the config's own) for inputs it cannot merge or a result whose rank
    exceeds ``max_rank``, checked before any arithmetic."""
    if len(inputs) != len(spec.weights):
        raise merge_error(f"{len(inputs)} adapters but {len(spec.weights)} weights")
    per = [_factors_of(config, tensors) for config, tensors in inputs]
    rank = spec.merged_rank([_config_rank(config) for config, _ in inputs])
    if rank > max_rank:
        raise merge_error(
            f"the merged adapter's rank {rank} exceeds the largest allowed, {max_rank}"
        )
    modules = sorted({m for p in per for m in p})
    for module in modules:
        shapes = {(f.b.shape[0], f.a.shape[1]) for p in per if (f := p.get(module)) is not None}
        if len(shapes) > 1:
            raise merge_error(
                f"module {module}: the adapters disagree on its shape {sorted(shapes)}"
            )
    tensors: dict[str, torch.Tensor] = {}
    for module in modules:
        present = [(w, p[module]) for w, p in zip(spec.weights, per, strict=True) if module in p]
        gen = None
        if spec.effective_type() in RANDOM_TYPES:
            gen = torch.Generator().manual_seed(module_seed(spec.seed or 0, module))
        a, b = _merge_module(module, present, spec, rank, gen)
        a, b = _pad(a, b, rank)
        emb = present[0][1].embedding
        a_name, b_name = (
            ("lora_embedding_A", "lora_embedding_B") if emb else ("lora_A.weight", "lora_B.weight")
        )
        tensors[f"base_model.model.{module}.{a_name}"] = a.contiguous()
        tensors[f"base_model.model.{module}.{b_name}"] = b.contiguous()
    config = dict(inputs[0][0])
    config.update(
        r=rank,
        lora_alpha=rank,
        use_rslora=False,
        target_modules=modules,
        rank_pattern={},
        alpha_pattern={},
        layers_to_transform=None,
        layers_pattern=None,
        exclude_modules=None,
        target_parameters=None,
        inference_mode=True,
    )
    return config, tensors


def _merge_module(
    module: str,
    present: list[tuple[float, _Factors]],
    spec: MergeSpec,
    rank: int,
    gen: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, B)`` of one module from the adapters that adapt it (``(weight, factors)``)."""
    t = spec.effective_type()
    if t == "cat":  # exact: B_cat A_cat = sum_i w_i s_i B_i A_i
        a = torch.cat([f.a * w * f.scale for w, f in present], dim=0)  # [sum r_i, d_in]
        b = torch.cat([f.b for _, f in present], dim=1)  # [d_out, sum r_i]
        return a, b
    if t in SAME_RANK_TYPES:
        if len({f.a.shape for _, f in present}) > 1:
            raise merge_error(
                f"module {module}: combination_type {t!r} needs one rank per module, got "
                f"{sorted(f.a.shape[0] for _, f in present)}; use 'cat' or an SVD type"
            )
        ws = [w * f.scale for w, f in present]
        # the sign on A only, so that the product keeps it
        w_a = torch.tensor([math.sqrt(abs(x)) * (1 if x >= 0 else -1) for x in ws])
        w_b = torch.tensor([math.sqrt(abs(x)) for x in ws])
        a = _combine(t, [f.a for _, f in present], w_a, spec, gen)
        b = _combine(t, [f.b for _, f in present], w_b, spec, gen)
        return a, b
    # the SVD types: combine the full deltas (PEFT's orientation: an embedding's is [vocab, dim])
    deltas = [
        ((f.b @ f.a).T if f.embedding else f.b @ f.a) * f.scale  # [d_out, d_in]
        for _, f in present
    ]
    base = t.removesuffix("_svd") if t != "svd" else "linear"
    delta = _combine(base, deltas, torch.tensor([w for w, _ in present]), spec, gen)
    if present[0][1].embedding:
        delta = delta.T  # [dim, vocab], as B @ A
    u, s, vh = torch.linalg.svd(delta, full_matrices=spec.full_matrices)
    u = u[:, :rank] @ torch.diag(s[:rank])  # [d_out, k]
    vh = vh[:rank, :]  # [k, d_in]
    if spec.svd_clamp is not None:
        hi = _quantile(torch.cat([u.flatten(), vh.flatten()]), spec.svd_clamp)
        u, vh = u.clamp(-hi, hi), vh.clamp(-hi, hi)
    return vh, u


def _combine(
    kind: str,
    ts: list[torch.Tensor],
    weights: torch.Tensor,
    spec: MergeSpec,
    gen: torch.Generator | None,
) -> torch.Tensor:
    """PEFT's merge of task tensors ``ts`` (one per adapter, one shape) with ``weights``::

    linear:           sum_i w_i t_i
    magnitude_prune:  sum_i w_i top_density(t_i)
    dare_linear:      sum_i w_i bernoulli_density(t_i) / density
    ties / dare_ties: pruned as above, then per element the mean of w_i t_i over the adapters
                      whose sign agrees with the elected one (sign of sum_i t_i, or of the count)
    """
    density = spec.density if spec.density is not None else 1.0
    if kind in ("ties", "magnitude_prune"):
        ts = [_prune_magnitude(t, density) for t in ts]
    elif kind in ("dare_linear", "dare_ties"):
        ts = [_prune_random(t, density, gen) for t in ts]
    stacked = torch.stack(ts, dim=0)  # [n, *shape]
    w = weights.view(weights.shape + (1,) * (stacked.dim() - 1))
    if kind not in ("ties", "dare_ties"):
        return (stacked * w).sum(dim=0)
    sign = stacked.sign()
    votes = stacked.sum(dim=0) if spec.sign_method == "total" else sign.sum(dim=0)
    keep = sign == torch.where(votes >= 0, 1, -1)  # [n, *shape]: agrees with the elected sign
    return (stacked * w * keep).sum(dim=0) / torch.clamp(keep.sum(dim=0), min=1.0)


def _prune_magnitude(t: torch.Tensor, density: float) -> torch.Tensor:
    """``t`` with all but its ``int(density * numel)`` largest-magnitude elements zeroed."""
    if density >= 1:
        return t
    mask = torch.zeros_like(t).reshape(-1)
    mask[torch.topk(t.abs().reshape(-1), k=int(density * t.numel()), largest=True)[1]] = 1
    return t * mask.reshape(t.shape)


def _prune_random(t: torch.Tensor, density: float, gen: torch.Generator | None) -> torch.Tensor:
    """DARE: each element kept with probability ``density`` and rescaled by ``1 / density``."""
    if density >= 1:
        return t
    mask = torch.bernoulli(torch.full_like(t, density), generator=gen)
    return t * mask / density


def _quantile(x: torch.Tensor, q: float) -> torch.Tensor:
    """``torch.quantile(x, q)`` (linear interpolation), also for inputs above its size limit."""
    if x.numel() <= _QUANTILE_MAX:
        return torch.quantile(x, q)
    xs = x.sort().values
    pos = q * (x.numel() - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, x.numel() - 1)
    return torch.lerp(xs[lo], xs[hi], pos - lo)


def _pad(a: torch.Tensor, b: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, B)`` padded to ``rank`` with zero rows of A and columns of B (same product)."""
    k = a.shape[0]
    if k == rank:
        return a, b
    a = torch.cat([a, a.new_zeros(rank - k, a.shape[1])], dim=0)  # [rank, d_in]
    b = torch.cat([b, b.new_zeros(b.shape[0], rank - k)], dim=1)  # [d_out, rank]
    return a, b


def write_peft_adapter(
    out_dir: str | Path, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
) -> Path:
    """Save ``(config, tensors)`` as a PEFT adapter directory (created; must not exist)."""
    out = Path(out_dir)
    out.mkdir(parents=False, exist_ok=False)
    save_file(dict(tensors), str(out / SAFETENSORS_NAME), metadata={"format": "pt"})
    with open(out / CONFIG_NAME, "w") as f:
        json.dump(dict(config), f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    return out


def merge_adapter_dirs(
    sources: Sequence[tuple[str | Path, str]],
    spec: MergeSpec,
    out_dir: str | Path,
    *,
    max_rank: int,
) -> None:
    """Merge the adapters in the directories of ``sources`` (``(path, sha256)``: each read once
    into owned memory and used only if its digest is the expected one) into a new PEFT
    adapter directory ``out_dir``. The registry's merge operation calls this."""
    inputs = []
    for path, sha256 in sources:
        read = read_adapter(path)
        if read.digest != sha256:
            raise AdapterError(
                f"adapter {path}: its files no longer match the registered digest "
                f"({read.digest[:12]} != {sha256[:12]}); re-register it"
            )
        inputs.append((read.config, read.tensors))
    config, tensors = merge_lora(inputs, spec, max_rank=max_rank)
    write_peft_adapter(out_dir, config, tensors)
