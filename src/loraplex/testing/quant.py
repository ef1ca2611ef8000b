"""Quantized checkpoints for tests, written in each format's documented layout from a float
checkpoint, with the float reference every test compares against.

``write_gptq`` / ``write_awq`` quantize every decoder projection round-to-nearest (GPTQModel and
AutoAWQ need a GPU to run their algorithms; the layout, not the algorithm, is what a server
reads) and write AutoGPTQ's v1 / AutoAWQ's GEMM tensors. The reference directory holds the same
model with each projection replaced by its dequantized weight, computed here from the integers
and fp16 scales before packing, so it is independent of loraplex's unpacking.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from loraplex.model.qwen3_5 import LINEAR_ATTN_PROJ_NAMES

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
OWN_PROJECTIONS = (
    *PROJECTIONS,
    *LINEAR_ATTN_PROJ_NAMES,
    "per_layer_input_gate",
    "per_layer_projection",
)
"""Every projection ``--quantization int8/int4`` quantizes: the architectures' own too (Qwen3.5's
linear attention, Gemma 4's per-layer inputs)."""
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _is_projection(name: str, names: tuple[str, ...] = PROJECTIONS) -> bool:
    return (
        name.startswith("model.layers.")
        and name.rsplit(".", 2)[-2] in names
        and (name.endswith(".weight"))
    )


def _pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned values -> int32 words of ``32 / bits`` values along ``dim`` (value i at bits
    ``bits * i``), wrapping into int32 as the writers store them."""
    per = 32 // bits
    v = values.to(torch.int64)
    if dim == 0:
        v = v.reshape(-1, per, v.shape[1]).permute(0, 2, 1)  # [K / per, N, per]
    else:
        v = v.reshape(v.shape[0], -1, per)  # [R, C / per, per]
    shifts = torch.arange(per, dtype=torch.int64) * bits
    words = (v << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _quantize(
    w: torch.Tensor, bits: int, gs: int, sym: bool, g_idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K] unsigned, zeros [N, G], fp16 scales [N, G], dequantized [N, K] float32)."""
    n, k = w.shape
    groups = k // gs
    levels = (1 << bits) - 1
    q = torch.empty(n, k, dtype=torch.int64)
    zeros = torch.empty(n, groups, dtype=torch.int64)
    scales = torch.empty(n, groups, dtype=torch.float16)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        block = w[:, cols].float()
        if sym:
            s = (block.abs().amax(1) / ((levels - 1) / 2)).clamp(min=1e-6)
            z = torch.full((n,), (levels + 1) // 2, dtype=torch.int64)
        else:
            lo, hi = block.amin(1).clamp(max=0), block.amax(1).clamp(min=0)
            s = ((hi - lo) / levels).clamp(min=1e-6)
            z = torch.round(-lo / s).clamp(0, levels).to(torch.int64)
        s16 = s.to(torch.float16)
        qg = torch.round(block / s16.float()[:, None]) + z[:, None]
        q[:, cols] = qg.clamp(0, levels).to(torch.int64)
        zeros[:, g], scales[:, g] = z, s16
    deq = (q - zeros[:, g_idx]).float() * scales.float()[:, g_idx]
    return q, zeros, scales, deq


def _write(
    float_dir: Path,
    out_dir: Path,
    ref_dir: Path,
    qconfig: dict,
    convert: object,
    names: tuple[str, ...] = PROJECTIONS,
) -> tuple[Path, Path]:
    """Copy the float checkpoint twice: the projections ``names`` quantized (``convert(name,
    w) -> (tensors, deq)``) into ``out_dir`` with ``qconfig``, and dequantized into
    ``ref_dir``."""
    for d in (out_dir, ref_dir):
        shutil.copytree(float_dir, d, dirs_exist_ok=True)
        for f in d.glob("*.safetensors"):
            f.unlink()
    tensors = {}
    for f in sorted(float_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    quant, ref = {}, {}
    for name, t in tensors.items():
        if _is_projection(name, names):
            parts, deq = convert(name, t.float())  # type: ignore[operator]
            prefix = name[: -len(".weight")]
            quant.update({f"{prefix}.{k}": v.contiguous() for k, v in parts.items()})
            ref[name] = deq.to(t.dtype)
        else:
            quant[name] = ref[name] = t.contiguous()
    save_file(quant, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(ref, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((float_dir / "config.json").read_text())
    cfg["quantization_config"] = qconfig
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return out_dir, ref_dir


def write_gptq(
    float_dir: str | Path,
    out_dir: str | Path,
    ref_dir: str | Path,
    *,
    bits: int = 4,
    group_size: int = 32,
    sym: bool = True,
    act_order: bool = False,
    seed: int = 0,
) -> tuple[Path, Path]:
    """AutoGPTQ's v1 layout (``checkpoint_format: gptq``): qweight packed along K, qzeros
    (zero - 1) packed along N, fp16 scales ``[G, N]``, ``g_idx``; with ``act_order`` the
    columns of each group are a random permutation's (every projection sharing an input gets
    the same order, as GPTQ's Hessian ordering gives them)."""
    gen = torch.Generator().manual_seed(seed)
    orders: dict[tuple[str, int], torch.Tensor] = {}

    def convert(name: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
        k = w.shape[1]
        gs = k if group_size == -1 else group_size
        g_idx = torch.arange(k) // gs
        if act_order:
            layer, proj = name.split(".")[2], name.rsplit(".", 2)[-2]
            shared = "qkv" if proj in ("q_proj", "k_proj", "v_proj") else proj
            shared = "gate_up" if proj in ("gate_proj", "up_proj") else shared
            key = (f"{layer}.{shared}", k)
            if key not in orders:
                perm = torch.randperm(k, generator=gen)
                g = torch.empty(k, dtype=torch.int64)
                g[perm] = torch.arange(k) // gs
                orders[key] = g
            g_idx = orders[key]
        q, zeros, scales, deq = _quantize(w, bits, gs, sym, g_idx)
        parts = {
            "qweight": _pack(q.T, bits, 0),  # [K / per, N]
            "qzeros": _pack((zeros - 1).T, bits, 1),  # [G, N / per], v1: zero - 1
            "scales": scales.T.contiguous(),  # [G, N]
            "g_idx": g_idx.to(torch.int32),
        }
        return parts, deq

    qconfig = {
        "quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order,
        "sym": sym, "checkpoint_format": "gptq", "lm_head": False,
    }  # fmt: skip
    return _write(Path(float_dir), Path(out_dir), Path(ref_dir), qconfig, convert)


def write_awq(
    float_dir: str | Path, out_dir: str | Path, ref_dir: str | Path, *, group_size: int = 32
) -> tuple[Path, Path]:
    """AutoAWQ's GEMM layout: qweight ``[K, N / 8]`` and qzeros ``[G, N / 8]`` packed along N in
    AWQ's order, fp16 scales ``[G, N]``; asymmetric 4-bit."""
    order = torch.tensor(AWQ_ORDER)

    def columns_to_words(v: torch.Tensor) -> torch.Tensor:  # [R, N] -> [R, N / 8]
        r, n = v.shape
        packed_order = v.reshape(r, n // 8, 8)[..., order].reshape(r, n)
        return _pack(packed_order, 4, 1)

    def convert(name: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
        k = w.shape[1]
        g_idx = torch.arange(k) // group_size
        q, zeros, scales, deq = _quantize(w, 4, group_size, False, g_idx)
        parts = {
            "qweight": columns_to_words(q.T.contiguous()),  # [K, N / 8]
            "qzeros": columns_to_words(zeros.T.contiguous()),  # [G, N / 8]
            "scales": scales.T.contiguous(),  # [G, N]
        }
        return parts, deq

    qconfig = {
        "quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
        "version": "gemm",
    }  # fmt: skip
    return _write(Path(float_dir), Path(out_dir), Path(ref_dir), qconfig, convert)


def write_dequantized(
    float_dir: str | Path, ref_dir: str | Path, *, bits: int, group_size: int | None
) -> Path:
    """The reference of ``--quantization int8/int4``: the float checkpoint with every
    projection replaced by its round-to-nearest quantized-then-dequantized weight, and the
    embedding and LM head by their per-row int8 ones (loraplex's definition of the on-the-fly
    modes, ``QuantWeight.quantize``)."""
    from loraplex.model.quant.weights import QuantWeight

    def convert(name: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
        qw = QuantWeight.quantize(w, bits, group_size)
        return {}, qw.dequantize(torch.float32)

    scratch = Path(ref_dir).with_name(Path(ref_dir).name + "-unused")
    # every projection --quantization quantizes: a hybrid's linear-attention ones and Gemma 4's
    # per-layer ones too
    _write(Path(float_dir), scratch, Path(ref_dir), {}, convert, OWN_PROJECTIONS)
    shutil.rmtree(scratch)
    path = Path(ref_dir) / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.per_layer_model_projection.weight"  # Gemma 4's, outside the layers
    if name in tensors:
        tensors[name] = convert(name, tensors[name].float())[1].to(tensors[name].dtype)
    # the embeddings (Gemma 4's per-layer table too) and the LM head: int8, one scale per row
    vocab = ("model.embed_tokens.weight", "lm_head.weight", "model.embed_tokens_per_layer.weight")
    for name in vocab:
        if name in tensors:
            t = tensors[name]
            tensors[name] = QuantWeight.quantize(t.float(), 8, None).dequantize().to(t.dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return Path(ref_dir)


def write_fp8(
    float_dir: str | Path,
    out_dir: str | Path,
    ref_dir: str | Path,
    *,
    activation_scheme: str = "dynamic",
    input_scale: float = 0.02,
) -> tuple[Path, Path]:
    """vLLM's / transformers' ``quant_method: fp8`` layout: float8 e4m3 ``weight`` with a
    per-tensor ``weight_scale`` (absmax / 448) and, with ``activation_scheme: static``, a
    per-tensor ``input_scale`` (``input_scale`` here, one for every projection)."""
    fp8_max = torch.finfo(torch.float8_e4m3fn).max

    def convert(name: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
        scale = (w.abs().max() / fp8_max).clamp(min=1e-12).reshape(())
        q = (w / scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
        parts = {"weight": q, "weight_scale": scale.float()}
        if activation_scheme == "static":
            parts["input_scale"] = torch.tensor(input_scale, dtype=torch.float32)
        return parts, q.float() * scale

    qconfig = {"quant_method": "fp8", "activation_scheme": activation_scheme}
    return _write(Path(float_dir), Path(out_dir), Path(ref_dir), qconfig, convert)
