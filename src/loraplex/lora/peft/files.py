"""The files of a PEFT adapter directory and which of them an adapter is read from."""

from __future__ import annotations

from collections.abc import Iterable

CONFIG_NAME = "adapter_config.json"
SAFETENSORS_NAME = "adapter_model.safetensors"
BIN_NAME = "adapter_model.bin"
ADAPTER_FILES = (CONFIG_NAME, SAFETENSORS_NAME, BIN_NAME)
"""Every file that can make up an adapter directory (the config, then weights by preference)."""


def choose_adapter_files(names: Iterable[str]) -> tuple[str, ...]:
    """The files an adapter is read from, given the names present in its directory: the config
    plus safetensors if present, else the .bin. ``()`` without a config, ``(CONFIG_NAME,)``
    without weights."""
    present = set(names)
    if CONFIG_NAME not in present:
        return ()
    for weights in (SAFETENSORS_NAME, BIN_NAME):
        if weights in present:
            return (CONFIG_NAME, weights)
    return (CONFIG_NAME,)
