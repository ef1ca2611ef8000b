"""Adapters for the language model of a multimodal checkpoint (Gemma 3's
``Gemma3ForConditionalGeneration``): their module names carry the language-model prefix
(``model.language_model.`` in transformers 5, ``language_model.model.`` before), LoRA applies to
the text backbone only, and tensors on the vision tower or projector are skipped, as vLLM does;
on a text-only causal LM such tensors are still refused."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loraplex.checkpoint.modules import BaseModelSpec
from loraplex.lora.peft.config import parse_lora_config
from loraplex.lora.peft.errors import FormatError
from loraplex.lora.peft.layout import check_layout
from loraplex.lora.peft.tensors import TensorMeta

TEXT = dict(
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    num_hidden_layers=2,
    vocab_size=100,
    model_type="gemma3_text",
)
MULTIMODAL = {"model_type": "gemma3", "text_config": TEXT, "vision_config": {"hidden_size": 16}}


def _tensors(prefix: str, r: int = 4, vision: bool = False) -> dict[str, TensorMeta]:
    f32 = "torch.float32"
    out = {}
    for layer in range(2):
        for proj, d_out in (("q_proj", 32), ("v_proj", 16)):
            base = f"base_model.model.{prefix}layers.{layer}.self_attn.{proj}"
            out[f"{base}.lora_A.weight"] = TensorMeta((r, 32), f32, True)
            out[f"{base}.lora_B.weight"] = TensorMeta((d_out, r), f32, True)
    if vision:
        tower = "base_model.model.model.vision_tower.vision_model.encoder.layers.0.self_attn"
        out[f"{tower}.q_proj.lora_A.weight"] = TensorMeta((r, 16), f32, True)
        out[f"{tower}.q_proj.lora_B.weight"] = TensorMeta((16, r), f32, True)
        out["base_model.model.model.multi_modal_projector.proj.lora_A.weight"] = TensorMeta(
            (r, 16), f32, True
        )
    return out


SETTINGS = parse_lora_config(
    {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
)


def test_the_spec_of_a_multimodal_config_is_its_text_models() -> None:
    spec = BaseModelSpec.from_hf_config(MULTIMODAL)
    assert spec.text_only and spec.model_type == "gemma3"
    text = BaseModelSpec.from_hf_config(TEXT)
    assert spec == replace(text, model_type="gemma3", text_only=True)
    assert spec.module_shapes["q_proj"] == (32, 32) and spec.num_layers == 2


@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_language_model_prefix_and_other_towers_skipped(prefix: str) -> None:
    spec = BaseModelSpec.from_hf_config(MULTIMODAL)
    layout = check_layout(SETTINGS, _tensors(prefix, vision=True), spec, max_rank=8)
    assert sorted(layout) == [(0, "q_proj"), (0, "v_proj"), (1, "q_proj"), (1, "v_proj")]
    assert layout[(1, "v_proj")].module == f"{prefix}layers.1.self_attn.v_proj"


def test_a_text_only_base_refuses_other_towers() -> None:
    spec = BaseModelSpec.from_hf_config(TEXT)
    assert not spec.text_only
    with pytest.raises(FormatError, match=r"(vision_tower|multi_modal_projector).*not a LoRA"):
        check_layout(SETTINGS, _tensors("model.", vision=True), spec, max_rank=8)


def test_a_half_present_text_backbone_is_still_refused() -> None:
    """Skipping the towers never hides a missing text module the config targets."""
    spec = BaseModelSpec.from_hf_config(MULTIMODAL)
    tensors = {
        k: v for k, v in _tensors("model.language_model.", vision=True).items() if ".1." not in k
    }
    with pytest.raises(FormatError, match=r"layers\.1\.self_attn\.q_proj is targeted"):
        check_layout(SETTINGS, tensors, spec, max_rank=8)
