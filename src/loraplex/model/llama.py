"""Llama and the architectures that differ from it only in ``config.json``: Mistral and Qwen2.

The layers, checkpoint names and loading are the shared decoder's (``model/decoder.py``) as is;
Qwen2 always has q/k/v biases and never an o_proj bias.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loraplex.model.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama 2 / 3 (``attention_bias`` and ``mlp_bias`` as the config says)."""

    model_type = "llama"


class MistralForCausalLM(DecoderForCausalLM):
    """Mistral: Llama's layers (its ``sliding_window``, if any, masks every layer)."""

    model_type = "mistral"


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2 / 2.5: biases on q, k and v, none on o_proj."""

    model_type = "qwen2"

    @classmethod
    def config_fields(cls, c: Mapping[str, Any], source: str) -> dict[str, Any]:
        return {"qkv_bias": True, "o_bias": False}
