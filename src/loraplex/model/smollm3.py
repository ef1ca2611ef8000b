"""SmolLM3: Llama's layers, except that some layers apply no rotary embedding (NoPE).

``no_rope_layers[i]`` is 1 where layer ``i`` rotates q and k and 0 where it does not (the
released 3B: every fourth layer); configs without the list use ``no_rope_layer_interval``
(every ``interval``-th layer, counting from 1, has none), as transformers derives it. The rest —
checkpoint names, the tied head of the small sizes, optional sliding windows through
``layer_types`` — is the shared decoder's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loraplex.model.decoder import DecoderForCausalLM
from loraplex.model.rotary import RotaryEmbedding
from loraplex.types import ModelLoadError


def rope_layers(raw: Mapping[str, Any], num_layers: int) -> list[bool]:
    """Whether each layer applies the rotary embedding (False: a NoPE layer)."""
    flags = raw.get("no_rope_layers")
    if flags is None:
        interval = int(raw.get("no_rope_layer_interval") or 4)
        return [(i + 1) % interval != 0 for i in range(num_layers)]
    if not isinstance(flags, list) or len(flags) != num_layers:
        raise ModelLoadError(
            f"no_rope_layers must list one 0/1 flag per layer ({num_layers}), got {flags!r}"
        )
    return [bool(f) for f in flags]


class SmolLM3ForCausalLM(DecoderForCausalLM):
    """SmolLM3: Llama with NoPE layers."""

    model_type = "smollm3"

    @classmethod
    def config_fields(cls, c: Mapping[str, Any], source: str) -> dict[str, Any]:
        """Check the NoPE flags at parse time (a bad list fails start-up, naming the field)."""
        rope_layers(c, int(c["num_hidden_layers"]))
        return {}

    def layer_rotaries(self) -> list[RotaryEmbedding | None]:
        rotary = super().layer_rotaries()
        flags = rope_layers(self.cfg.raw, self.cfg.num_layers)
        return [r if use else None for r, use in zip(rotary, flags, strict=True)]
