"""The adapter digest (the ``sha256`` of :class:`~loraplex.types.AdapterRef`) without torch.

:func:`loraplex.lora.adapter.compute_adapter_digest` hashes ``(config, tensors)`` once they are
loaded; :func:`digest_safetensors_dir` computes the same value straight from
``adapter_config.json`` + ``adapter_model.safetensors`` by parsing the safetensors header
(8-byte little-endian length, then JSON) and streaming each tensor's bytes, so the registry and
other torch-free tools name adapters exactly as the engine does::

    h = sha256(DIGEST_VERSION)
    h.update(canonical_json(_math_config(config)) + "\\n")
    for name in sorted(tensors):
        h.update(canonical_json({name, dtype: "torch.<dtype>", shape, nbytes}) + "\\n")
        h.update(raw little-endian bytes of the tensor)

:func:`read_safetensors_header` is loraplex's one safetensors header parser: the model loader,
the registry and the planning tools read every safetensors file through it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from loraplex.lora.peft_format import CONFIG_NAME, SAFETENSORS_NAME

DIGEST_VERSION = b"loraplex-adapter-digest-v1\n"

# Config fields that change what the adapter computes, with PEFT's defaults (a missing field and
# its default digest the same). Unsupported variants are listed too, so that if one is ever
# supported its adapters can never share a digest with plain LoRA.
_DIGEST_FIELDS: dict[str, Any] = {
    "peft_type": None,
    "r": 8,
    "lora_alpha": 8,
    "use_rslora": False,
    "target_modules": None,
    "exclude_modules": None,
    "layers_to_transform": None,
    "layers_pattern": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "use_dora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "lora_bias": False,
    "modules_to_save": None,
    "layer_replication": None,
    "use_qalora": False,
    "target_parameters": None,
    "trainable_token_indices": None,
    "init_lora_weights": True,
    "alora_invocation_tokens": None,
    "use_bdlora": None,
    "arrow_config": None,
    "kasa_config": None,
    "monteclora_config": None,
}

# safetensors dtype name -> (str(torch.dtype), bytes per element)
SAFETENSORS_DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("torch.float64", 8),
    "F32": ("torch.float32", 4),
    "F16": ("torch.float16", 2),
    "BF16": ("torch.bfloat16", 2),
    "F8_E4M3": ("torch.float8_e4m3fn", 1),
    "F8_E5M2": ("torch.float8_e5m2", 1),
    "I64": ("torch.int64", 8),
    "I32": ("torch.int32", 4),
    "I16": ("torch.int16", 2),
    "I8": ("torch.int8", 1),
    "U64": ("torch.uint64", 8),
    "U32": ("torch.uint32", 4),
    "U16": ("torch.uint16", 2),
    "U8": ("torch.uint8", 1),
    "BOOL": ("torch.bool", 1),
}
FLOAT_DTYPES = frozenset(
    {"torch.float64", "torch.float32", "torch.float16", "torch.bfloat16"}
    | {"torch.float8_e4m3fn", "torch.float8_e5m2"}
)

_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
_CHUNK = 1 << 20


class DigestError(ValueError):
    """The adapter files cannot be read or parsed (missing, not JSON, corrupt header, ...)."""


def read_json_object(path: Path, what: str) -> tuple[bytes, dict[str, Any]]:
    """The bytes of a JSON file holding one object, and the object; :class:`DigestError`
    starting with ``what`` when it is not valid JSON or not an object."""
    raw = path.read_bytes()
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DigestError(f"{what} is not valid JSON ({e})") from e
    if not isinstance(obj, dict):
        raise DigestError(f"{what} must hold a JSON object")
    return raw, obj


def _as_float(v: Any) -> Any:
    """16 and 16.0 are the same alpha: numbers become floats, anything else is left alone."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v


def _math_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The digest-relevant subset of ``config``, normalised so equal math gives equal JSON.

    Missing/None/empty values take PEFT's default, alphas are floats, name lists are sorted
    sets and an int ``layers_to_transform`` is the one-element list it means.
    """
    out: dict[str, Any] = {}
    for key, default in _DIGEST_FIELDS.items():
        value = config.get(key)
        if value is None or (isinstance(value, (list, dict)) and not value):
            value = default
        out[key] = value
    out["lora_alpha"] = _as_float(out["lora_alpha"])
    if isinstance(out["alpha_pattern"], dict):
        out["alpha_pattern"] = {k: _as_float(v) for k, v in out["alpha_pattern"].items()}
    for key in ("target_modules", "exclude_modules", "modules_to_save"):
        if isinstance(out[key], list) and all(isinstance(x, str) for x in out[key]):
            out[key] = sorted(set(out[key]))
    layers = out["layers_to_transform"]
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if isinstance(layers, list) and all(isinstance(i, int) for i in layers):
        out["layers_to_transform"] = sorted(set(layers))
    return out


def config_digest_line(config: Mapping[str, Any]) -> bytes:
    """The config part of the digest: canonical JSON of the math config and a newline."""
    return json.dumps(_math_config(config), sort_keys=True, separators=(",", ":")).encode() + b"\n"


def tensor_header_line(name: str, torch_dtype: str, shape: list[int], nbytes: int) -> bytes:
    """The per-tensor header line hashed before the tensor's bytes."""
    header = {"name": name, "dtype": torch_dtype, "shape": shape, "nbytes": nbytes}
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode() + b"\n"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file, from its header (no data read)."""

    name: str
    dtype: str  # str(torch dtype), e.g. "torch.float32"
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_safetensors_header(f: BinaryIO, path: str | Path = "") -> dict[str, TensorInfo]:
    """Parse the header of an open safetensors file: tensor name -> :class:`TensorInfo`.

    Checks what the data offsets promise (dtype known, size = prod(shape) * itemsize, inside
    the file) so a truncated or forged file is an error, not a wrong digest.
    """
    f.seek(0, 2)
    size = f.tell()
    f.seek(0)
    raw_len = f.read(8)
    if len(raw_len) != 8:
        raise DigestError(f"{path}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", raw_len)
    if n > _MAX_HEADER_BYTES or 8 + n > size:
        raise DigestError(f"{path}: corrupt safetensors header length {n} (file has {size} bytes)")
    try:
        header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DigestError(f"{path}: safetensors header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise DigestError(f"{path}: safetensors header is not a JSON object")
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            st_dtype, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (TypeError, KeyError, ValueError) as e:
            raise DigestError(f"{path}: tensor {name!r}: malformed header entry") from e
        if st_dtype not in SAFETENSORS_DTYPES:
            raise DigestError(f"{path}: tensor {name!r}: unsupported dtype {st_dtype!r}")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise DigestError(f"{path}: tensor {name!r}: bad shape {shape!r}")
        torch_dtype, itemsize = SAFETENSORS_DTYPES[st_dtype]
        numel = 1
        for d in shape:
            numel *= d
        if not (isinstance(start, int) and isinstance(end, int)) or not (
            0 <= start <= end and end - start == numel * itemsize and base + end <= size
        ):
            raise DigestError(
                f"{path}: tensor {name!r}: data offsets {[start, end]} do not fit shape "
                f"{shape} {st_dtype} inside the file (truncated or corrupt?)"
            )
        out[name] = TensorInfo(name, torch_dtype, tuple(shape), base + start, base + end)
    return out


def safetensors_header(path: str | Path) -> dict[str, TensorInfo]:
    """:func:`read_safetensors_header` of the file at ``path`` (``OSError`` if unreadable)."""
    with open(path, "rb") as f:
        return read_safetensors_header(f, path)


@dataclass(frozen=True)
class AdapterFiles:
    """What one read of an adapter directory yields: the digest, plain file hashes, the config
    and the tensor table (for torch-free validation)."""

    digest: str  # == compute_adapter_digest(config, tensors)
    weights_sha256: str  # sha256 of adapter_model.safetensors as a file
    config_sha256: str  # sha256 of adapter_config.json as a file
    config: dict[str, Any]
    tensors: dict[str, TensorInfo]
    nbytes: int  # bytes of all tensors


def read_adapter_dir(path: str | Path) -> AdapterFiles:
    """Hash an adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``)
    (the adapter digest and both file hashes; the weights file is read twice: tensors in
    name order, then the whole file)."""
    root = Path(path)
    cfg_path, st_path = root / CONFIG_NAME, root / SAFETENSORS_NAME
    if not root.is_dir():
        raise DigestError(f"{path}: directory not found")
    if not cfg_path.is_file():
        raise DigestError(f"{path}: missing {CONFIG_NAME}")
    if not st_path.is_file():
        raise DigestError(f"{path}: missing {SAFETENSORS_NAME} (only safetensors is supported)")
    cfg_bytes, config = read_json_object(cfg_path, f"{path}: {CONFIG_NAME}")

    h = hashlib.sha256(DIGEST_VERSION)
    h.update(config_digest_line(config))
    with st_path.open("rb") as f:
        tensors = read_safetensors_header(f, st_path)
        for name in sorted(tensors):
            t = tensors[name]
            h.update(tensor_header_line(name, t.dtype, list(t.shape), t.nbytes))
            f.seek(t.start)
            left = t.nbytes
            while left:
                chunk = f.read(min(_CHUNK, left))
                if not chunk:
                    raise DigestError(f"{st_path}: truncated inside tensor {name!r}")
                h.update(chunk)
                left -= len(chunk)
        f.seek(0)
        file_hash = hashlib.sha256()
        while chunk := f.read(_CHUNK):
            file_hash.update(chunk)
    return AdapterFiles(
        digest=h.hexdigest(),
        weights_sha256=file_hash.hexdigest(),
        config_sha256=hashlib.sha256(cfg_bytes).hexdigest(),
        config=config,
        tensors=tensors,
        nbytes=sum(t.nbytes for t in tensors.values()),
    )


def digest_safetensors_dir(path: str | Path) -> str:
    """``compute_adapter_digest(config, tensors)`` of an adapter directory, without torch."""
    return read_adapter_dir(path).digest
