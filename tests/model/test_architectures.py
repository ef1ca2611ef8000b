"""The architecture registry and each architecture's config hooks, the shared layers against
transformers' own, and the loader's errors naming the tensor at fault."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex import LLM, ModelLoadError
from loraplex.model.config import load_model_config, parse_model_config
from loraplex.model.decoder import DecoderForCausalLM
from loraplex.model.layers import ACTIVATIONS, RMSNorm
from loraplex.model.loading import load_model
from loraplex.model.registry import ARCHITECTURES
from loraplex.testing import ARCH_CONFIGS, make_random_model

CPU = torch.device("cpu")


def _raw(arch: str, **fields: object) -> dict:
    """A minimal config.json for ``arch``."""
    base = {
        "architectures": [arch],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 96,
    }
    return {**base, **fields}


# -------------------------------------------------------------------------------- registry


def test_unknown_architecture_is_refused_at_start_up_in_one_line(tmp_path: Path) -> None:
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError) as e:
        LLM(str(d), skip_tokenizer_init=True)
    msg = str(e.value)
    assert "\n" not in msg
    assert "unsupported architecture 'GPT2LMHeadModel'; supported: " in msg
    assert msg.endswith("supported: " + ", ".join(ARCHITECTURES))
    assert "Qwen3ForCausalLM" in msg and "LlamaForCausalLM" in msg
    with pytest.raises(ModelLoadError, match=r"architecture \(none named; model_type 'gpt2'\)"):
        parse_model_config({"model_type": "gpt2"})


def test_every_architecture_has_a_test_model_builder() -> None:
    """Each supported architecture can be built tiny from transformers' own classes."""
    assert set(ARCHITECTURES) <= {model for _, model in ARCH_CONFIGS.values()}


def test_architecture_config_hooks() -> None:
    qwen2 = parse_model_config(_raw("Qwen2ForCausalLM"))
    assert (qwen2.model_type, qwen2.qkv_bias, qwen2.o_bias) == ("qwen2", True, False)
    llama = parse_model_config(_raw("LlamaForCausalLM", attention_bias=True))
    assert (llama.qkv_bias, llama.o_bias) == (True, True)
    qwen3 = parse_model_config(
        _raw("Qwen3ForCausalLM", head_dim=24, sliding_window=32, use_sliding_window=False)
    )
    assert (qwen3.model_type, qwen3.head_dim, qwen3.qkv_bias) == ("qwen3", 24, False)
    assert qwen3.sliding_window is None  # only with use_sliding_window
    assert qwen3.module_shapes["q_proj"] == (64, 96) and qwen3.module_shapes["o_proj"] == (96, 64)
    windowed = parse_model_config(
        _raw("Qwen3ForCausalLM", sliding_window=32, use_sliding_window=True)
    )
    assert windowed.sliding_window == 32
    with pytest.raises(ModelLoadError, match=r"unsupported hidden_act 'relu2'; supported: silu"):
        parse_model_config(_raw("Qwen3ForCausalLM", hidden_act="relu2"))


# ---------------------------------------------------------------------------- shared layers


def test_activations_equal_transformers() -> None:
    from transformers.activations import ACT2FN

    x = 4 * torch.randn(8, 33, generator=torch.Generator().manual_seed(0))
    for name, fn in ACTIVATIONS.items():
        assert torch.equal(fn(x), ACT2FN[name](x)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_head_qk_norm_equals_each_heads_own_norm(dtype: torch.dtype) -> None:
    """One norm over the q and k heads equals HF's q_norm on q and k_norm on k."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    g = torch.Generator().manual_seed(1)
    heads, kv_heads, hd, eps = 4, 2, 24, 1e-6
    qn, kn = Qwen3RMSNorm(hd, eps), Qwen3RMSNorm(hd, eps)
    with torch.no_grad():
        qn.weight.copy_(1 + 0.1 * torch.randn(hd, generator=g))
        kn.weight.copy_(1 + 0.1 * torch.randn(hd, generator=g))
    qn, kn = qn.to(dtype), kn.to(dtype)
    x = torch.randn(5, heads + kv_heads, hd, generator=g).to(dtype)  # [T, H + KVH, hd]
    norm = RMSNorm.per_head(qn.weight.data, kn.weight.data, heads, kv_heads, eps)
    with torch.no_grad():
        want = torch.cat((qn(x[:, :heads]), kn(x[:, heads:])), dim=1)
    got = norm(x)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want)  # the dtype's default tolerance


# --------------------------------------------------------------------------------- loading


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("qwen3")
    return make_random_model(d, "qwen3", head_dim=24, with_tokenizer=False, vocab_size=96)


def _variant(src: Path, dst: Path, tensors: dict[str, torch.Tensor], **config: object) -> Path:
    dst.mkdir()
    raw = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**raw, **config}))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _load(d: Path) -> DecoderForCausalLM:
    return load_model(d, load_model_config(d), torch.float32, CPU)


def test_loader_errors_name_the_tensor(tmp_path: Path, qwen3_dir: Path) -> None:
    tensors = load_file(str(qwen3_dir / "model.safetensors"))
    good = _load(qwen3_dir)
    assert [L.qk_norm.weight.shape for L in good.layers] == [(4 + 2, 24)] * 2  # [H + KVH, hd]
    key = "model.layers.1.self_attn.k_norm.weight"
    missing = _variant(
        qwen3_dir, tmp_path / "missing", {k: v for k, v in tensors.items() if k != key}
    )
    with pytest.raises(ModelLoadError, match=rf"layer 1 is missing tensor\(s\) \['{key}'\]"):
        _load(missing)
    rogue = "model.layers.0.self_attn.rogue.weight"
    extra = _variant(qwen3_dir, tmp_path / "extra", {**tensors, rogue: torch.zeros(3)})
    with pytest.raises(ModelLoadError, match=f"unexpected tensor '{rogue}' for Qwen3ForCausalLM"):
        _load(extra)
    # the checkpoint's heads are 24 wide; a config that says 16 is caught at the first tensor
    shrunk = _variant(qwen3_dir, tmp_path / "shrunk", tensors, head_dim=16)
    with pytest.raises(ModelLoadError, match=r"tensor 'model\.layers\.0\.self_attn\.") as e:
        _load(shrunk)
    assert "config.json implies" in str(e.value)
