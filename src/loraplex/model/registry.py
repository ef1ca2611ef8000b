"""The supported architectures: HF ``architectures`` name -> decoder class, one line each.

Adding an architecture is its file in ``model/`` (a ``DecoderForCausalLM`` subclass saying how
it differs) and its line here; ``parse_model_config`` refuses every other name at start-up, and
``load_model`` (``model/loading.py``) builds the class :func:`model_class` picks: the one named
here, or a variant of it that serves the config (:data:`VARIANTS`: Gemma 4's MoE, which keeps
the dense model's name).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loraplex.model.decoder import DecoderForCausalLM
from loraplex.model.gemma import (
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
)
from loraplex.model.gemma4 import Gemma4ForCausalLM, Gemma4ForConditionalGeneration
from loraplex.model.gemma4_moe import Gemma4MoeForCausalLM, Gemma4MoeForConditionalGeneration
from loraplex.model.gpt_oss import GptOssForCausalLM
from loraplex.model.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from loraplex.model.llama4 import Llama4ForCausalLM, Llama4ForConditionalGeneration
from loraplex.model.mixtral import MixtralForCausalLM
from loraplex.model.phi3 import Phi3ForCausalLM
from loraplex.model.qwen3 import Qwen3ForCausalLM
from loraplex.model.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration
from loraplex.model.qwen3_5_moe import (
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
)
from loraplex.model.qwen3_moe import Qwen3MoeForCausalLM
from loraplex.model.smollm3 import SmolLM3ForCausalLM

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
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForConditionalGeneration,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Gemma4ForConditionalGeneration": Gemma4ForConditionalGeneration,
    "Llama4ForCausalLM": Llama4ForCausalLM,
    "Llama4ForConditionalGeneration": Llama4ForConditionalGeneration,
    "GptOssForCausalLM": GptOssForCausalLM,
}

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    name: cls.model_type for name, cls in ARCHITECTURES.items()
}
"""Architecture name -> its ``model_type`` (what adapters are checked against)."""

VARIANTS: dict[str, tuple[type[DecoderForCausalLM], ...]] = {
    "Gemma4ForCausalLM": (Gemma4MoeForCausalLM,),
    "Gemma4ForConditionalGeneration": (Gemma4MoeForConditionalGeneration,),
}
"""Architecture name -> the classes that serve some of its configs instead of the named one,
each saying which (``serves``: Gemma 4's ``enable_moe_block``)."""


def model_class(name: str, raw: Mapping[str, Any]) -> type[DecoderForCausalLM]:
    """The class that serves ``config.json`` ``raw`` of architecture ``name`` (one of
    :data:`ARCHITECTURES`): the first of its :data:`VARIANTS` that serves the (text) config,
    else the named class."""
    text = raw.get("text_config")
    text = text if isinstance(text, Mapping) else raw
    return next((v for v in VARIANTS.get(name, ()) if v.serves(text)), ARCHITECTURES[name])
