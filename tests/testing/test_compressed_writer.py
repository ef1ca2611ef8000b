"""The compressed-tensors test-checkpoint writer (``loraplex.testing.compressed``): each scheme
writes the tensors and config llm-compressor writes for it, and its reference is a plain float32
checkpoint plain transformers loads, holding the dequantized projections.

Bit-equality with llm-compressor itself is checked outside the suite (it pins an older
transformers); these tests pin the layout that comparison established.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from loraplex.testing import load_merged_reference, make_random_model
from loraplex.testing.compressed import write_compressed_tensors

PROJ = "model.layers.0.self_attn.q_proj"
# scheme -> (config format, {q_proj tensor suffix: (safetensors dtype, shape)}) for the
# hidden 64 model at group_size 32: int4 packs 8 values per int32, int8 4.
EXPECTED = {
    "W4A16": ("pack-quantized", {
        "weight_packed": ("I32", [64, 8]), "weight_scale": ("F32", [64, 2]),
        "weight_shape": ("I64", [2]),
    }),
    "W4A16_ASYM": ("pack-quantized", {
        "weight_packed": ("I32", [64, 8]), "weight_scale": ("F32", [64, 2]),
        "weight_shape": ("I64", [2]), "weight_zero_point": ("I32", [8, 2]),
    }),
    "W8A16": ("pack-quantized", {
        "weight_packed": ("I32", [64, 16]), "weight_scale": ("F32", [64, 2]),
        "weight_shape": ("I64", [2]),
    }),
    "W8A8": ("int-quantized", {"weight": ("I8", [64, 64]), "weight_scale": ("F32", [64, 1])}),
    # activations quantized: stored unpacked, the int4 values in int8, as W8A8
    "W4A8": ("int-quantized", {"weight": ("I8", [64, 64]), "weight_scale": ("F32", [64, 2])}),
    "FP8_DYNAMIC": ("float-quantized", {
        "weight": ("F8_E4M3", [64, 64]), "weight_scale": ("F32", [64, 1]),
    }),
    "FP8": ("float-quantized", {
        "weight": ("F8_E4M3", [64, 64]), "weight_scale": ("F32", [1]),
        "input_scale": ("F32", [1]),
    }),
}  # fmt: skip


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model(
        tmp_path_factory.mktemp("float"), "llama", hidden_size=64, intermediate_size=128
    )


def _header(path: Path) -> dict[str, tuple[str, list[int]]]:
    with safe_open(str(path), "pt") as f:
        return {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.mark.parametrize("scheme", list(EXPECTED))
def test_writes_scheme_layout_and_float_reference(
    scheme: str, float_dir: Path, tmp_path: Path
) -> None:
    out, ref = write_compressed_tensors(
        float_dir, tmp_path / "q", tmp_path / "ref", scheme, group_size=32
    )
    fmt, tensors = EXPECTED[scheme]
    header = _header(out / "model.safetensors")
    assert {k[len(PROJ) + 1 :]: v for k, v in header.items() if k.startswith(PROJ)} == tensors
    assert not any(k.startswith("lm_head.") and k != "lm_head.weight" for k in header)
    assert header["lm_head.weight"][0] == "F32"

    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "compressed-tensors"
    assert qcfg["format"] == fmt and qcfg["quantization_status"] == "compressed"
    assert qcfg["ignore"] == ["lm_head"]
    group = qcfg["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"]
    if group["weights"]["strategy"] == "group":
        assert group["weights"]["group_size"] == 32
    assert (group["input_activations"] is None) == ("A16" in scheme)
    for d in (out, ref):
        assert (d / "tokenizer.json").exists()

    # the reference: plain float32, no quantization_config, projections dequantized
    assert "quantization_config" not in json.loads((ref / "config.json").read_text())
    model = load_merged_reference(ref, None)
    assert getattr(model, "hf_quantizer", None) is None
    deq = model.model.layers[0].self_attn.q_proj.weight
    original = load_file(str(float_dir / "model.safetensors"))[f"{PROJ}.weight"]
    assert deq.dtype == torch.float32 and deq.shape == original.shape
    assert not torch.equal(deq, original)
    assert (deq - original).abs().max() < 0.1 * original.abs().max()
    assert model(torch.tensor([[1, 2, 3]])).logits.isfinite().all()


def test_fp8_input_scale_is_input_absmax_over_448(float_dir: Path, tmp_path: Path) -> None:
    """Scheme FP8's static input scale is the absmax of the float model's calibration inputs
    over 448 (float8_e4m3's largest value): layer 0's q/k/v all see the normed embeddings."""
    from transformers import AutoModelForCausalLM

    from loraplex.testing.compressed import CALIBRATION_SHAPE

    out, _ = write_compressed_tensors(float_dir, tmp_path / "q", tmp_path / "ref", "FP8")
    tensors = load_file(str(out / "model.safetensors"))
    assert len([k for k in tensors if k.endswith(".input_scale")]) == 14

    model = AutoModelForCausalLM.from_pretrained(str(float_dir), dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, CALIBRATION_SHAPE, generator=gen)
    with torch.no_grad():
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
    expected = x.abs().amax() / 448
    for proj in ("q_proj", "k_proj", "v_proj"):
        scale = tensors[f"model.layers.0.self_attn.{proj}.input_scale"]
        torch.testing.assert_close(scale, expected.reshape(1), rtol=1e-6, atol=0)


def test_rejects_unknown_scheme(float_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unsupported scheme"):
        write_compressed_tensors(float_dir, tmp_path / "q", tmp_path / "r", "NVFP4")
