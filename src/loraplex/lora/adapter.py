"""Read and validate PEFT LoRA adapter directories as they are on disk.

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` (or the
older ``adapter_model.bin``). :func:`load_peft_adapter` turns it into a :class:`LoRAAdapter`:
per ``(layer, proj)`` the factors ``A: [r, d_in]``, ``B: [d_out, r]`` and the scale, so that

    W_eff = W + scale * B @ A        # what PEFT's merge_and_unload computes

(``(VOCAB_LAYER, "embed_tokens")``: PEFT's ``lora_embedding_A [r, vocab]`` and
``lora_embedding_B [hidden, r]``, so ``W_eff`` is the transposed embedding matrix;
``(VOCAB_LAYER, "lm_head")``: the head's ``lora_A`` / ``lora_B``.)

Everything we cannot serve exactly (DoRA, biases, modules_to_save, ...) is
refused with an :class:`AdapterError` that names the adapter path and the offending field or
tensor, never silently ignored; the rules themselves are :mod:`loraplex.lora.peft`'s
(shared with the registry). The identity of an adapter is :func:`compute_adapter_digest`: a
sha256 over the config fields that change the math and the raw tensor bytes
(:mod:`loraplex.lora.digest` computes the same value without torch).

Bytes we serve are bytes we own: :func:`read_adapter` reads each file once into process memory,
hashes those bytes and builds the tensors from them, so the digest describes exactly what is
served and no later change to the files (an in-place write, a truncation) reaches a loaded
adapter (safetensors' ``load_file`` would map the file and fault on a truncation).
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from blake3 import blake3

from loraplex.checkpoint.modules import BaseModelSpec
from loraplex.checkpoint.safetensors import SAFETENSORS_DTYPES, TensorInfo
from loraplex.lora.digest import (
    DIGEST_VERSION,
    LEGACY_DIGEST_VERSION,
    DigestError,
    SafetensorsAdapter,
    config_digest_line,
    parse_config_bytes,
    read_owned,
    read_safetensors_adapter,
    safetensors_adapter_of,
    tensor_header_line,
)
from loraplex.lora.filehash import SEGMENT, read_digest, segmented_digest
from loraplex.lora.peft.activation import invocation_tokens
from loraplex.lora.peft.config import parse_lora_config
from loraplex.lora.peft.errors import FormatError
from loraplex.lora.peft.experts import ExpertModuleLayout
from loraplex.lora.peft.files import BIN_NAME, CONFIG_NAME, SAFETENSORS_NAME
from loraplex.lora.peft.layout import check_layout
from loraplex.lora.peft.tensors import TensorMeta
from loraplex.lora.slots import SlotSource
from loraplex.types import AdapterError, AdapterRef
from loraplex.workers import IdleWorker

__all__ = [
    "AdapterRead",
    "LoRAAdapter",
    "LoRAModuleWeights",
    "build_adapter",
    "compute_adapter_digest",
    "load_peft_adapter",
    "read_adapter",
    "read_adapter_files",
]


@dataclass
class LoRAModuleWeights:
    """One adapted module: ``y += scale * (x @ a.T) @ b.T`` (the embedding: ``x`` one-hot).

    An expert projection of a MoE layer holds every expert's factors, ``a [E, r, d_in]`` and
    ``b [E, d_out, r]`` (expert ``e``'s rows ``y += scale * (x @ a[e].T) @ b[e].T``), with each
    expert's own scale already in its ``b`` (``scale`` 1) and zeros past an expert's rank."""

    a: torch.Tensor  # [r, d_in], or [E, r, d_in]
    b: torch.Tensor  # [d_out, r], or [E, d_out, r]
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora

    @property
    def rank(self) -> int:
        return int(self.a.shape[-2])

    @property
    def num_experts(self) -> int:
        """Experts the factors cover (0: an ordinary module)."""
        return int(self.a.shape[0]) if self.a.dim() == 3 else 0


@dataclass
class LoRAAdapter:
    """A validated adapter: identity, source path, per-module factors and the raw config."""

    ref: AdapterRef
    path: str
    weights: dict[tuple[int, str], LoRAModuleWeights]  # (layer index, proj name) -> weights
    config: dict

    @functools.cached_property
    def slot_source(self) -> SlotSource:
        """The weights as device-slot writes copy them (lists built on the first load, kept
        for the next ones)."""
        return SlotSource(self.weights)

    @functools.cached_property
    def alora_invocation_tokens(self) -> tuple[int, ...] | None:
        """The invocation sequence of an activated LoRA (None: a standard LoRA, applied from
        the first token); see :mod:`loraplex.lora.peft.activation`."""
        return invocation_tokens(self.config)

    @property
    def rank(self) -> int:
        """Max rank over modules (what a device slot must hold)."""
        return max(w.rank for w in self.weights.values())

    @property
    def target_modules(self) -> tuple[str, ...]:
        """Sorted module names this adapter adapts in at least one layer (or in the embedding
        / LM head: ``embed_tokens``, ``lm_head``)."""
        return tuple(sorted({proj for _, proj in self.weights}))

    @property
    def nbytes(self) -> int:
        """Bytes of all A and B tensors (host memory the adapter occupies: an A shared by a
        fused module's parts counts once)."""
        tensors = {id(w.a): w.a for w in self.weights.values()}
        tensors.update((id(w.b), w.b) for w in self.weights.values())
        return sum(t.numel() * t.element_size() for t in tensors.values())


def _fail(path: str | Path, what: str) -> AdapterError:
    return AdapterError(f"adapter {path}: {what}")


_TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name.removeprefix("torch."))
    for name, _ in SAFETENSORS_DTYPES.values()
    if hasattr(torch, name.removeprefix("torch."))
}


@dataclass(eq=False)
class AdapterRead:
    """One read of an adapter directory into memory this process owns.

    ``tensors`` are built from exactly the bytes ``digest`` hashed (safetensors: views of one
    owned buffer holding the file; ``.bin``: tensors unpickled from owned bytes), so nothing a
    later write, rename or truncation of the files does can change them or fault on them.
    ``weights_file`` is the file the weights came from (safetensors or ``.bin``).
    """

    config: dict
    tensors: dict[str, torch.Tensor]
    digest: str
    weights_file: str
    _legacy: Callable[[], str]
    files: SafetensorsAdapter | None = None  # the owned bytes read (safetensors only)

    def legacy_digest(self) -> str:
        """What digest v1 gave these bytes (explains a mismatch with an old registration)."""
        return self._legacy()


@dataclass(frozen=True)
class _Run:
    """Tensors of one dtype and shape at evenly spaced offsets of a safetensors file (usually one
    projection's factor in every layer): one ``as_strided`` and one ``unbind`` build them all,
    instead of a few torch calls per tensor."""

    dtype: torch.dtype
    names: tuple[str, ...]  # in file order
    shape: tuple[int, ...]  # of each tensor
    stride: tuple[int, ...]  # contiguous strides of ``shape``, in elements
    start: int  # absolute byte offset of the first tensor
    step: int  # bytes from one tensor's start to the next (0 for a run of one)
    nbytes: int  # of each tensor


@dataclass(frozen=True)
class _Layout:
    """Where the tensors of a safetensors file lie, ready to build them from its bytes."""

    names: tuple[str, ...]  # in the header's order, which the tensors dict keeps
    runs: tuple[_Run, ...]


def _layout(table: Mapping[str, TensorInfo]) -> _Layout:
    """The tensors of ``table`` as :class:`_Run`s: tensors whose names differ only in their
    numbers (the layer index), of one dtype and shape, at a constant step and aligned for the
    dtype, share a run; any other tensor is a run of one. :class:`DigestError` for a dtype torch
    does not have."""
    groups: dict[tuple[torch.dtype, tuple[int, ...], str], list[TensorInfo]] = {}
    for name, info in table.items():
        dtype = _TORCH_DTYPES.get(info.dtype)
        if dtype is None:
            raise DigestError(f"tensor {name!r}: dtype {info.dtype} is not available in torch")
        key = (dtype, tuple(int(n) for n in info.shape), re.sub(r"[0-9]+", "#", name))
        groups.setdefault(key, []).append(info)
    out: list[_Run] = []
    for (dtype, shape, _), infos in groups.items():
        stride = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            stride[i] = stride[i + 1] * shape[i + 1]
        nbytes, isz = infos[0].nbytes, dtype.itemsize
        run: list[TensorInfo] = []
        for info in sorted(infos, key=lambda t: t.start):
            joins = bool(run) and nbytes > 0 and run[0].start % isz == 0
            joins = joins and info.start % isz == 0
            if joins and len(run) > 1:
                joins = info.start - run[-1].start == run[1].start - run[0].start
            if run and not joins:
                out.append(_run_of(dtype, shape, tuple(stride), run))
                run = []
            run.append(info)
        out.append(_run_of(dtype, shape, tuple(stride), run))
    return _Layout(tuple(table), tuple(out))


def _run_of(
    dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...], infos: list[TensorInfo]
) -> _Run:
    step = infos[1].start - infos[0].start if len(infos) > 1 else 0
    names = tuple(t.name for t in infos)
    return _Run(dtype, names, shape, stride, infos[0].start, step, infos[0].nbytes)


@dataclass(frozen=True)
class KnownFiles:
    """What a full verification of a safetensors adapter directory found: a BLAKE3 digest of
    each file's bytes (the weights' segmented, :mod:`loraplex.lora.filehash`) and where each
    tensor lies in them. A later read whose files hash the same holds the same bytes, so it may
    skip re-deriving the digest and re-parsing the header (:func:`read_known_adapter`). Only
    trust a record made in this process.

    BLAKE3, not sha256: the record is made here from bytes that passed the full sha256-based
    digest check, so any 256-bit cryptographic hash answers "are these the same bytes" as well,
    and BLAKE3 is several times faster than sha256 (an L2 load is mostly this hash)."""

    config_blake3: bytes
    weights_digest: bytes  # segmented BLAKE3 with ``segment``-byte segments
    weights_size: int
    layout: _Layout  # where each tensor lies in the weights file
    segment: int = SEGMENT

    @classmethod
    def of(cls, st: SafetensorsAdapter, *, segment: int = SEGMENT) -> KnownFiles:
        return cls(
            blake3(st.config_bytes).digest(),
            segmented_digest(st.data, segment),
            len(st.data),
            _layout(st.tensors),
            segment,
        )


def read_known_adapter(
    path: str | Path, known: KnownFiles, *, helper: IdleWorker | None = None
) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """``(config, tensors)`` of the adapter directory at ``path`` if its files are byte for byte
    the ones ``known`` describes: the weights file read once into one owned, uninitialised
    buffer and hashed segment by segment as it lands (by this thread and ``helper``'s, when
    given: :func:`~loraplex.lora.filehash.read_digest`), and the tensors built as views of
    exactly those bytes. None when a file is missing, unreadable or different (the caller then
    verifies fully, which names the cause)."""
    root = Path(path)
    try:
        with open(root / CONFIG_NAME, "rb") as f:
            cfg = f.read()
        if blake3(cfg).digest() != known.config_blake3:
            return None
        with open(root / SAFETENSORS_NAME, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size != known.weights_size:
                return None
            buf = torch.empty(size, dtype=torch.uint8)  # [file bytes], not zero-filled
            got = read_digest(f.fileno(), buf.numpy(), segment=known.segment, helper=helper)
    except OSError:
        return None
    if got != known.weights_digest:  # None: the file ended early or a read failed
        return None
    return json.loads(cfg), _tensors_in(buf, known.layout)


def _tensors_of(st: SafetensorsAdapter) -> dict[str, torch.Tensor]:
    """The tensors of an owned safetensors buffer (see :func:`_tensors_in`)."""
    return _tensors_in(torch.frombuffer(st.data, dtype=torch.uint8), _layout(st.tensors))


def _tensors_in(base: torch.Tensor, layout: _Layout) -> dict[str, torch.Tensor]:
    """The tensors of an owned safetensors buffer ``base`` (``[file bytes]`` uint8, at storage
    offset 0): zero-copy views where the offset is aligned for the dtype, else an aligned copy
    (both own memory; never a file mapping). Keys in ``layout``'s (the header's) order."""
    ptr, size = base.data_ptr(), base.numel()
    typed: dict[torch.dtype, torch.Tensor] = {}  # dtype -> [size // itemsize] view of base
    out: dict[str, torch.Tensor] = {}
    for r in layout.runs:
        isz = r.dtype.itemsize
        if r.nbytes == 0:
            out.update((n, torch.empty(r.shape, dtype=r.dtype)) for n in r.names)
        elif ptr % isz or r.start % isz:
            for j, n in enumerate(r.names):
                s = r.start + j * r.step
                out[n] = base[s : s + r.nbytes].clone().view(r.dtype).reshape(r.shape)
        else:
            t = typed.get(r.dtype)
            if t is None:
                t = typed[r.dtype] = base[: size - size % isz].view(r.dtype)
            if len(r.names) == 1:
                out[r.names[0]] = t.as_strided(r.shape, r.stride, r.start // isz)
            else:  # [len(names), *shape] over the run, one view per tensor
                stacked = t.as_strided(
                    (len(r.names), *r.shape), (r.step // isz, *r.stride), r.start // isz
                )
                out.update(zip(r.names, stacked.unbind(0), strict=True))
    return {n: out[n] for n in layout.names}


def read_adapter(path: str | Path, *, allow_pickle: bool = True) -> AdapterRead:
    """Read ``adapter_config.json`` and the weights (safetensors preferred, else ``.bin``) of
    ``path`` once into owned memory, hash them and parse the tensors from those bytes.

    ``allow_pickle=False`` refuses a directory whose weights would come from ``.bin`` (a
    pickle): for adapters registered from safetensors. Only checks that the files exist and
    parse (:class:`AdapterError` naming ``path``); :func:`build_adapter` validates content.
    """
    root = Path(path)
    if not root.is_dir():
        raise _fail(path, "directory not found")
    cfg_path = root / CONFIG_NAME
    if not cfg_path.is_file():
        raise _fail(path, f"missing {CONFIG_NAME}")
    st_path, bin_path = root / SAFETENSORS_NAME, root / BIN_NAME
    if st_path.is_file():
        try:
            st = read_safetensors_adapter(root)
            tensors = _tensors_of(st)
        except DigestError as e:
            raise _fail(path, f"cannot read the adapter (corrupt or truncated?): {e}") from e
        return AdapterRead(
            st.config, tensors, st.digest, SAFETENSORS_NAME, st.legacy_digest, files=st
        )
    if bin_path.is_file() and not allow_pickle:
        raise _fail(
            path,
            f"has {BIN_NAME} (a pickle) but no {SAFETENSORS_NAME}; this adapter was registered "
            f"from {SAFETENSORS_NAME}, and {BIN_NAME} is only read where it was allowed",
        )
    try:
        cfg_raw = cfg_path.read_bytes()
    except OSError as e:
        raise _fail(path, f"cannot read {CONFIG_NAME} ({e})") from e
    try:
        config = json.loads(cfg_raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(path, f"{CONFIG_NAME} is not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise _fail(path, f"{CONFIG_NAME} must hold a JSON object, got {type(config).__name__}")
    if not bin_path.is_file():
        raise _fail(path, f"missing weights file ({SAFETENSORS_NAME} or {BIN_NAME})")
    try:
        raw = read_owned(bin_path)
        loaded = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:  # OSError, UnpicklingError, RuntimeError, EOFError, ...
        raise _fail(path, f"cannot read {BIN_NAME} (corrupt or not a state dict?): {e}") from e
    if not isinstance(loaded, dict):
        raise _fail(path, f"{BIN_NAME} must hold a dict of tensors")
    for name, t in loaded.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise _fail(path, f"weights entry {name!r} is not a named tensor")
    tensors = dict(loaded)
    return AdapterRead(
        config,
        tensors,
        compute_adapter_digest(config, tensors),
        BIN_NAME,
        lambda: compute_adapter_digest(config, tensors, legacy=True),
    )


def read_pushed(config_bytes: bytes, weights: bytearray, *, name: str) -> AdapterRead:
    """Parse and hash pushed adapter bytes (``config_bytes``: an ``adapter_config.json``,
    ``weights``: a whole ``adapter_model.safetensors``, both owned by the caller) exactly as a
    directory holding those two files is read: same digest, same tensors. Only checks that
    they parse (:class:`AdapterError` naming the adapter); :func:`build_adapter` validates
    content."""
    where = f"pushed adapter {name!r}"
    try:
        config = parse_config_bytes(config_bytes, f"{where}: {CONFIG_NAME}")
        st = safetensors_adapter_of(config_bytes, config, weights, f"{where}: body")
        tensors = _tensors_of(st)
    except DigestError as e:
        raise AdapterError(str(e)) from e
    return AdapterRead(config, tensors, st.digest, SAFETENSORS_NAME, st.legacy_digest, files=st)


def read_adapter_files(
    path: str | Path, *, allow_pickle: bool = True
) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config, tensors)`` of :func:`read_adapter` (owned memory, never a file mapping)."""
    r = read_adapter(path, allow_pickle=allow_pickle)
    return r.config, r.tensors


def compute_adapter_digest(
    config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], *, legacy: bool = False
) -> str:
    """sha256 hex of an adapter's identity: math config + every tensor's name/dtype/shape/bytes.

    Canonical form: ``DIGEST_VERSION``, canonical JSON of the math config fields (sorted keys;
    rank/alpha patterns in file order), then per tensor name in sorted order a JSON header line
    ``{name, dtype, shape, nbytes}`` and the raw little-endian bytes. Independent of file format
    (.bin/.safetensors) and tensor order. ``legacy``: digest v1 (pattern keys sorted).
    """
    h = hashlib.sha256(LEGACY_DIGEST_VERSION if legacy else DIGEST_VERSION)
    h.update(config_digest_line(config, legacy=legacy))
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy()  # zero-copy byte view
        h.update(tensor_header_line(name, str(t.dtype), list(t.shape), int(raw.size)))
        h.update(raw)
    return h.hexdigest()


def load_peft_adapter(
    path: str | Path,
    spec: BaseModelSpec,
    *,
    name: str | None = None,
    revision: str | None = None,
    max_lora_rank: int = 64,
    dtype: torch.dtype = torch.float32,
) -> LoRAAdapter:
    """Read, validate and convert a PEFT LoRA adapter directory for the base model ``spec``.

    ``name`` defaults to the directory name, ``revision`` to the first 12 hex digits of the
    digest. Every problem raises :class:`AdapterError` naming ``path`` and the field/tensor.
    """
    r = read_adapter(path)
    return build_adapter(
        r.config,
        r.tensors,
        spec,
        path=path,
        name=name,
        revision=revision,
        max_lora_rank=max_lora_rank,
        dtype=dtype,
        digest=r.digest,
    )


def _finite_in_one_pass(ts: list[torch.Tensor]) -> bool:
    """True when the sum over the span of the buffer that ``ts`` cover is finite, so each of
    them is finite (a NaN or an inf anywhere makes the sum NaN or inf): for contiguous views of
    one owned buffer in one float dtype (what :func:`read_adapter` builds), one reduction
    instead of an ``isfinite`` (several passes) per tensor. False when they are not such views,
    or the sum is not finite (a non-finite value, or only an overflow; the span may include
    bytes between tensors): the caller then checks each tensor, and names the culprit."""
    if not ts:
        return True
    first = ts[0]
    if not first.is_floating_point():
        return False
    ptr, dtype = first.untyped_storage().data_ptr(), first.dtype
    lo = hi = first.storage_offset()
    for t in ts:
        if t.dtype != dtype or not t.is_contiguous() or t.untyped_storage().data_ptr() != ptr:
            return False
        off = t.storage_offset()
        lo, hi = min(lo, off), max(hi, off + t.numel())
    span = first.as_strided((hi - lo,), (1,), lo)  # [elements from the first tensor to the last]
    return bool(torch.isfinite(span.sum()))


def _expert_weights(
    m: ExpertModuleLayout,
    tensors: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    converted: dict[str, torch.Tensor],
) -> LoRAModuleWeights:
    """Every expert's factors of one expert projection as ``a [E, r, d_in]``, ``b [E, d_out,
    r]`` in ``dtype`` (new tensors: never views of the read buffer), each expert's scale folded
    into its ``b`` in float32 (one rounding, as a slot write's) and zeros past its rank.

    PEFT's ``target_parameters`` layout (``A [E r, d_in]`` expert-major, ``B [d_out, r E]``
    rank-major, as its ``ParamWrapper.get_delta_weight`` reads them) is
    ``a = A.view(E, r, d_in)`` and ``b[e] = B.view(d_out, r, E)[:, :, e]``; a fused parameter's
    parts (``gate_up_proj``) share ``a`` and take their rows of ``b`` (every other row where the
    base interleaves them). A parameter stored ``[E, d_in, d_out]`` (``m.in_out``, Llama 4)
    swaps the roles: ``a[e] = B.view(d_in, r, E)[:, :, e].T`` and ``b[e] = A.view(E, r,
    d_out)[e].T``."""
    E, R = m.num_experts, m.rank
    if m.packed is not None and m.in_out:
        f = m.packed
        A, B = tensors[f.a_name], tensors[f.b_name]  # [E r, d_out (all parts)], [d_in, r E]
        a = converted.get(f"{f.b_name}#experts")
        if a is None:
            a = B.to(dtype).reshape(B.shape[0], R, E).permute(2, 1, 0)
            a = a.clone(memory_format=torch.contiguous_format)
            converted[f"{f.b_name}#experts"] = a  # [E, r, d_in]
        b = A.float().reshape(E, R, -1).transpose(1, 2)  # [E, d_out (all), r]
        if m.b_rows is not None:
            lo, hi, step = m.b_rows
            b = b[:, lo:hi:step]
        return LoRAModuleWeights(a=a, b=(b * f.scale).to(dtype).contiguous(), scale=1.0)
    if m.packed is not None:
        f = m.packed
        A, B = tensors[f.a_name], tensors[f.b_name]  # [E r, d_in], [d_out (all parts), r E]
        a = converted.get(f"{f.a_name}#experts")
        if a is None:
            a = converted[f"{f.a_name}#experts"] = A.to(dtype).reshape(E, R, -1).clone()
        b = B.float().reshape(B.shape[0], R, E).permute(2, 0, 1)  # [E, d_out (all), r]
        if m.b_rows is not None:
            lo, hi, step = m.b_rows
            b = b[:, lo:hi:step]
        return LoRAModuleWeights(a=a, b=(b * f.scale).to(dtype).contiguous(), scale=1.0)
    factors = m.per_expert or ()
    first = next(f for f in factors if f is not None)
    d_in = tensors[first.a_name].shape[1]
    d_out = tensors[first.b_name].shape[0]
    a = torch.zeros(E, R, d_in, dtype=dtype)
    b = torch.zeros(E, d_out, R, dtype=dtype)
    for e, f in enumerate(factors):
        if f is not None:
            a[e, : f.rank] = tensors[f.a_name].to(dtype)
            b[e, :, : f.rank] = (tensors[f.b_name].float() * f.scale).to(dtype)
    return LoRAModuleWeights(a=a, b=b, scale=1.0)


def build_adapter(
    config: dict,
    tensors: dict[str, torch.Tensor],
    spec: BaseModelSpec,
    *,
    path: str | Path,
    name: str | None = None,
    revision: str | None = None,
    max_lora_rank: int = 64,
    dtype: torch.dtype = torch.float32,
    digest: str | None = None,
) -> LoRAAdapter:
    """Validate and convert an adapter already read as ``(config, tensors)`` (e.g. a verified
    copy from the disk tier or an object store); :func:`load_peft_adapter` is read + this.

    ``path`` names the source in errors; ``digest`` skips re-hashing when the caller has just
    computed it from the same ``(config, tensors)``.
    """
    if digest is None:
        digest = compute_adapter_digest(config, tensors)
    try:
        settings = parse_lora_config(config)
        metas = {
            n: TensorMeta(tuple(t.shape), str(t.dtype), t.is_floating_point())
            for n, t in tensors.items()
        }
        layout = check_layout(settings, metas, spec, max_rank=max_lora_rank)
    except FormatError as e:
        raise _fail(path, str(e)) from e
    names = list(dict.fromkeys(n for m in layout.values() for n in m.tensor_names))
    used = [tensors[n] for n in names]
    if not _finite_in_one_pass(used):  # name the first non-finite tensor, if any
        for tname in names:
            if not bool(torch.isfinite(tensors[tname]).all()):
                raise _fail(path, f"tensor {tname!r}: contains non-finite values (NaN/inf)")
    # Tensors left out (PEFT's copies of the base's embedding matrices) may be most of the
    # bytes read: own copies of the served ones then, so the read buffer can go.
    own = len(tensors) > len(names)
    converted: dict[str, torch.Tensor] = {}  # a fused module's parts share one A

    def served(tname: str) -> torch.Tensor:
        if tname not in converted:  # convert last: all checks ran on the stored values
            t = tensors[tname].to(dtype).contiguous()
            converted[tname] = t.clone() if own else t
        return converted[tname]

    weights: dict[tuple[int, str], LoRAModuleWeights] = {}
    for key, m in layout.items():
        if isinstance(m, ExpertModuleLayout):
            weights[key] = _expert_weights(m, tensors, dtype, converted)
            continue
        a, b = served(m.a_name), served(m.b_name)  # [r, d_in], [d_out (fused: all parts), r]
        if m.b_rows is not None:  # a fused module's part: its rows of B (a contiguous view)
            b = b[m.b_rows[0] : m.b_rows[1]]
        weights[key] = LoRAModuleWeights(a=a, b=b, scale=m.scale)
    adapter_name = name if name is not None else Path(os.path.abspath(path)).name
    ref = AdapterRef(adapter_name, revision if revision is not None else digest[:12], digest)
    return LoRAAdapter(ref=ref, path=str(path), weights=weights, config=dict(config))
