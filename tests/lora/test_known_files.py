"""Re-reads of an adapter directory this process verified (``KnownFiles`` +
``read_known_adapter``): the same tensors come back from one owned buffer, and a change to any
byte of either file is a miss (the caller then verifies fully)."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from loraplex.lora.adapter import KnownFiles, _layout, read_adapter, read_known_adapter
from loraplex.workers import IdleWorker
from tests.s3fixture import LAYERS, write_adapter

ST = "adapter_model.safetensors"
CFG = "adapter_config.json"
CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}

# (name, safetensors dtype, torch dtype, shape, data offset): three evenly spaced layer blocks,
# then a block one byte off (unaligned float32/float16: copied, and it breaks the step), one more
# aligned block at another step, an empty tensor and a scalar; the header lists them shuffled.
_BLOCK = [("w", "F32", torch.float32, (2, 3), 0), ("h", "F16", torch.float16, (3,), 24)]
_BLOCK += [("b", "U8", torch.uint8, (2,), 30)]
_ENTRIES = [
    (f"m.layers.{i}.{n}", sd, td, shape, base + off)
    for i, base in ((0, 0), (1, 32), (2, 64), (3, 97), (4, 132))
    for n, sd, td, shape, off in _BLOCK
] + [("m.empty", "F32", torch.float32, (0, 4), 168), ("m.scalar", "F64", torch.float64, (), 168)]
_DATA_BYTES = 176


def write_crafted(root: Path) -> tuple[dict[str, torch.Tensor], int]:
    """A safetensors file laid out as ``_ENTRIES`` (random bytes); its tensors decoded here,
    independently of the reader, and the offset where its data starts."""
    root.mkdir(parents=True, exist_ok=True)
    order = random.Random(0).sample(_ENTRIES, len(_ENTRIES))
    header = {
        name: {"dtype": sd, "shape": list(shape), "data_offsets": [off, off + _nbytes(td, shape)]}
        for name, sd, td, shape, off in order
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # data starts 8-aligned: odd offsets stay odd
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (_DATA_BYTES,), generator=gen, dtype=torch.uint8).numpy()
    data = data.tobytes()
    (root / ST).write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    (root / CFG).write_text(json.dumps(CONFIG))
    want = {}
    for name, _, td, shape, off in order:
        chunk = bytearray(data[off : off + _nbytes(td, shape)])
        want[name] = (
            torch.frombuffer(chunk, dtype=td).reshape(shape)
            if chunk
            else torch.empty(shape, dtype=td)
        )
    return want, 8 + len(raw)


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)  # the header's order
    for name, t in want.items():
        g = got[name]
        assert g.dtype == t.dtype and g.shape == t.shape and g.is_contiguous(), name
        as_bytes = g.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)
        assert torch.equal(*as_bytes), name  # bit for bit (random bytes include NaNs)


def helpers() -> list[IdleWorker | None]:
    return [None, IdleWorker("test-read-helper")]


@pytest.mark.parametrize("helper", helpers(), ids=["alone", "helper"])
@pytest.mark.parametrize("segment", [1, 5, 64, 1 << 20])
def test_crafted_layout_reads_back_exactly(
    tmp_path: Path, segment: int, helper: IdleWorker | None
) -> None:
    want, _ = write_crafted(tmp_path / "a")
    first = read_adapter(tmp_path / "a")  # the full verification's tensors
    assert_same(first.tensors, want)
    assert first.files is not None
    known = KnownFiles.of(first.files, segment=segment)
    again = read_known_adapter(tmp_path / "a", known, helper=helper)
    assert again is not None
    config, tensors = again
    assert config == CONFIG
    assert_same(tensors, want)
    # aligned tensors are views of one new buffer; unaligned ones (layer 3) are copies
    views = [n for n in want if "layers.3" not in n and n != "m.empty"]
    shared = {tensors[n].untyped_storage().data_ptr() for n in views}
    assert len(shared) == 1 and shared.isdisjoint(
        t.untyped_storage().data_ptr() for t in first.tensors.values()
    )
    for n in ("m.layers.3.w", "m.layers.3.h"):
        assert tensors[n].untyped_storage().data_ptr() not in shared


def test_layer_blocks_become_runs(tmp_path: Path) -> None:
    """One projection's factor across layers is one run (one as_strided + unbind)."""
    write_crafted(tmp_path / "a")
    runs = _layout(read_adapter(tmp_path / "a").files.tensors).runs  # type: ignore[union-attr]
    by_first = {r.names[0]: r.names for r in runs}
    assert by_first["m.layers.0.w"] == ("m.layers.0.w", "m.layers.1.w", "m.layers.2.w")
    assert by_first["m.layers.3.w"] == ("m.layers.3.w",)  # unaligned: alone
    assert by_first["m.layers.4.w"] == ("m.layers.4.w",)  # after the unaligned one
    assert sorted(n for r in runs for n in r.names) == sorted(e[0] for e in _ENTRIES)
    src, _ = write_adapter(tmp_path / "peft", r=4)
    peft = _layout(read_adapter(src).files.tensors)  # type: ignore[union-attr]
    assert len(peft.names) == 4 * LAYERS and len(peft.runs) == 4  # q/v x A/B


@pytest.mark.parametrize("helper", helpers(), ids=["alone", "helper"])
def test_a_real_adapter_reads_back_exactly(tmp_path: Path, helper: IdleWorker | None) -> None:
    src, digest = write_adapter(tmp_path / "a", r=8)
    first = read_adapter(src)
    assert first.digest == digest and first.files is not None
    again = read_known_adapter(src, KnownFiles.of(first.files, segment=1000), helper=helper)
    assert again is not None
    assert_same(again[1], load_file(str(src / ST)))


@pytest.mark.parametrize("where", ["length", "header", "first_data", "boundary", "middle", "last"])
@pytest.mark.parametrize("segment", [64, 1 << 20])
def test_any_changed_weights_byte_is_a_miss(tmp_path: Path, where: str, segment: int) -> None:
    _, data_start = write_crafted(tmp_path / "a")
    first = read_adapter(tmp_path / "a")
    assert first.files is not None
    known = KnownFiles.of(first.files, segment=segment)
    helper = IdleWorker("test-read-helper")
    path = tmp_path / "a" / ST
    raw = bytearray(path.read_bytes())
    at = {
        "length": 0,
        "header": 12,
        "first_data": data_start,
        "boundary": (data_start // 64 + 1) * 64,  # first byte of a 64-byte segment, in the data
        "middle": data_start + _DATA_BYTES // 2,
        "last": len(raw) - 1,
    }[where]
    raw[at] ^= 0x40
    path.write_bytes(bytes(raw))
    assert read_known_adapter(tmp_path / "a", known, helper=helper) is None
    raw[at] ^= 0x40
    path.write_bytes(bytes(raw))  # restored: a hit again
    assert read_known_adapter(tmp_path / "a", known, helper=helper) is not None


@pytest.mark.parametrize("change", ["config_byte", "truncated", "extended", "missing"])
def test_changed_or_missing_files_are_a_miss(tmp_path: Path, change: str) -> None:
    write_crafted(tmp_path / "a")
    first = read_adapter(tmp_path / "a")
    assert first.files is not None
    known = KnownFiles.of(first.files, segment=16)
    root = tmp_path / "a"
    if change == "config_byte":  # same math, one byte more: still not the verified bytes
        (root / CFG).write_text(json.dumps(CONFIG) + " ")
    elif change == "truncated":
        (root / ST).write_bytes((root / ST).read_bytes()[:-1])
    elif change == "extended":
        (root / ST).write_bytes((root / ST).read_bytes() + b"\0")
    else:
        (root / ST).unlink()
    assert read_known_adapter(root, known) is None
    assert read_known_adapter(root, known, helper=IdleWorker("test-read-helper")) is None
