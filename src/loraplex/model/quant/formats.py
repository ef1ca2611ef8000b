"""Quantized checkpoint formats: recognise a ``quantization_config`` (as vLLM does), check it,
and unpack each quantized projection's tensors into a :class:`QuantWeight` / :class:`FP8Weight`.

Formats (``quant_method``; their names are ``loraplex.config.QUANTIZED_CHECKPOINT_FORMATS``,
the ``--quantization`` choices), each as its writers lay it out:

- ``gptq`` (AutoGPTQ / GPTQModel): ``qweight`` int32 ``[K / (32 / bits), N]`` packed along K
  (value i of a word at bits ``bits * i``), ``qzeros`` int32 ``[G, N / (32 / bits)]`` packed
  along N, stored as ``zero - 1`` in the v1 ``checkpoint_format`` (``gptq_v2``: the zero itself),
  ``scales`` ``[G, N]``, ``g_idx`` int32 ``[K]`` (the group of each input column; act order
  permutes it). 4 or 8 bits.
- ``awq`` (AutoAWQ, ``version: gemm``): ``qweight`` / ``qzeros`` int32 ``[K, N / 8]`` /
  ``[G, N / 8]`` packed along N in AWQ's order (nibble i of word j is column
  ``8 j + [0, 2, 4, 6, 1, 3, 5, 7][i]``), ``scales`` ``[G, N]``. 4 bits, zero points.
- ``compressed-tensors`` (llm-compressor): ``pack-quantized`` (``weight_packed`` int32
  ``[N, K / (32 / bits)]`` packed along K, values offset by ``2^(bits - 1)``, ``weight_scale``
  ``[N, G]``, ``weight_zero_point`` where asymmetric, ``weight_g_idx`` with act order),
  ``int-quantized`` / ``naive-quantized`` (int8 ``weight`` ``[N, K]``: W8A8 with dynamic
  per-token int8 activations, or W8A16; W4A8 stores its int4 values so too, int8 ``[-8, 7]``), ``float-quantized`` (float8 ``weight``, per-tensor or
  per-channel ``weight_scale``, static ``input_scale`` or dynamic activations).
- ``fp8`` (vLLM / transformers' FP8): float8 ``weight``, per-tensor ``weight_scale``,
  ``input_scale`` with ``activation_scheme: static``.

A module the config leaves unquantized (``ignore``, ``modules_to_not_convert``, lm_head) simply
has a float ``weight``: what is quantized is read off the tensors' dtypes. Unsupported values get
one line naming the field and what is supported.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from loraplex.config import QUANTIZATION_METHODS, QUANTIZE_AT_LOAD, QUANTIZED_CHECKPOINT_FORMATS
from loraplex.model.quant.weights import ActQuant, FP8Weight, QuantWeight
from loraplex.types import ModelLoadError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

_INT_SUFFIXES = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "compressed-tensors": (
        "weight_packed",
        "weight_shape",
        "weight_scale",
        "weight_zero_point",
        "weight_g_idx",
        "weight",
        "input_scale",
        "input_zero_point",
    ),
    "fp8": ("weight", "weight_scale", "input_scale"),
}


@dataclass(frozen=True)
class QuantSpec:
    """What a model's base weights are: the checkpoint's format (``method`` one of
    ``QUANTIZED_CHECKPOINT_FORMATS``) or a float checkpoint quantized at load (``int8`` /
    ``int4``)."""

    method: str
    bits: int | None = None
    group_size: int | None = None  # None: per channel
    symmetric: bool = True
    act_order: bool = False
    activations: str | None = None  # "int8" / "fp8" for W8A8 checkpoints
    checkpoint_format: str = ""
    config: Mapping[str, Any] | None = None

    @property
    def on_the_fly(self) -> bool:
        return self.method in QUANTIZE_AT_LOAD

    @property
    def label(self) -> str:
        """One short name for logs, metrics and the registry (``gptq-w4g128``, ``int8``)."""
        if self.on_the_fly:
            g = f"-g{self.group_size}" if self.group_size else ""
            return f"{self.method}{g}"
        parts = [self.method]
        if self.bits:
            parts.append(f"w{self.bits}" + (f"g{self.group_size}" if self.group_size else ""))
        if self.activations:
            parts.append(f"a-{self.activations}")
        return "-".join(parts)

    def suffixes(self) -> tuple[str, ...]:
        """Tensor name suffixes a quantized projection of this format may have."""
        return _INT_SUFFIXES.get(self.method, ())


def _fail(field: str, value: object, supported: str) -> ModelLoadError:
    return ModelLoadError(
        f"quantization_config.{field}={value!r} is not supported (supported: {supported})"
    )


def _group(value: object) -> int | None:
    g = int(value) if value is not None else -1
    return None if g in (-1, 0) else g


def parse_quantization(
    qc: Mapping[str, Any] | None,
    requested: str | None,
    group_size: int | None = None,
) -> QuantSpec | None:
    """The model's quantization from config.json's ``quantization_config`` (``qc``) and
    ``--quantization`` (``requested``: a method the checkpoint must have, or ``int8`` / ``int4``
    to quantize a float checkpoint at load, with ``group_size`` for int4)."""
    if group_size is not None and requested != "int4":
        raise ModelLoadError(
            "--quantization-group-size applies to --quantization int4 only (the group size "
            "of a quantized checkpoint is its quantization_config's)"
        )
    if requested in QUANTIZE_AT_LOAD:
        if qc:
            raise ModelLoadError(
                f"--quantization {requested} quantizes a float checkpoint, but this one is "
                f"already quantized ({qc.get('quant_method')}); omit --quantization"
            )
        if requested == "int8":
            return QuantSpec("int8", 8, None)
        gs = 128 if group_size is None else group_size
        if gs <= 0 or gs % 32:
            raise ModelLoadError(
                f"--quantization-group-size {gs} is not supported (supported: a positive "
                "multiple of 32)"
            )
        return QuantSpec("int4", 4, gs)
    if requested is not None and requested not in QUANTIZED_CHECKPOINT_FORMATS:
        raise ModelLoadError(
            f"--quantization {requested} is not supported (supported: "
            f"{', '.join(QUANTIZATION_METHODS)})"
        )
    if not qc:
        if requested is not None:
            raise ModelLoadError(
                f"--quantization {requested}: the checkpoint has no quantization_config "
                "(use --quantization int8 or int4 to quantize a float checkpoint)"
            )
        return None
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")
    if method not in QUANTIZED_CHECKPOINT_FORMATS:
        raise _fail("quant_method", qc.get("quant_method"), ", ".join(QUANTIZED_CHECKPOINT_FORMATS))
    if requested is not None and requested != method:
        raise ModelLoadError(
            f"--quantization {requested} does not match the checkpoint's quant_method {method}"
        )
    return READERS[method](qc)


def _gptq(qc: Mapping[str, Any]) -> QuantSpec:
    bits = int(qc.get("bits", 4))
    if bits not in (4, 8):
        raise _fail("bits", bits, "4, 8")
    fmt = str(qc.get("checkpoint_format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise _fail("checkpoint_format", fmt, "gptq, gptq_v2")
    if qc.get("lm_head"):
        raise _fail("lm_head", True, "false (lm_head unquantized)")
    gs = _group(qc.get("group_size", 128))
    if gs is not None and gs % 32:
        raise _fail("group_size", gs, "-1 or a multiple of 32")
    return QuantSpec(
        "gptq", bits, gs, bool(qc.get("sym", True)), bool(qc.get("desc_act", False)),
        checkpoint_format=fmt, config=dict(qc),
    )  # fmt: skip


def _awq(qc: Mapping[str, Any]) -> QuantSpec:
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits != 4:
        raise _fail("bits", bits, "4")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _fail("version", version, "gemm")
    gs = _group(qc.get("group_size", qc.get("q_group_size", 128)))
    if gs is not None and gs % 32:
        raise _fail("group_size", gs, "-1 or a multiple of 32")
    zp = bool(qc.get("zero_point", True))
    return QuantSpec("awq", 4, gs, not zp, checkpoint_format=version, config=dict(qc))


def _compressed(qc: Mapping[str, Any]) -> QuantSpec:
    fmt = str(qc.get("format", ""))
    supported = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
    if fmt not in supported:
        raise _fail("format", fmt, ", ".join(supported))
    groups = qc.get("config_groups") or {}
    schemes = [g for g in groups.values() if isinstance(g, Mapping)]
    if len(schemes) != 1:
        raise _fail("config_groups", f"{len(schemes)} groups", "exactly one scheme")
    scheme = schemes[0]
    w = scheme.get("weights") or {}
    a = scheme.get("input_activations")
    wtype, bits = str(w.get("type", "int")), int(w.get("num_bits", 8))
    strategy = str(w.get("strategy", "tensor"))
    acts = None
    if a:
        atype, abits = str(a.get("type", "int")), int(a.get("num_bits", 8))
        if (atype, abits) not in (("int", 8), ("float", 8)):
            raise _fail("input_activations", f"{atype}{abits}", "int8, float8 or none")
        if atype == "int" and (not a.get("dynamic") or a.get("strategy") != "token"):
            raise _fail("input_activations.strategy", a.get("strategy"), "dynamic token for int8")
        if atype == "int" and not a.get("symmetric", True):
            raise _fail("input_activations.symmetric", False, "true")
        if atype == "float" and a.get("strategy") not in ("tensor", "token"):
            raise _fail("input_activations.strategy", a.get("strategy"), "tensor, token")
        acts = "int8" if atype == "int" else "fp8"
    if wtype == "float":
        if bits != 8 or strategy not in ("tensor", "channel"):
            raise _fail("weights", f"float{bits} {strategy}", "float8 tensor or channel")
        return QuantSpec("compressed-tensors", 8, None, True, False, acts, fmt, dict(qc))
    if bits not in (4, 8):
        raise _fail("weights.num_bits", bits, "4, 8")
    if strategy not in ("channel", "group"):
        raise _fail("weights.strategy", strategy, "channel, group")
    gs = _group(w.get("group_size")) if strategy == "group" else None
    if gs is not None and gs % 32:
        raise _fail("weights.group_size", gs, "a multiple of 32")
    actorder = w.get("actorder")
    if actorder not in (None, "group", "weight", False):
        raise _fail("weights.actorder", actorder, "group, weight or none")
    if acts == "int8" and bits == 8 and (strategy != "channel" or not w.get("symmetric", True)):
        raise _fail("weights", f"int{bits} {strategy}", "int8 channel symmetric for W8A8")
    if acts == "fp8":
        raise _fail("input_activations", "float8 with int weights", "int8 with int8 weights")
    return QuantSpec(
        "compressed-tensors", bits, gs, bool(w.get("symmetric", True)), actorder == "group",
        acts, fmt, dict(qc),
    )  # fmt: skip


def _fp8(qc: Mapping[str, Any]) -> QuantSpec:
    if qc.get("weight_block_size"):
        raise _fail("weight_block_size", qc["weight_block_size"], "none (per-tensor scales)")
    scheme = str(qc.get("activation_scheme", "dynamic"))
    if scheme not in ("static", "dynamic"):
        raise _fail("activation_scheme", scheme, "static, dynamic")
    return QuantSpec("fp8", 8, None, True, False, "fp8", "fp8", dict(qc))


# ------------------------------------------------------------------------ tensor unpacking


READERS: dict[str, Callable[[Mapping[str, Any]], QuantSpec]] = {
    "gptq": _gptq,
    "awq": _awq,
    "compressed-tensors": _compressed,
    "fp8": _fp8,
}
"""Each checkpoint format's ``quantization_config`` reader, by the format's name (one per name
in ``QUANTIZED_CHECKPOINT_FORMATS``: a test keeps them equal, as ``_INT_SUFFIXES``)."""


def is_quantized_tensor(spec: QuantSpec, suffix: str, dtype: str) -> bool:
    """Whether a projection's tensor ``suffix`` (``st`` dtype name ``dtype``) belongs to its
    quantized form (a float ``weight`` of an ignored module does not)."""
    if suffix not in spec.suffixes():
        return False
    if suffix == "weight":
        return dtype in ("torch.int8", "torch.float8_e4m3fn")
    return True


def _unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their ``32 / bits`` values along ``dim`` (value i at bits ``bits * i``)."""
    per = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, dtype=torch.int64) * bits
    v = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., per]
    if dim == 0:  # [K / per, N, per] -> [K, N]
        return v.permute(0, 2, 1).reshape(-1, words.shape[1])
    return v.reshape(words.shape[0], -1)  # [R, C * per]


def _need(tensors: Mapping[str, torch.Tensor], name: str, where: str) -> torch.Tensor:
    t = tensors.get(name)
    if t is None:
        raise ModelLoadError(f"{where}: missing tensor {name!r} of a quantized projection")
    return t


def _check(got: tuple[int, ...], want: tuple[int, ...], name: str, where: str) -> None:
    if tuple(got) != tuple(want):
        raise ModelLoadError(
            f"{where}.{name}: shape {tuple(got)}, the config implies {tuple(want)}"
        )


def _to_int8(values: torch.Tensor, zeros: torch.Tensor | None, bits: int, unsigned: bool) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """8-bit unsigned values and zero points (0..255) -> the signed int8 storage (shifted
    together, so ``q - z`` is unchanged)."""
    if bits == 8 and unsigned:
        values = values - 128
        zeros = zeros - 128 if zeros is not None else None
    return values, zeros


def _grouped(
    values: torch.Tensor,  # [N, K] int, input column order
    scales: torch.Tensor,  # [N, G]
    zeros: torch.Tensor | None,  # [N, G] int
    g_idx: torch.Tensor | None,  # [K] group of each input column
    bits: int,
    group_size: int | None,  # None: per channel
    where: str,
) -> QuantWeight:
    k = values.shape[1]
    groups = scales.shape[1]
    gs = k if group_size is None else group_size
    if groups != -(-k // gs):
        raise ModelLoadError(
            f"{where}: {groups} groups of scales for in_features {k} in groups of {gs}"
        )
    perm = None
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64)
        if g_idx.shape != (k,) or g_idx.min() < 0 or g_idx.max() >= groups:
            raise ModelLoadError(f"{where}.g_idx: not a group index per input column")
        if not torch.equal(g_idx, torch.arange(k) // gs):  # act order: sort columns by group
            counts = torch.bincount(g_idx, minlength=groups)
            want = torch.full((groups,), gs)
            want[-1] = k - (groups - 1) * gs
            if not torch.equal(counts, want):
                raise ModelLoadError(f"{where}.g_idx: groups of unequal size")
            perm = torch.argsort(g_idx, stable=True)
            values = values[:, perm]
    if bits == 4 and k % 32:
        raise ModelLoadError(f"{where}: 4-bit weights need in_features a multiple of 32, got {k}")
    return QuantWeight(
        QuantWeight.pack(values, bits),
        bits,
        scales.float().contiguous(),
        None if zeros is None else zeros.to(torch.int8).contiguous(),
        gs,
        perm,
    )


def unpack_projection(
    spec: QuantSpec,
    tensors: Mapping[str, torch.Tensor],
    out_features: int,
    in_features: int,
    where: str,
) -> QuantWeight | FP8Weight:
    """One projection's quantized tensors (by suffix, raw dtypes) -> its weight, shapes
    checked against the config's ``[out_features, in_features]``."""
    n, k = out_features, in_features
    m = spec.method
    if m in ("gptq", "awq"):
        bits = spec.bits or 4
        per = 32 // bits
        qweight = _need(tensors, "qweight", where)
        scales = _need(tensors, "scales", where)
        qzeros = _need(tensors, "qzeros", where)
        groups = scales.shape[0]
        _check(scales.shape, (groups, n), "scales", where)
        if m == "gptq":
            _check(qweight.shape, (k // per, n), "qweight", where)
            _check(qzeros.shape, (groups, n // per), "qzeros", where)
            values = _unpack_words(qweight, bits, 0).T  # [N, K]
            zeros = _unpack_words(qzeros, bits, 1).T  # [N, G]
            if spec.checkpoint_format == "gptq":
                zeros = zeros + 1  # v1 stores zero - 1
            g_idx = tensors.get("g_idx")
            values, zeros = _to_int8(values, zeros, bits, unsigned=True)
            return _grouped(values, scales.T, zeros, g_idx, bits, spec.group_size, where)
        _check(qweight.shape, (k, n // 8), "qweight", where)
        _check(qzeros.shape, (groups, n // 8), "qzeros", where)
        order = torch.tensor(AWQ_ORDER)
        inverse = torch.argsort(order)

        def columns(words: torch.Tensor) -> torch.Tensor:  # [R, N/8] -> [R, N] in column order
            v = _unpack_words(words, 4, 1).view(words.shape[0], -1, 8)
            return v[..., inverse].reshape(words.shape[0], -1)

        return _grouped(
            columns(qweight).T, scales.T, columns(qzeros).T, None, 4, spec.group_size, where
        )
    if m == "fp8" or (m == "compressed-tensors" and spec.checkpoint_format == "float-quantized"):
        w = _need(tensors, "weight", where)
        _check(w.shape, (n, k), "weight", where)
        s = _need(tensors, "weight_scale", where).float().reshape(-1, 1)
        if s.shape[0] not in (1, n):
            raise ModelLoadError(f"{where}.weight_scale: {s.shape[0]} scales for {n} rows")
        act = None
        if spec.activations == "fp8":
            inp = tensors.get("input_scale")
            act = ActQuant("fp8", None if inp is None else float(inp.float().max()))
            if (
                m == "fp8"
                and (spec.config or {}).get("activation_scheme") == "static"
                and inp is None
            ):
                raise ModelLoadError(f"{where}: static activation_scheme without input_scale")
        return FP8Weight(w.to(torch.float8_e4m3fn), s.contiguous(), act)
    # compressed-tensors integer formats
    bits = spec.bits or 8
    scales = _need(tensors, "weight_scale", where).float()
    if scales.dim() == 1:
        scales = scales[:, None]
    groups = scales.shape[1]
    _check(scales.shape, (n, groups), "weight_scale", where)
    if "weight_packed" in tensors:
        per = 32 // bits
        packed = tensors["weight_packed"]
        _check(packed.shape, (n, k // per), "weight_packed", where)
        values = _unpack_words(packed, bits, 1) - (1 << (bits - 1))  # signed
    else:
        w = _need(tensors, "weight", where)
        _check(w.shape, (n, k), "weight", where)
        values = w.to(torch.int64)
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        if values.numel() and (int(values.min()) < lo or int(values.max()) > hi):
            raise ModelLoadError(f"{where}.weight: int{bits} values outside [{lo}, {hi}]")
    zeros = None
    zp = tensors.get("weight_zero_point")
    if zp is not None and not spec.symmetric:
        if zp.dtype == torch.int32 and zp.shape != (n, groups):  # packed along the rows
            zp = _unpack_words(zp.T.contiguous(), bits, 1).T[:n] - (1 << (bits - 1))
        zeros = zp.to(torch.int64).reshape(n, groups)
    if bits == 4:  # the nibble storage is unsigned: offset values and zero points together
        values = values + 8
        zeros = (zeros if zeros is not None else torch.zeros(n, groups, dtype=torch.int64)) + 8
    g_idx = tensors.get("weight_g_idx")
    weight = _grouped(values, scales, zeros, g_idx, bits, spec.group_size, where)
    if spec.activations == "int8":
        from dataclasses import replace

        weight = replace(weight, act=ActQuant("int8"))
    return weight
