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
from safetensors.torch import save as save_safetensors

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
    """A state dict (PEFT's key names) as ``adapter_model.safetensors`` bytes in a buffer the
    engine owns (the caller may change its tensors afterwards: a training step does)."""
    if not isinstance(tensors, Mapping) or not tensors:
        raise AdapterError(f"adapter {name!r}: the tensors must be a non-empty dict")
    out: dict[str, torch.Tensor] = {}
    for k, t in tensors.items():
        if not isinstance(k, str) or not isinstance(t, torch.Tensor):
            raise AdapterError(f"adapter {name!r}: entry {k!r} is not a named tensor")
        out[k] = t.detach().to("cpu").contiguous()
    try:
        return bytearray(save_safetensors(out))
    except (TypeError, ValueError, RuntimeError) as e:
        raise AdapterError(f"adapter {name!r}: cannot encode the tensors ({e})") from e
