"""loraplex's one safetensors header reader, without torch.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON
(tensor name -> ``{"dtype", "shape", "data_offsets": [start, end]}``, plus an optional
``__metadata__``), then the tensors' bytes, offsets counted from the end of the header.
:func:`read_safetensors_header` (an open file) and :func:`parse_safetensors_header` (bytes in
memory) check everything the offsets promise (dtype known, ``end - start == prod(shape) *
itemsize``, inside the file), so a truncated or forged file is a :class:`SafetensorsError`,
never a wrong tensor or a wrong digest. The base-model loader (``model/``), the adapter reader
and digest (``lora/``), the registry and the planning tools all read headers through it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

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
"""safetensors dtype name -> (``str(torch.dtype)``, bytes per element)."""
FLOAT_DTYPES = frozenset(
    {"torch.float64", "torch.float32", "torch.float16", "torch.bfloat16"}
    | {"torch.float8_e4m3fn", "torch.float8_e5m2"}
)
"""The floating-point dtypes of :data:`SAFETENSORS_DTYPES` (as ``str(torch.dtype)``)."""

MAX_HEADER_BYTES = 100 * 1024 * 1024
"""The longest header read (safetensors' own limit)."""


class SafetensorsError(ValueError):
    """A file is not a well-formed safetensors file (too short, header not JSON, an entry
    malformed, an unknown dtype, offsets that do not fit); the message names the file."""


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


def _header_length(raw_len: bytes, size: int, path: str | Path) -> int:
    if len(raw_len) != 8:
        raise SafetensorsError(f"{path}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", raw_len)
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise SafetensorsError(
            f"{path}: corrupt safetensors header length {n} (file has {size} bytes)"
        )
    return int(n)


def _header_tensors(raw: bytes, base: int, size: int, path: str | Path) -> dict[str, TensorInfo]:
    """The tensor table of a safetensors header whose JSON is ``raw``, its data starting at
    ``base`` in a file of ``size`` bytes; every entry checked to fit (see the callers)."""
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path}: safetensors header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: safetensors header is not a JSON object")
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            st_dtype, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (TypeError, KeyError, ValueError) as e:
            raise SafetensorsError(f"{path}: tensor {name!r}: malformed header entry") from e
        if st_dtype not in SAFETENSORS_DTYPES:
            raise SafetensorsError(f"{path}: tensor {name!r}: unsupported dtype {st_dtype!r}")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise SafetensorsError(f"{path}: tensor {name!r}: bad shape {shape!r}")
        torch_dtype, itemsize = SAFETENSORS_DTYPES[st_dtype]
        numel = 1
        for d in shape:
            numel *= d
        if not (isinstance(start, int) and isinstance(end, int)) or not (
            0 <= start <= end and end - start == numel * itemsize and base + end <= size
        ):
            raise SafetensorsError(
                f"{path}: tensor {name!r}: data offsets {[start, end]} do not fit shape "
                f"{shape} {st_dtype} inside the file (truncated or corrupt?)"
            )
        out[name] = TensorInfo(name, torch_dtype, tuple(shape), base + start, base + end)
    return out


def read_safetensors_header(f: BinaryIO, path: str | Path = "") -> dict[str, TensorInfo]:
    """Parse the header of an open safetensors file: tensor name -> :class:`TensorInfo`.

    Checks what the data offsets promise (dtype known, size = prod(shape) * itemsize, inside
    the file) so a truncated or forged file is an error, not a wrong digest.
    """
    f.seek(0, 2)
    size = f.tell()
    f.seek(0)
    n = _header_length(f.read(8), size, path)
    return _header_tensors(f.read(n), 8 + n, size, path)


def parse_safetensors_header(
    data: bytes | bytearray | memoryview, path: str | Path = ""
) -> dict[str, TensorInfo]:
    """:func:`read_safetensors_header` of a safetensors file held in memory (offsets index
    ``data``), with the same checks."""
    size = len(data)
    n = _header_length(bytes(data[:8]), size, path)
    return _header_tensors(bytes(data[8 : 8 + n]), 8 + n, size, path)


def safetensors_header(path: str | Path) -> dict[str, TensorInfo]:
    """:func:`read_safetensors_header` of the file at ``path`` (``OSError`` if unreadable)."""
    with open(path, "rb") as f:
        return read_safetensors_header(f, path)
