"""``loraplex plan``: capacity planning for LoRA serving, from shapes alone (no torch, no weights).

    loraplex plan --model llama-3-8b --rank 16 --targets q_proj,v_proj --device-budget 2GiB \\
        --num-adapters 1000 --host-budget 64GiB
    loraplex plan --model /models/llama3/config.json --adapter /adapters/sql --adapter /adapters/fr

For a Llama-family base (a model directory, its ``config.json``, or a preset) and adapters
(PEFT directories / ``adapter_config.json`` files / JSON manifests with ``r`` or ``rank`` and
``target_modules``, or ``--rank``/``--targets``), it computes:

- bytes per adapter: for every adapted projection of every adapted layer, r x (d_in + d_out)
  parameters (A is [r, d_in], B is [d_out, r]) times the dtype's bytes; ``embed_tokens`` and
  ``lm_head`` once each, r x (vocab + hidden);
- device slots: a slot holds any adapter up to ``max_lora_rank`` for the union of targets, so a
  slot is ``max_lora_rank`` x (d_in + d_out) per module; how many slots a device budget buys
  and how many KV-cache tokens that memory would have held instead
  (KV bytes/token = 2 x layers x kv_heads x head_dim x dtype bytes); beside it what
  ``loraplex serve`` allocates per slot (every projection, and ``embed_tokens`` and ``lm_head``
  whatever the adapters target: ``max_lora_rank`` x 2 x (vocab + hidden) of it);
- host and disk: bytes for N adapters, or how many fit a budget;
- the decode byte model: a decode step reads the base weights once (every linear layer and the
  LM head; the embedding is a gather) plus the A and B of each distinct adapter in the batch
  (of an embedding LoRA only B: its A is gathered by token id like the embedding), so k distinct
  adapters add k x an adapter's decode bytes, shown as a share of the base weight traffic.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loraplex.cliargs import byte_size, positive_int, positive_ints
from loraplex.lora.digest import DigestError, safetensors_header
from loraplex.lora.peft_format import (
    CONFIG_NAME,
    EMBED_TOKENS,
    FUSED_BY_MODEL_TYPE,
    FUSED_PROJ_NAMES,
    OTHER_TOWER_RE,
    PROJ_NAMES,
    SAFETENSORS_NAME,
    VOCAB_LAYER,
    VOCAB_MODULES,
    LoraSettings,
    module_key,
    projection_shapes,
    vocab_module_key,
    vocab_module_shapes,
)

__all__ = [
    "PRESETS",
    "AdapterShape",
    "ModelShape",
    "PlanError",
    "adapter_from_path",
    "build_plan",
    "main",
    "render_plan",
]

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1}


class PlanError(ValueError):
    """Bad planner input; the message names the problem."""


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a Llama-family config."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    layer_norm_params: int = 0  # 0: Llama's two norms of hidden_size per layer
    layer_bias_params: int = 0
    text_only: bool = False  # a multimodal checkpoint's language model (other towers unserved)
    fused: tuple[str, ...] = ()  # the checkpoint's fused modules (Phi-3's qkv_proj, gate_up_proj)

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def adapter_projs(self) -> tuple[str, ...]:
        """The modules of a layer an adapter for this base names: the seven projections, with
        each fused module in place of its parts."""
        out: list[str] = []
        for p in PROJ_NAMES:
            f = next((f for f in self.fused if p in FUSED_PROJ_NAMES[f]), p)
            if f not in out:
                out.append(f)
        return tuple(out)

    def dims(self, proj: str) -> tuple[int, int]:
        """(d_in, d_out) of a projection, of a fused module (its parts' rows), or of
        ``embed_tokens`` / ``lm_head``."""
        if proj in VOCAB_MODULES:
            return vocab_module_shapes(self.vocab_size, self.hidden_size)[proj]
        if proj in FUSED_PROJ_NAMES:
            parts = [self.dims(q) for q in FUSED_PROJ_NAMES[proj]]
            return parts[0][0], sum(d_out for _, d_out in parts)
        shapes = projection_shapes(
            self.hidden_size, self.num_heads, self.num_kv_heads, self.hd, self.intermediate_size
        )
        return shapes[proj]

    def linear_params(self) -> int:
        """Parameters of every projection of every layer (no norms, embeddings or head)."""
        return self.num_layers * sum(a * b for a, b in map(self.dims, PROJ_NAMES))

    def _layer_extras(self) -> int:
        """A layer's norm and bias parameters, and the final norm."""
        norms = self.layer_norm_params or 2 * self.hidden_size
        return self.num_layers * (norms + self.layer_bias_params) + self.hidden_size

    def params(self) -> int:
        """All parameters: projections, biases, norms, embedding, LM head (unless tied)."""
        emb = self.vocab_size * self.hidden_size
        return (
            self.linear_params()
            + self._layer_extras()
            + emb * (1 if self.tie_word_embeddings else 2)
        )

    def decode_read_params(self) -> int:
        """Parameters a decode step reads in full: projections, biases, norms and the LM head
        (the embedding is a gather of a few rows; a tied head reads the embedding matrix)."""
        return self.linear_params() + self._layer_extras() + self.vocab_size * self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.hd * dtype_bytes


PRESETS: dict[str, ModelShape] = {
    p.name: p
    for p in (
        ModelShape("llama-3-8b", 4096, 32, 32, 8, 14336, 128256),
        ModelShape("llama-3.1-8b", 4096, 32, 32, 8, 14336, 128256),
        ModelShape("llama-3-70b", 8192, 80, 64, 8, 28672, 128256),
        ModelShape("llama-2-7b", 4096, 32, 32, 32, 11008, 32000),
        ModelShape("llama-2-13b", 5120, 40, 40, 40, 13824, 32000),
        ModelShape("mistral-7b", 4096, 32, 32, 8, 14336, 32000),
        ModelShape("qwen2-7b", 3584, 28, 28, 4, 18944, 152064),
        ModelShape("smollm2-135m", 576, 30, 9, 3, 1536, 49152, 64, True),
    )
}


def model_from_config(cfg: dict[str, Any], name: str) -> ModelShape:
    """The shape of a ``config.json``: through the architecture's own parse where it names one
    we serve (its norms, biases, a multimodal checkpoint's ``text_config``), else read as a
    Llama-family config."""
    from loraplex.model.config import parse_model_config
    from loraplex.model.registry import ARCHITECTURES

    if any(a in ARCHITECTURES for a in cfg.get("architectures") or []):
        from loraplex.types import ModelLoadError

        try:
            mc = parse_model_config(cfg, source=name)
        except ModelLoadError as e:
            raise PlanError(str(e)) from None
        return ModelShape(
            name=name,
            hidden_size=mc.hidden_size,
            num_layers=mc.num_layers,
            num_heads=mc.num_heads,
            num_kv_heads=mc.num_kv_heads,
            intermediate_size=mc.intermediate_size,
            vocab_size=mc.vocab_size,
            head_dim=mc.head_dim,
            tie_word_embeddings=mc.tie_word_embeddings,
            dtype=str(mc.torch_dtype or "bfloat16"),
            layer_norm_params=sum(mc.layer_norm_widths),
            layer_bias_params=mc.layer_bias_params(),
            text_only=isinstance(cfg.get("text_config"), dict),
            fused=FUSED_BY_MODEL_TYPE.get(mc.model_type, ()),
        )
    try:
        heads = int(cfg["num_attention_heads"])
        shape = ModelShape(
            name=name,
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            head_dim=int(cfg.get("head_dim") or 0),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        )
    except KeyError as e:
        raise PlanError(
            f"{name}: config has no {e.args[0]!r} (is it a Llama-family config?)"
        ) from None
    except (TypeError, ValueError) as e:
        raise PlanError(f"{name}: bad value in config ({e})") from None
    if min(shape.hidden_size, shape.num_layers, heads, shape.num_kv_heads,
           shape.intermediate_size, shape.vocab_size) < 1:  # fmt: skip
        raise PlanError(f"{name}: config sizes must be >= 1")
    return shape


def load_model(spec: str) -> ModelShape:
    """A preset name, a model directory, or a ``config.json`` path."""
    if spec.lower() in PRESETS:
        return PRESETS[spec.lower()]
    p = Path(spec)
    cfg_path = p / "config.json" if p.is_dir() else p
    if not cfg_path.is_file():
        raise PlanError(
            f"--model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a model directory "
            "or config.json"
        )
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"cannot read {cfg_path}: {e}") from None
    if not isinstance(cfg, dict):
        raise PlanError(f"{cfg_path} is not a JSON object")
    return model_from_config(cfg, p.name if p.is_dir() else p.parent.name or str(p))


# -- adapters --------------------------------------------------------------------------------------
@dataclass
class AdapterShape:
    """An adapter's rank per (layer, projection) it adapts; ``file_*`` from its safetensors."""

    name: str
    modules: dict[tuple[int, str], int]  # (layer, proj) -> rank
    file_params: int | None = None
    file_bytes: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def max_rank(self) -> int:
        return max(self.modules.values(), default=0)

    @property
    def targets(self) -> list[str]:
        names = (*VOCAB_MODULES, *PROJ_NAMES, *FUSED_PROJ_NAMES)
        return [p for p in names if any(q == p for _, q in self.modules)]

    @property
    def layers(self) -> int:
        return len({layer for layer, _ in self.modules if layer != VOCAB_LAYER})

    def params(self, m: ModelShape) -> int:
        return sum(r * sum(m.dims(p)) for (_, p), r in self.modules.items())

    def decode_params(self, m: ModelShape) -> int:
        """Parameters a decode step reads in full: all but an embedding LoRA's A, which is
        gathered by token id (a few rows); a fused module's LoRA as the engine holds it, split
        into its parts (A once per part, B by rows)."""
        r_embed = self.modules.get((VOCAB_LAYER, EMBED_TOKENS), 0)
        split = sum(
            r * sum(sum(m.dims(q)) for q in FUSED_PROJ_NAMES.get(p, (p,)))
            for (_, p), r in self.modules.items()
        )
        return split - r_embed * m.vocab_size


def adapter_from_config(cfg: dict[str, Any], m: ModelShape, name: str) -> AdapterShape:
    """(layer, projection) -> rank for a PEFT LoraConfig (``r``/``rank``, ``target_modules``,
    ``exclude_modules``, ``layers_to_transform``/``layers_pattern``, ``rank_pattern``) applied
    to the model's layers with the loader's own module selection (``LoraSettings``)."""
    r = cfg.get("r", cfg.get("rank"))
    targets = cfg.get("target_modules")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise PlanError(f"adapter {name}: rank (r) must be an integer >= 1, got {r!r}")
    if not (isinstance(targets, str) or (isinstance(targets, list) and targets)):
        raise PlanError(f"adapter {name}: target_modules must be a string or a non-empty list")
    layers = cfg.get("layers_to_transform")
    wanted = [layers] if isinstance(layers, int) else (layers or [])
    if not set(wanted) <= set(range(m.num_layers)):
        raise PlanError(
            f"adapter {name}: layers_to_transform {sorted(wanted)} beyond the model's "
            f"{m.num_layers} layers"
        )
    settings = LoraSettings.of({**cfg, "r": r})
    mods = {}
    try:
        for v in VOCAB_MODULES:
            full = vocab_module_key(v)
            if settings.is_targeted(full):
                mods[(VOCAB_LAYER, v)] = int(settings.rank_of(full))
        for layer in range(m.num_layers):
            for p in m.adapter_projs:
                full = module_key(layer, p)
                if settings.is_targeted(full):
                    mods[(layer, p)] = int(settings.rank_of(full))
    except (re.error, TypeError, ValueError) as e:
        raise PlanError(
            f"adapter {name}: bad target_modules / exclude_modules / rank_pattern ({e})"
        ) from None
    if not mods:
        raise PlanError(
            f"adapter {name}: target_modules {targets!r} match none of the model's modules "
            f"({', '.join((*m.adapter_projs, *VOCAB_MODULES))}): this adapter would change nothing"
        )
    return AdapterShape(name, mods)


def _safetensors_stats(path: Path, text_only: bool = False) -> tuple[int, int]:
    """(LoRA parameters, their bytes) from a safetensors header (no tensor data read); on a
    multimodal base's language model, of the text backbone only (what is served)."""
    try:
        header = safetensors_header(path)
    except (OSError, DigestError) as e:
        raise PlanError(f"cannot read the safetensors header of {path}: {e}") from None
    lora = [
        t
        for key, t in header.items()
        if "lora_" in key and not (text_only and OTHER_TOWER_RE.match(key))
    ]
    return sum(math.prod(t.shape) for t in lora), sum(t.nbytes for t in lora)


def adapter_from_path(spec: str, m: ModelShape) -> AdapterShape:
    """A PEFT directory, its adapter_config.json, or a JSON manifest (``r``/``rank`` and
    ``target_modules``, or an ``adapter_config`` / ``config`` object holding them)."""
    p = Path(spec)
    cfg_path = p / CONFIG_NAME if p.is_dir() else p
    if not cfg_path.is_file():
        raise PlanError(f"--adapter {spec!r}: no such PEFT directory or JSON file")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"cannot read {cfg_path}: {e}") from None
    if not isinstance(cfg, dict):
        raise PlanError(f"{cfg_path} is not a JSON object")
    for key in ("adapter_config", "config"):
        if "r" not in cfg and "rank" not in cfg and isinstance(cfg.get(key), dict):
            cfg = cfg[key]
    name = p.name if p.is_dir() else cfg_path.stem
    a = adapter_from_config(cfg, m, name)
    weights = cfg_path.parent / SAFETENSORS_NAME
    if weights.is_file():
        a.file_params, a.file_bytes = _safetensors_stats(weights, m.text_only)
        if a.file_params != a.params(m):
            a.notes.append(
                f"its weights hold {a.file_params:,} LoRA parameters but its config on this "
                f"model gives {a.params(m):,}: made for another base model?"
            )
    return a


# -- the plan --------------------------------------------------------------------------------------
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
) -> dict[str, Any]:
    """Every number of the report as a JSON-able dict (bytes as integers)."""
    if not adapters:
        raise PlanError("no adapters: give --adapter or --rank/--targets")
    dt = dtype or (m.dtype if m.dtype in DTYPE_BYTES else "bfloat16")
    if dt not in DTYPE_BYTES:
        raise PlanError(f"unknown dtype {dt!r}; valid: {', '.join(DTYPE_BYTES)}")
    b = DTYPE_BYTES[dt]
    rows = []
    for a in adapters:
        params = a.params(m)
        rows.append({
            "name": a.name, "rank": a.max_rank, "targets": a.targets, "layers": a.layers,
            "params": params, "bytes": params * b, "decode_bytes": a.decode_params(m) * b,
            "file_params": a.file_params, "file_bytes": a.file_bytes, "notes": a.notes,
        })  # fmt: skip
    max_rank = max_lora_rank or max(a.max_rank for a in adapters)
    if max_rank < max(a.max_rank for a in adapters):
        raise PlanError(f"--max-lora-rank {max_rank} is below an adapter's rank")
    # a slot holds the parts of a fused module (the engine splits its LoRA)
    parts = {q for a in adapters for p in a.targets for q in FUSED_PROJ_NAMES.get(p, (p,))}
    union = [p for p in (*VOCAB_MODULES, *PROJ_NAMES) if p in parts]
    per_layer = sum(max_rank * sum(m.dims(p)) for p in union if p in PROJ_NAMES)
    outside = sum(max_rank * sum(m.dims(p)) for p in union if p in VOCAB_MODULES)
    slot_params = m.num_layers * per_layer + outside
    slot_bytes = slot_params * b
    # loraplex serve's bank: rows for every module, whatever the adapters target
    vocab_slot_bytes = sum(max_rank * sum(m.dims(p)) for p in VOCAB_MODULES) * b
    engine_slot_bytes = m.num_layers * max_rank * sum(map(sum, map(m.dims, PROJ_NAMES))) * b
    engine_slot_bytes += vocab_slot_bytes
    kv_tok = m.kv_bytes_per_token(b)
    mean_bytes = sum(r["bytes"] for r in rows) / len(rows)
    mean_decode = sum(r["decode_bytes"] for r in rows) / len(rows)
    device: dict[str, Any] = {
        "max_lora_rank": max_rank,
        "slot_targets": union,
        "slot_params": slot_params,
        "slot_bytes": slot_bytes,
        "engine_slot_bytes": engine_slot_bytes,
        "engine_vocab_slot_bytes": vocab_slot_bytes,
        "kv_bytes_per_token": kv_tok,
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
    base_read = m.decode_read_params() * b
    decode = {
        "base_bytes_per_step": base_read,
        "rows": [
            {"k": k, "extra_bytes": k * mean_decode, "share_of_base": k * mean_decode / base_read}
            for k in decode_k
        ],
    }
    return {
        "model": {
            **asdict(m),
            "head_dim": m.hd,
            "params": m.params(),
            "weight_bytes": m.params() * b,
            "dtype": dt,
        },
        "adapters": rows,
        "device": device,
        "storage": storage,
        "decode": decode,
    }


def _h(n: float) -> str:
    """Bytes for people: 13.0 MiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def render_plan(plan: dict[str, Any]) -> str:
    m, d, s, dec = plan["model"], plan["device"], plan["storage"], plan["decode"]
    out = [
        f"model {m['name']}: {m['num_layers']} layers, hidden {m['hidden_size']}, heads "
        f"{m['num_heads']}/{m['num_kv_heads']} kv x {m['head_dim']}, intermediate "
        f"{m['intermediate_size']}, vocab {m['vocab_size']}; {m['params']:,} parameters = "
        f"{_h(m['weight_bytes'])} in {m['dtype']}",
        "",
        f"{'adapter':<24}{'rank':>5}{'layers':>7}{'parameters':>14}{'bytes':>12}  targets",
    ]
    for r in plan["adapters"]:
        out.append(
            f"{r['name'][:24]:<24}{r['rank']:>5}{r['layers']:>7}{r['params']:>14,}"
            f"{_h(r['bytes']):>12}  {','.join(r['targets'])}"
        )
        if r["file_bytes"] is not None:
            out.append(f"{'':<24}  file: {r['file_params']:,} parameters, {_h(r['file_bytes'])}")
        out += [f"{'':<24}  note: {n}" for n in r["notes"]]
    out += [
        "",
        f"device slot (rank {d['max_lora_rank']}, {','.join(d['slot_targets'])}): "
        f"{_h(d['slot_bytes'])} = {d['kv_tokens_per_slot']:.1f} KV-cache tokens "
        f"({_h(d['kv_bytes_per_token'])}/token)",
        f"loraplex serve allocates {_h(d['engine_slot_bytes'])} per slot (every projection, "
        f"and {_h(d['engine_vocab_slot_bytes'])} for embed_tokens + lm_head)",
    ]
    if "budget" in d:
        out.append(
            f"device budget {_h(d['budget'])}: {d['slots_in_budget']} slots, forgoing "
            f"{d['kv_tokens_forgone']:,.0f} KV tokens"
        )
    if "slots" in d:
        out.append(
            f"{d['slots']} slots: {_h(d['slots_bytes'])}, forgoing "
            f"{d['slots_kv_tokens_forgone']:,.0f} KV tokens"
        )
    if "num_adapters" in s:
        out.append(
            f"{s['num_adapters']:,} adapters: host {_h(s['host_bytes_needed'])}, disk "
            f"{_h(s['disk_bytes_needed'])}"
        )
    if "host_budget" in s:
        out.append(f"host budget {_h(s['host_budget'])}: {s['adapters_in_host']:,} adapters")
    if "disk_budget" in s:
        out.append(f"disk budget {_h(s['disk_budget'])}: {s['adapters_on_disk']:,} adapters")
    out += [
        "",
        f"decode step: base weights read {_h(dec['base_bytes_per_step'])}; k distinct adapters "
        "in the batch add:",
        f"{'k':>6}{'extra bytes':>14}{'of base':>10}",
    ]
    for r in dec["rows"]:
        out.append(f"{r['k']:>6}{_h(r['extra_bytes']):>14}{100 * r['share_of_base']:>9.2f}%")
    return "\n".join(out)


# -- CLI -------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loraplex plan",
        description="Capacity planner: adapter bytes, device slots vs KV-cache tokens, host/disk "
        "budgets, decode byte model.",
        allow_abbrev=False,
    )
    p.add_argument(
        "--model", required=True, help=f"model dir, config.json, or {', '.join(PRESETS)}"
    )
    p.add_argument("--adapter", action="append", default=[], metavar="PATH",
                   help="PEFT dir / adapter_config.json / JSON manifest (repeatable)")  # fmt: skip
    p.add_argument(
        "--rank", type=positive_int, help="a synthetic adapter of this rank (with --targets)"
    )
    p.add_argument("--targets", default="q_proj,v_proj",
                   help="with --rank: projections, comma-separated, or all-linear")  # fmt: skip
    p.add_argument("--dtype", choices=list(DTYPE_BYTES), help="default: the model's")
    p.add_argument("--max-lora-rank", type=positive_int, help="slot rank (default: the largest)")
    p.add_argument(
        "--device-budget", type=byte_size, metavar="BYTES", help="e.g. 2GiB for adapters"
    )
    p.add_argument(
        "--slots", type=positive_int, help="device slots (max_loras) to price in KV tokens"
    )
    p.add_argument("--num-adapters", type=positive_int, help="adapters to keep on host and disk")
    p.add_argument("--host-budget", type=byte_size, metavar="BYTES")
    p.add_argument("--disk-budget", type=byte_size, metavar="BYTES")
    p.add_argument(
        "--decode-k", type=positive_ints, default=[1, 2, 4, 8, 16, 32], metavar="K,K,..."
    )
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    """``loraplex plan``: 0 on success, 2 on bad input."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code) if isinstance(e.code, int) else 2
    try:
        m = load_model(args.model)
        adapters = [adapter_from_path(a, m) for a in args.adapter]
        if args.rank is not None:
            t = args.targets.strip()
            targets: str | list[str] = (
                t if t == "all-linear" else [x.strip() for x in t.split(",") if x.strip()]
            )
            adapters.append(
                adapter_from_config({"r": args.rank, "target_modules": targets}, m, f"r{args.rank}")
            )
        plan = build_plan(
            m,
            adapters,
            dtype=args.dtype,
            max_lora_rank=args.max_lora_rank,
            device_budget=args.device_budget,
            slots=args.slots,
            num_adapters=args.num_adapters,
            host_budget=args.host_budget,
            disk_budget=args.disk_budget,
            decode_k=args.decode_k,
        )
    except PlanError as e:
        print(f"loraplex plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan, indent=1) if args.json else render_plan(plan))
    return 0
