"""The planner's byte model: bytes per adapter, device slots against KV-cache tokens, host and
disk budgets, and what a decode step reads (the base once, each distinct adapter's LoRA)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from loraplex.checkpoint.modules import (
    EXPERT_PROJ_NAMES,
    LAYER_MODULE_ORDER,
    ROUTER,
    VOCAB_MODULES,
)
from loraplex.tools.plan.adapter_shape import AdapterShape
from loraplex.tools.plan.model_shape import ALL_FUSED, ModelShape, PlanError

KV_CONTEXTS = (8192, 32768)
"""Context lengths the plan gives one sequence's KV bytes at."""

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1}
QUANT_BITS = {"int8": 8, "int4": 4, "fp8": 8}
"""``--quantization``: bits per projection weight (GPTQ / AWQ / compressed-tensors W4A16
checkpoints are ``int4`` here, W8A8 and W8A16 ``int8``)."""


def projection_bytes_per_param(quantization: str | None, group_size: int | None, dtype_bytes: int) -> float:  # fmt: skip
    """Resident bytes per projection weight: the dtype's, or a quantized base's as loraplex
    stores it (model/quant/weights.py): the values' bits, a float32 scale per group (int4:
    ``group_size``, default 128) and an int8 zero point per int4 group; int8 and float8 have one
    scale per output row (per channel), under a byte per million weights here."""
    if quantization is None:
        return float(dtype_bytes)
    bits = QUANT_BITS[quantization]
    if bits == 8:
        return 1.0
    gs = group_size or 128
    return bits / 8 + (4 + 1) / gs


DEFAULT_DECODE_BATCH = 64  # the engine's default --max-num-seqs


def _slot_params(m: ModelShape, modules: Sequence[str], rank: int) -> int:
    """Parameters of a slot of ``rank`` rows for ``modules`` (engine names) in every layer
    that has them (an expert module's ``E x rank`` rows) and ``embed_tokens`` / ``lm_head``."""
    wanted = set(modules)
    out = sum(rank * sum(m.dims(p)) for p in m.outer_modules if p in wanted)
    for layer in range(m.num_layers):
        out += sum(
            rank * sum(m.dims(p, layer)) * m.experts_of(p)
            for p in m.layer_projs(layer)
            if p in wanted
        )
    return out


def build_plan(
    m: ModelShape,
    adapters: Sequence[AdapterShape],
    *,
    dtype: str | None = None,
    max_lora_rank: int | None = None,
    device_budget: int | None = None,
    slots: int | None = None,
    num_adapters: int | None = None,
    host_budget: int | None = None,
    disk_budget: int | None = None,
    decode_k: Sequence[int] = (1, 2, 4, 8, 16, 32),
    decode_batch: int = DEFAULT_DECODE_BATCH,
    quantization: str | None = None,
    quantization_group_size: int | None = None,
) -> dict[str, Any]:
    """Every number of the report as a JSON-able dict (bytes as integers). ``quantization``:
    the base's projections quantized (``QUANT_BITS``); embedding, norms and LM head stay in
    ``dtype``, adapters and KV too."""
    if quantization is not None and quantization not in QUANT_BITS:
        raise PlanError(f"unknown quantization {quantization!r}; valid: {', '.join(QUANT_BITS)}")
    if not adapters:
        raise PlanError("no adapters: give --adapter or --rank/--targets")
    dt = dtype or (m.dtype if m.dtype in DTYPE_BYTES else "bfloat16")
    if dt not in DTYPE_BYTES:
        raise PlanError(f"unknown dtype {dt!r}; valid: {', '.join(DTYPE_BYTES)}")
    if decode_batch < 1:
        raise PlanError(f"--decode-batch must be >= 1, got {decode_batch}")
    b = DTYPE_BYTES[dt]
    qb = projection_bytes_per_param(quantization, quantization_group_size, b)

    def base_bytes(params: int, linear: int) -> int:
        """Bytes of ``params`` base weights of which ``linear`` are projections."""
        return int((params - linear) * b + linear * qb)

    def read_bytes(tokens: int) -> int:
        linear = m.linear_params() - m._idle_expert_params(tokens)
        return base_bytes(m.decode_read_params(tokens), linear)

    rows = []
    for a in adapters:
        params = a.params(m)
        parts = {p: n * b for p, n in a.part_params(m).items()}
        rows.append({
            "name": a.name, "rank": a.max_rank, "targets": a.targets, "layers": a.layers,
            "params": params, "bytes": params * b, "decode_bytes": a.decode_params(m) * b,
            "parts": parts, "experts_share": parts.get("experts", 0) / (params * b),
            "expert_layout": a.expert_layout, "adapted_experts": a.adapted_experts,
            "file_params": a.file_params, "file_bytes": a.file_bytes, "notes": a.notes,
        })  # fmt: skip
    max_rank = max_lora_rank or max(a.max_rank for a in adapters)
    if max_rank < max(a.max_rank for a in adapters):
        raise PlanError(f"--max-lora-rank {max_rank} is below an adapter's rank")
    # a slot holds the parts of a fused module (the engine splits its LoRA), every expert of an
    # expert module
    held = {q for a in adapters for p in a.targets for q in ALL_FUSED.get(p, (p,))}
    order = (*VOCAB_MODULES, *LAYER_MODULE_ORDER)
    union = [p for p in order if p in held]
    slot_params = _slot_params(m, union, max_rank)
    slot_bytes = slot_params * b
    # loraplex serve's bank: rows for every module, whatever the adapters target
    vocab_slot_bytes = _slot_params(m, VOCAB_MODULES, max_rank) * b
    engine_slot_bytes = _slot_params(m, order, max_rank) * b
    engine_expert_slot_bytes = _slot_params(m, EXPERT_PROJ_NAMES, max_rank) * b
    kv_tok = m.kv_bytes_per_token(b)
    mean_bytes = sum(r["bytes"] for r in rows) / len(rows)
    device: dict[str, Any] = {
        "max_lora_rank": max_rank,
        "slot_targets": union,
        "slot_params": slot_params,
        "slot_bytes": slot_bytes,
        "engine_slot_bytes": engine_slot_bytes,
        "engine_vocab_slot_bytes": vocab_slot_bytes,
        "engine_expert_slot_bytes": engine_expert_slot_bytes,
        "engine_router_slot_bytes": _slot_params(m, (ROUTER,), max_rank) * b,
        "kv_bytes_per_token": kv_tok,
        "kv_bytes_per_sequence": {n: m.kv_bytes_per_sequence(n, b) for n in KV_CONTEXTS},
        "kv_tokens_per_slot": slot_bytes / kv_tok,
    }
    if device_budget is not None:
        n = device_budget // slot_bytes
        device.update(budget=device_budget, slots_in_budget=n,
                      kv_tokens_forgone=n * slot_bytes / kv_tok)  # fmt: skip
    if slots is not None:
        device.update(slots=slots, slots_bytes=slots * slot_bytes,
                      slots_kv_tokens_forgone=slots * slot_bytes / kv_tok)  # fmt: skip
    storage: dict[str, Any] = {"mean_adapter_bytes": mean_bytes}
    if num_adapters is not None:
        storage.update(num_adapters=num_adapters, host_bytes_needed=num_adapters * mean_bytes)
        files = [r["file_bytes"] or r["bytes"] for r in rows]
        storage["disk_bytes_needed"] = num_adapters * sum(files) / len(files)
    if host_budget is not None:
        storage.update(host_budget=host_budget, adapters_in_host=int(host_budget // mean_bytes))
    if disk_budget is not None:
        storage.update(disk_budget=disk_budget, adapters_on_disk=int(disk_budget // mean_bytes))

    def mean_decode(tokens: int) -> float:
        return sum(a.decode_params(m, tokens) for a in adapters) * b / len(adapters)

    drows = []
    for k in decode_k:
        # one token per adapter: k tokens; a full batch: decode_batch tokens (at least k) shared
        # evenly by the k adapters
        base_k, extra_k = read_bytes(k), k * mean_decode(1)
        full = max(decode_batch, k)
        base_full = read_bytes(full)
        extra_full = k * mean_decode(-(-full // k))
        drows.append({
            "k": k, "base_bytes": base_k, "extra_bytes": extra_k, "share_of_base": extra_k / base_k,
            "base_bytes_full_batch": base_full, "extra_bytes_full_batch": extra_full,
            "share_of_base_full_batch": extra_full / base_full,
        })  # fmt: skip
    decode: dict[str, Any] = {
        "base_bytes_per_step": read_bytes(1),
        "decode_batch": decode_batch,
        "base_bytes_full_batch": read_bytes(decode_batch),
        "rows": drows,
    }
    model: dict[str, Any] = {
        **asdict(m),
        "head_dim": m.hd,
        "params": m.params(),
        "weight_bytes": base_bytes(m.params(), m.linear_params()),
        "dtype": dt,
        "quantization": quantization,
        "projection_bytes_per_param": qb,
    }
    if m.is_moe:
        model.update(
            sparse_layers=list(m.sparse),
            active_params=m.active_params(),
            active_weight_bytes=base_bytes(
                m.active_params(), m.linear_params() - m._idle_expert_params(1)
            ),
            expert_weight_bytes=int(len(m.sparse) * m.num_experts * m.expert_params() * qb),
        )
        decode["experts_read_per_layer"] = {
            "one_token": m.experts_read(1), "full_batch": m.experts_read(decode_batch),
        }  # fmt: skip
    return {"model": model, "adapters": rows, "device": device, "storage": storage,
            "decode": decode}  # fmt: skip
