"""The rule ``first_kv_layer`` encodes, proved against transformers + PEFT (unmerged, float32):
layer ``l``'s K/V equal the base model's when no adapted module acts before layer ``l`` and
layer ``l``'s k and v projections are not adapted; and the first layer it names does differ.

Each adapter (random non-zero A and B) is read by loraplex (its ``(layer, module)`` keys), and
every layer's K/V from ``past_key_values`` of the base and of the PEFT model are compared."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex.checkpoint.modules import BaseModelSpec, vocab_module_shapes
from loraplex.lora.adapter import load_peft_adapter
from loraplex.lora.kv_reach import first_kv_layer
from loraplex.model.config import load_model_config
from loraplex.testing import make_random_adapter, make_random_model

LAYERS = 4
MLP = ["gate_proj", "up_proj", "down_proj"]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", *MLP]
DIFFERS = 1e-4  # float32 K/V of a changed layer move by far more (B ~ 0.05 * randn)

# name -> (architecture, PEFT LoraConfig fields, the first layer whose KV may change)
CASES: dict[str, tuple[str, dict, int]] = {
    "all_at_2": ("llama", dict(target_modules=ALL, layers_to_transform=[2]), 2),
    "q_o_mlp_at_1_2": (
        "llama",
        dict(target_modules=["q_proj", "o_proj", *MLP], layers_to_transform=[1, 2]),
        2,
    ),
    "q_only_at_2": ("llama", dict(target_modules=["q_proj"], layers_to_transform=[2]), 3),
    "v_only_at_1_3": ("llama", dict(target_modules=["v_proj"], layers_to_transform=[1, 3]), 1),
    "k_only_at_0": ("llama", dict(target_modules=["k_proj"], layers_to_transform=[0]), 0),
    "down_at_3": ("llama", dict(target_modules=["down_proj"], layers_to_transform=[3]), LAYERS),
    "embed_tokens": ("llama", dict(target_modules=["embed_tokens"]), 0),
    "lm_head": ("llama", dict(target_modules=["lm_head"]), LAYERS),
    "fused_qkv_at_2": ("phi3", dict(target_modules=["qkv_proj"], layers_to_transform=[2]), 2),
    "fused_gate_up_at_1": (
        "phi3",
        dict(target_modules=["gate_up_proj"], layers_to_transform=[1]),
        2,
    ),
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bases")
    return {
        arch: make_random_model(root / arch, arch, num_layers=LAYERS, seed=7)
        for arch in ("llama", "phi3")
    }


@torch.no_grad()
def _kv(model: torch.nn.Module, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's cached (K, V) after a forward over ``ids``."""
    cache = model(ids, use_cache=True).past_key_values
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def test_first_kv_layer_on_keys() -> None:
    """The rule on keys alone (no weights): fused parts, the vocabulary modules, nothing."""
    assert first_kv_layer([], LAYERS) == LAYERS
    assert first_kv_layer([(-1, "lm_head")], LAYERS) == LAYERS
    assert first_kv_layer([(3, "q_proj"), (-1, "embed_tokens")], LAYERS) == 0
    assert first_kv_layer([(2, "q_proj"), (3, "v_proj")], LAYERS) == 3
    assert first_kv_layer([(1, "experts.down_proj"), (2, "k_proj")], LAYERS) == 2
    assert first_kv_layer([(1, "gate")], LAYERS) == 2  # a MoE router
    with pytest.raises(ValueError, match="vocabulary module"):
        first_kv_layer([(-1, "lm_head_typo")], LAYERS)


@pytest.mark.parametrize("case", list(CASES))
def test_kv_before_the_first_adapted_kv_layer_is_the_base(
    case: str, bases: dict[str, Path], tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    arch, fields, want = CASES[case]
    base_dir = bases[arch]
    adapter = make_random_adapter(base_dir, tmp_path / case, r=4, seed=11, **fields)
    mc = load_model_config(base_dir)
    vocab = vocab_module_shapes(mc.vocab_size, mc.hidden_size)
    spec = BaseModelSpec(mc.num_layers, mc.module_shapes, mc.model_type, vocab)
    keys = load_peft_adapter(adapter, spec).weights.keys()
    first = first_kv_layer(keys, mc.num_layers)
    assert first == want

    ids = torch.randint(3, 250, (1, 12), generator=torch.Generator().manual_seed(1))
    load = AutoModelForCausalLM.from_pretrained
    base = _kv(load(str(base_dir), dtype=torch.float32).eval(), ids)
    peft = PeftModel.from_pretrained(load(str(base_dir), dtype=torch.float32), str(adapter))
    tuned = _kv(peft.eval(), ids)
    for layer in range(first):  # the same ops on the same inputs: bit for bit
        for b, t in zip(base[layer], tuned[layer], strict=True):
            assert torch.equal(b, t), (case, layer)
    if first < LAYERS:  # and the rule names no layer too late: the first one differs
        diff = max(
            (b - t).abs().max().item() for b, t in zip(base[first], tuned[first], strict=True)
        )
        assert diff > DIFFERS, (case, first, diff)
