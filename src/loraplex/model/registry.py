"""The supported architectures: HF ``architectures`` name -> decoder class, one line each.

Adding an architecture is its file in ``model/`` (a ``DecoderForCausalLM`` subclass saying how
it differs) and its line here; ``parse_model_config`` refuses every other name at start-up.
"""

from __future__ import annotations

from pathlib import Path

import torch

from loraplex.model.decoder import DecoderForCausalLM
from loraplex.model.gemma import (
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
)
from loraplex.model.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from loraplex.model.mixtral import MixtralForCausalLM
from loraplex.model.phi3 import Phi3ForCausalLM
from loraplex.model.quant.formats import QuantSpec
from loraplex.model.qwen3 import Qwen3ForCausalLM
from loraplex.model.qwen3_moe import Qwen3MoeForCausalLM
from loraplex.model.spec import ModelConfig
from loraplex.model.tensor_parallel.sharding import TensorParallel

ARCHITECTURES: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    name: cls.model_type for name, cls in ARCHITECTURES.items()
}
"""Architecture name -> its ``model_type`` (what adapters are checked against)."""


def load_model(
    model_dir: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    quant: QuantSpec | None = None,
    tp: TensorParallel | None = None,
) -> DecoderForCausalLM:
    """The decoder of ``cfg.architecture`` (parsed by ``parse_model_config``, which refused
    any other) with the checkpoint's weights, quantized as ``quant`` says; ``tp``: only this
    tensor-parallel rank's shard."""
    cls = ARCHITECTURES[cfg.architecture]
    return cls.from_pretrained(model_dir, cfg, dtype, device, quant, tp)
