"""Pushed adapters: an adapter handed over as bytes or tensors (by a training loop, over HTTP or
in-process) instead of a directory, read exactly as a directory with the same two files.

The wire form is PEFT's: ``adapter_config.json`` (JSON, at most :data:`MAX_CONFIG_BYTES`) and
``adapter_model.safetensors`` (PEFT's key names and layout). :func:`encode_tensors` turns an
in-process state dict into that form, so both paths give one digest for one adapter, and
:func:`read_pushed` (in :mod:`loraplex.lora.adapter`) parses and hashes it. Raw ``A``, ``B``
and ``lora_alpha`` are kept as received; the scale ``alpha / r`` lives beside them
(:class:`~loraplex.lora.adapter.LoRAModuleWeights`) and is applied once, in the LoRA ops, so
evicting and reloading a copy can never scale it twice.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

from loraplex.checkpoint.safetensors import SAFETENSORS_DTYPES
from loraplex.types import AdapterError

MAX_CONFIG_BYTES = 64 << 10
"""The largest ``adapter_config.json`` a push may carry."""

__all__ = ["MAX_CONFIG_BYTES", "encode_config", "encode_tensors"]


def encode_config(config: Mapping[str, Any], *, name: str) -> bytes:
    """``config`` as ``adapter_config.json`` bytes (UTF-8 JSON); :class:`AdapterError` when
    it is not a JSON object of at most :data:`MAX_CONFIG_BYTES`."""
    if not isinstance(config, Mapping):
        raise AdapterError(f"adapter {name!r}: the PEFT config must be a dict")
    try:
        raw = json.dumps(dict(config), sort_keys=True).encode()
    except (TypeError, ValueError) as e:
        raise AdapterError(f"adapter {name!r}: the PEFT config is not JSON ({e})") from e
    if len(raw) > MAX_CONFIG_BYTES:
        raise AdapterError(
            f"adapter {name!r}: the PEFT config is {len(raw)} bytes, more than {MAX_CONFIG_BYTES}"
        )
    return raw


def encode_tensors(tensors: Mapping[str, torch.Tensor], *, name: str) -> bytearray:
    """A state dict (PEFT's key names) as ``adapter_model.safetensors`` bytes, written straight
    into one buffer the engine owns (one copy of each tensor; the caller may change its tensors
    afterwards: a training step does). Layout: 8-byte little-endian header length, the JSON
    header (padded with spaces to 8 bytes), then each tensor's bytes in header order."""
    if not isinstance(tensors, Mapping) or not tensors:
        raise AdapterError(f"adapter {name!r}: the tensors must be a non-empty dict")
    header: dict[str, Any] = {}
    flat: list[torch.Tensor] = []  # [numel * itemsize] uint8 views, in header order
    offset = 0
    for k, t in tensors.items():
        if not isinstance(k, str) or not isinstance(t, torch.Tensor):
            raise AdapterError(f"adapter {name!r}: entry {k!r} is not a named tensor")
        code = _CODES.get(str(t.dtype))
        if code is None:
            raise AdapterError(f"adapter {name!r}: tensor {k!r} has dtype {t.dtype}, not storable")
        t = t.detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        header[k] = {
            "dtype": code,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        flat.append(
            t.reshape(-1).view(torch.uint8) if nbytes else t.new_empty(0, dtype=torch.uint8)
        )
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    buf = bytearray(8 + len(head) + offset)
    buf[:8] = len(head).to_bytes(8, "little")
    buf[8 : 8 + len(head)] = head
    out = torch.frombuffer(buf, dtype=torch.uint8)  # [file bytes], shares buf
    pos = 8 + len(head)
    for t in flat:
        out[pos : pos + t.numel()].copy_(t)
        pos += t.numel()
    return buf


_CODES = {torch_name: code for code, (torch_name, _) in SAFETENSORS_DTYPES.items()}
