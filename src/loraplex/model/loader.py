"""Read HF safetensors checkpoints without holding two copies of the weights.

We parse the safetensors header ourselves and ``readinto`` each tensor straight into its final
buffer (no mmap, so file pages never count twice in resident memory); a tensor whose dtype
changes costs one temporary of its own size only.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from loraplex.types import ModelLoadError

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class SafetensorsFile:
    """Header of one ``.safetensors`` file; tensors are read on demand with plain file reads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ModelLoadError(f"{path}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ModelLoadError(f"{path}: corrupt safetensors header (length {n} > file size)")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ModelLoadError(f"{path}: corrupt safetensors header ({e})") from e
        self.data_start = 8 + n
        if not isinstance(header, dict):
            raise ModelLoadError(f"{path}: corrupt safetensors header (not a JSON object)")
        header.pop("__metadata__", None)
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, meta in header.items():
            if not isinstance(meta, dict):
                raise ModelLoadError(f"{path}: corrupt safetensors header entry for {name!r}")
            dtype = _DTYPES.get(meta.get("dtype", ""))
            if dtype is None:
                raise ModelLoadError(
                    f"{path}: tensor {name!r} has unsupported dtype {meta.get('dtype')}"
                )
            try:
                begin, end = (int(o) for o in meta["data_offsets"])
                shape = tuple(int(s) for s in meta["shape"])
            except (KeyError, TypeError, ValueError) as e:
                raise ModelLoadError(
                    f"{path}: tensor {name!r} has a malformed header entry ({e!r})"
                ) from e
            if begin < 0 or any(s < 0 for s in shape):
                raise ModelLoadError(
                    f"{path}: tensor {name!r} has negative offsets or shape ({begin}, {shape})"
                )
            nbytes = (
                int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
            )
            if end - begin != nbytes or self.data_start + end > size:
                raise ModelLoadError(
                    f"{path}: tensor {name!r} data is truncated or malformed "
                    f"(offsets {begin}..{end}, file size {size})"
                )
            self.entries[name] = (dtype, shape, begin, end)

    def read(
        self, name: str, dtype: torch.dtype | None = None, device: torch.device | None = None
    ) -> torch.Tensor:
        """Read one tensor, converting to ``dtype`` and moving to ``device``."""
        src_dtype, shape, begin, end = self.entries[name]
        buf = torch.empty(shape, dtype=src_dtype)
        if end > begin:
            view = buf.view(torch.uint8).numpy().reshape(-1)
            with self.path.open("rb") as f:
                f.seek(self.data_start + begin)
                got = f.readinto(memoryview(view))
            if got != end - begin:
                raise ModelLoadError(f"{self.path}: short read for tensor {name!r}")
        if dtype is not None and buf.dtype != dtype:
            buf = buf.to(dtype)
        if device is not None and buf.device != device:
            buf = buf.to(device)
        return buf


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint (single file, or shards listed by the index)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: invalid shard index ({e})") from e
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(
                f"{model_dir}: shard(s) listed in the index are missing: {missing}"
            )
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{model_dir}: no *.safetensors weights found (only safetensors checkpoints are supported)"
        )
    return files


def iter_checkpoint(model_dir: Path) -> Iterator[tuple[str, SafetensorsFile]]:
    """Yield (tensor name, file holding it) over every tensor of the checkpoint."""
    for path in checkpoint_files(model_dir):
        st = SafetensorsFile(path)
        for name in st.entries:
            yield name, st
