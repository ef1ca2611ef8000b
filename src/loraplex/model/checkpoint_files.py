"""The files of an HF safetensors checkpoint, and reading a tensor out of them without
holding two copies of the weights (what is done with the tensors: ``model/loading.py``).

The header is parsed by :func:`loraplex.checkpoint.safetensors.safetensors_header` (loraplex's
one safetensors parser) and each tensor is ``readinto`` straight into its final buffer (no
mmap, so file pages never count twice in resident memory); a tensor whose dtype changes costs
one temporary of its own size only.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from loraplex.checkpoint.safetensors import SafetensorsError, TensorInfo, safetensors_header
from loraplex.types import ModelLoadError

log = logging.getLogger(__name__)


def _size_gb(path: Path) -> float:
    try:
        return path.stat().st_size / 1e9
    except OSError:
        return 0.0


# The dtypes a base checkpoint may hold (str(torch dtype) as the header parser names them).
_DTYPES: dict[str, torch.dtype] = {
    str(d): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.float8_e4m3fn,  # FP8 checkpoints' weights
    )
}


class SafetensorsFile:
    """Header of one ``.safetensors`` file; tensors are read on demand with plain file reads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            header = safetensors_header(path)
        except SafetensorsError as e:  # the message names the file and what is wrong
            raise ModelLoadError(f"corrupt safetensors file: {e}") from e
        for name, info in header.items():
            if info.dtype not in _DTYPES:
                raise ModelLoadError(f"{path}: tensor {name!r} has unsupported dtype {info.dtype}")
        self.entries: dict[str, TensorInfo] = header

    def read(
        self, name: str, dtype: torch.dtype | None = None, device: torch.device | None = None
    ) -> torch.Tensor:
        """Read one tensor, converting to ``dtype`` and moving to ``device``."""
        info = self.entries[name]
        buf = torch.empty(info.shape, dtype=_DTYPES[info.dtype])
        if info.nbytes:
            view = buf.reshape(-1).view(torch.uint8).numpy()  # a 0-dim scale too
            with self.path.open("rb") as f:
                f.seek(info.start)
                got = f.readinto(memoryview(view))
            if got != info.nbytes:
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
    files = checkpoint_files(model_dir)
    for i, path in enumerate(files, 1):  # progress while loading: one line per shard
        log.info("loading weights %d/%d: %s (%.2f GB)", i, len(files), path.name, _size_gb(path))
        st = SafetensorsFile(path)
        for name in st.entries:
            yield name, st
