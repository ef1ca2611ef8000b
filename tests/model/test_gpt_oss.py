"""GPT-OSS's pieces against transformers' own (``models/gpt_oss``, ``modeling_rope_utils``,
``integrations/mxfp4``), and its MXFP4 checkpoints.

- YaRN's inverse frequencies and attention factor equal ``_compute_yarn_parameters`` (truncated
  or not, with ``mscale`` / ``mscale_all_dim``, an explicit ``attention_factor``);
- ``sink_attend`` equals HF's ``eager_attention_forward`` (GQA, a window mask) and the sinks
  change its output; the clamped SwiGLU of de-interleaved columns equals
  ``GptOssExperts._apply_gate`` of the interleaved ones; the top-k-then-softmax routing equals
  ``GptOssTopKRouter``;
- a checkpoint whose experts are MXFP4 (random weights quantized here, in the released layout)
  loads to exactly transformers' dequantization, generates what transformers generates on the
  dequantized float checkpoint (with adapters on the experts), and holds its experts in the
  model dtype (resident bytes as a float checkpoint's);
- the router is refused as an adapter target, naming it;
- two tensor-parallel ranks (gloo on this CPU) give one device's greedy tokens and logprobs
  for a mixed batch of adapters on the experts, attention and the vocabulary, with LoRA's
  default split and fully sharded, on the float checkpoint and on the MXFP4 one (each rank
  dequantizes, then keeps its columns); a shape that does not split is refused by name.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.model.attention import sink_attend
from loraplex.model.gpt_oss import FP4_VALUES, dequantize_mxfp4
from loraplex.model.moe import SparseMoE, clamped_swiglu
from loraplex.model.rotary import YaRNRotaryEmbedding
from loraplex.testing import (
    load_merged_reference,
    logprob_gap,
    make_random_adapter,
    make_random_model,
    reference_greedy,
)
from loraplex.types import AdapterError
from tests.engine.test_moe_experts import adapters_for
from tests.engine.test_tensor_parallel import _run, assert_same_outputs

YARN_CASES = [
    dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
         original_max_position_embeddings=4096),  # gpt-oss's
    dict(factor=4.0, original_max_position_embeddings=64),  # truncated, default betas
    dict(factor=8.0, original_max_position_embeddings=128, mscale=0.7, mscale_all_dim=1.0),
    dict(factor=2.0, original_max_position_embeddings=32, attention_factor=1.3, beta_fast=8.0),
]  # fmt: skip


@pytest.mark.parametrize("params", YARN_CASES)
def test_yarn_equals_transformers(params: dict) -> None:
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, **params}
    cfg = GptOssConfig(hidden_size=64, head_dim=48, num_attention_heads=4, rope_parameters=rope)
    want_inv, want_attn = _compute_yarn_parameters(cfg)
    rot = YaRNRotaryEmbedding(48, 150000.0, rope, torch.float32, torch.device("cpu"))
    assert torch.equal(rot.inv_freq(), want_inv)
    assert rot.attention_factor == pytest.approx(want_attn, rel=1e-15)
    cos, _ = rot.tables(8)  # the factor scales the tables
    assert torch.allclose(cos[0], torch.full((48,), want_attn, dtype=torch.float32))


def test_sink_attention_equals_hf_eager() -> None:
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    g = torch.Generator().manual_seed(0)
    H, KVH, L, hd = 6, 2, 7, 8
    q, k, v = (torch.randn(1, n, L, hd, generator=g) for n in (H, KVH, KVH))
    sinks = torch.randn(H, generator=g) * 2
    pos = torch.arange(L)
    seen = (pos[None] <= pos[:, None]) & (pos[:, None] - pos[None] < 3)  # a window of 3
    additive = torch.zeros(L, L).masked_fill(~seen, torch.finfo(torch.float32).min)
    module = torch.nn.Module()
    module.num_key_value_groups, module.sinks, module.training = H // KVH, sinks, False
    want, _ = eager_attention_forward(module, q, k, v, additive[None, None], 0.3)  # [1, L, H, hd]
    got = sink_attend(q[0], k[0], v[0], seen, 0.3, True, sinks=sinks)  # [H, L, hd]
    torch.testing.assert_close(got.transpose(0, 1), want[0], rtol=1e-6, atol=1e-6)
    causal = sink_attend(q[0], k[0], v[0], None, 0.3, True, sinks=sinks)  # mask None: causal
    plain = sink_attend(q[0], k[0], v[0], None, 0.3, True, sinks=torch.full((H,), -1e30))
    assert not torch.allclose(causal, plain, atol=1e-3)  # the sinks take their share


def test_clamped_swiglu_and_routing_equal_hf() -> None:
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

    cfg = GptOssConfig(hidden_size=16, intermediate_size=6, num_local_experts=8,
                       num_experts_per_tok=3, swiglu_limit=1.5)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    gu = torch.randn(9, 12, generator=g) * 3  # interleaved gate / up, beyond the limit
    want = GptOssExperts(cfg)._apply_gate(gu)
    got = clamped_swiglu(torch.cat((gu[:, 0::2], gu[:, 1::2]), 1), 6, 1.5, cfg.swiglu_alpha)
    assert torch.equal(got, want)
    router = GptOssTopKRouter(cfg)
    x = torch.randn(9, 16, generator=g)
    with torch.no_grad():
        router.weight.normal_(generator=g)
        logits, scores, experts = router(x)
    moe = SparseMoE.__new__(SparseMoE)
    moe.top_k, moe.softmax_after_topk = 3, True
    w, e = moe.route(logits)
    assert torch.equal(e, experts) and torch.equal(w, scores)


# ----------------------------------------------------------------------------------- MXFP4


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., K]`` (K a multiple of 32) -> MXFP4 ``blocks [..., K / 32, 16]`` (uint8, the
    even value in the low nibble) and e8m0 ``scales [..., K / 32]``: per 32 values the
    smallest power of two that brings them within FP4's +-6, each rounded to the nearest
    FP4 value."""
    groups = w.float().reshape(*w.shape[:-1], -1, 32)  # [..., G, 32]
    amax = groups.abs().amax(-1).clamp(min=2.0**-100)  # [..., G]
    exp = torch.ceil(torch.log2(amax / 6.0)).to(torch.int32)
    scaled = groups / torch.exp2(exp.float())[..., None]  # within [-6, 6]
    lut = torch.tensor(FP4_VALUES)
    codes = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [..., G, 16]
    return blocks, (exp + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def mxfp4_pair(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny GPT-OSS saved twice: its experts MXFP4 (blocks / scales, ``quantization_config``
    mxfp4, as released) and the same weights dequantized by transformers, in float."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    model = make_random_model(root / "float", "gpt_oss", num_layers=2, seed=3, intermediate_size=32)
    tensors = load_file(str(model / "model.safetensors"))
    packed, dequant = dict(tensors), {}
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors[name].transpose(1, 2))  # [E, out, in / 32, ...]
        del packed[name]
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
        dequant[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        tensors[name] = dequant[name].contiguous()  # [E, in, out], as transformers loads it
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    quant = root / "mxfp4"
    quant.mkdir()
    for f in model.iterdir():
        if f.name != "model.safetensors":
            (quant / f.name).write_bytes(f.read_bytes())
    save_file(packed, str(quant / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((quant / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}  # fmt: skip
    (quant / "config.json").write_text(json.dumps(cfg))
    return {"float": model, "mxfp4": quant, "dequant": dequant, "root": root}


def test_mxfp4_experts_load_as_transformers_dequantizes_them(mxfp4_pair: dict) -> None:
    llm = LLM(str(mxfp4_pair["mxfp4"]), dtype="float32", max_loras=2, max_lora_rank=8)
    model = llm.engine.model
    for i, L in enumerate(model.layers):
        hf = mxfp4_pair["dequant"]  # [E, in, out]
        gu = hf[f"model.layers.{i}.mlp.experts.gate_up_proj"].transpose(1, 2)  # [E, 2 I, D]
        want_gu = torch.cat((gu[:, 0::2], gu[:, 1::2]), 1)  # gate rows, then up rows
        want_down = hf[f"model.layers.{i}.mlp.experts.down_proj"].transpose(1, 2)  # [E, D, I]
        assert torch.equal(L.w_gate_up.dense(), want_gu)
        assert torch.equal(L.w_down.dense(), want_down)
    float_llm = LLM(str(mxfp4_pair["float"]), dtype="float32", max_loras=2, max_lora_rank=8)
    assert model.nbytes == float_llm.engine.model.nbytes  # dequantized: float-sized experts
    # every code and a range of scales: the same bits as transformers' dequantization
    blocks = torch.randint(0, 256, (3, 2, 16), dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 2), dtype=torch.uint8)
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    want = convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.float32)[0].T
    assert torch.equal(dequantize_mxfp4(blocks, scales), want)


def test_mxfp4_generation_equals_transformers_on_the_dequantized_weights(
    mxfp4_pair: dict,
) -> None:
    """Greedy tokens and logprobs of the base and of an expert + attention adapter on the MXFP4
    checkpoint equal transformers + PEFT on the float one."""
    adapter = make_random_adapter(
        mxfp4_pair["float"], mxfp4_pair["root"] / "experts", r=4, lora_alpha=8,
        target_modules=["q_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], std=0.1, seed=2,
    )  # fmt: skip
    llm = LLM(str(mxfp4_pair["mxfp4"]), dtype="float32", max_loras=2, max_lora_rank=8)
    tok = llm.get_tokenizer()
    prompts = ["What is the capital of France?", "def add(a, b):"]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    for lora in (None, LoRARequest("experts", str(adapter))):
        ref = load_merged_reference(mxfp4_pair["float"], None if lora is None else adapter)
        outs = llm.generate(prompts, sp, lora_request=[lora] * len(prompts))
        for prompt, out in zip(prompts, outs, strict=True):
            want, ref_lp = reference_greedy(ref, tok(prompt).input_ids, 8)
            assert out.outputs[0].token_ids == want, (lora, prompt)
            assert logprob_gap(out.outputs[0].logprobs, ref_lp) < 2e-4


def test_mxfp4_half_pair_is_refused(mxfp4_pair: dict, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    for f in mxfp4_pair["mxfp4"].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    t = load_file(str(bad / "model.safetensors"))
    del t["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(Exception, match=r"layer 1 w_down: MXFP4 _blocks without its pair"):
        LLM(str(bad), dtype="float32")


def test_router_is_refused_naming_it(mxfp4_pair: dict, tmp_path: Path) -> None:
    """target_parameters on the router (no Linear: PEFT cannot target it as a module) is
    refused at load with one line naming it; the engine serves on."""
    adapter = make_random_adapter(
        mxfp4_pair["float"], tmp_path / "router", r=4, target_modules=["q_proj"], seed=1
    )
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["target_parameters"] = ["mlp.router.weight"]
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    llm = LLM(str(mxfp4_pair["float"]), dtype="float32", max_loras=2, max_lora_rank=8)
    sp = SamplingParams(max_tokens=1)
    with pytest.raises(AdapterError, match=r"'mlp\.router\.weight'") as info:
        llm.generate("Hello", sp, lora_request=LoRARequest("router", str(adapter)))
    assert "\n" not in str(info.value)
    assert llm.generate("Hello", sp)[0].outputs[0].token_ids


def test_sinks_take_part(mxfp4_pair: dict) -> None:
    """With every sink at -inf the outputs move (the sinks are read, prefill and decode)."""
    llm = LLM(str(mxfp4_pair["float"]), dtype="float32", max_loras=1, enable_prefix_caching=False)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    before = llm.generate("Hello world! How are you", sp)[0].outputs[0]
    for L in llm.engine.model.layers:
        L.sinks.fill_(-math.inf)  # the layers' attention functions hold these tensors
    after = llm.generate("Hello world! How are you", sp)[0].outputs[0]
    moved = [
        abs(v - a.top[t]) for b, a in zip(before.logprobs, after.logprobs, strict=True)
        for t, v in b.top.items() if t in a.top
    ]  # fmt: skip
    assert after.token_ids != before.token_ids or max(moved) > 1e-3


def test_decode_with_sinks_on_the_c_kernel_and_torch(mxfp4_pair: dict) -> None:
    """The layers' decode attention follows the model's layer ops (``use_layer_ops``): the C
    kernel with the sinks and the torch path give the transformers reference's tokens."""
    from loraplex.model.layer_ops import TorchLayerOps

    llm = LLM(str(mxfp4_pair["float"]), dtype="float32", max_loras=1, enable_prefix_caching=False)
    model, tok = llm.engine.model, llm.get_tokenizer()
    ref = load_merged_reference(mxfp4_pair["float"], None)
    prompt = "Once upon a time there was"
    want, ref_lp = reference_greedy(ref, tok(prompt).input_ids, 10)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    c_ops = model.ops
    for ops in (c_ops, TorchLayerOps()):
        model.use_layer_ops(ops)
        assert all(L.decode.func.__self__ is ops for L in model.layers)  # type: ignore[union-attr]
        out = llm.generate(prompt, sp)[0].outputs[0]
        assert out.token_ids == want, ops.name
        assert logprob_gap(out.logprobs, ref_lp) < 2e-4


def test_bfloat16_prompt_logprobs_follow_transformers_bf16(tmp_path: Path) -> None:
    """In bfloat16 the prefill keeps HF's rounding steps (norm scale in float32, sinks in the
    softmax of bf16 scores, the clamped SwiGLU): prompt logprobs within 1/128 of transformers'
    own bf16 run (a quarter of a bf16 ulp at logit magnitude 8; the float32 run is about
    ten times farther from it)."""
    from transformers import AutoModelForCausalLM

    model = make_random_model(tmp_path / "m", "gpt_oss", num_layers=2, seed=5,
                              intermediate_size=64, dtype=torch.bfloat16)  # fmt: skip
    llm = LLM(str(model), dtype="bfloat16", enable_lora=False)
    prompt = "Once upon a time there was a small model that answered"
    ids = llm.get_tokenizer()(prompt).input_ids
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, ignore_eos=True)
    out = llm.generate(prompt, sp)[0]
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.bfloat16)
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    gap = max(
        abs(v - float(want[i, t]))
        for i, entry in enumerate(out.prompt_logprobs[1:])  # type: ignore[index]
        for t, v in entry.items()  # type: ignore[union-attr]
    )
    assert gap < 2**-7


# ------------------------------------------------------------------------ tensor parallelism


@pytest.fixture(scope="module")
def tp_family(mxfp4_pair: dict) -> dict:
    """The MXFP4 pair's model (4 query heads and their sinks over 2 KV heads, 8 experts of 32
    columns with their biases, q/k/v/o biases, a window of 4 every prompt crosses) with four
    adapters (``test_moe_experts.adapters_for("packed")``): attention r4 (rsLoRA), q and both
    packed experts r8, k/o + down experts + lm_head + embed_tokens r16, v + gate/up experts r4;
    and one device's run of the base and all four in one batch."""
    root = mxfp4_pair["root"] / "tp"
    adapters = [
        make_random_adapter(mxfp4_pair["float"], root / name, **kw)
        for name, (_, kw) in adapters_for("packed").items()
    ]
    one = _run(mxfp4_pair["float"], adapters, 1, max_lora_rank=16)
    return {"adapters": adapters, "one": one}


@pytest.mark.parametrize(("weights", "fully_sharded"), [("float", False), ("float", True),
                                                         ("mxfp4", False)])  # fmt: skip
def test_tp2_equals_tp1(
    weights: str, fully_sharded: bool, tp_family: dict, mxfp4_pair: dict
) -> None:
    """Each rank keeps its heads' sinks, its columns of q/k/v's biases and of every expert's
    gate/up weights and bias; o's bias and the down experts' bias are added by rank 0 alone;
    the router is whole. The MXFP4 checkpoint holds the float one's weights (its
    dequantization), so its ranks give the float checkpoint's one-device output too."""
    kw = {"fully_sharded_loras": True} if fully_sharded else {}
    two = _run(mxfp4_pair[weights], tp_family["adapters"], 2, max_lora_rank=16, **kw)
    assert_same_outputs(tp_family["one"], two)


@pytest.mark.parametrize(
    ("shape", "field"),
    [(dict(num_heads=3, num_kv_heads=1, head_dim=16), "num_attention_heads=3 is not a multiple"),
     (dict(intermediate_size=33), "intermediate_size=33 is not a multiple")],
)  # fmt: skip
def test_shapes_that_do_not_split_are_refused(shape: dict, field: str, tmp_path: Path) -> None:
    """Three heads (and their sinks), or experts of an odd width, over two ranks:
    refused at load in one line naming the config field."""
    model = make_random_model(tmp_path / "m", "gpt_oss", with_tokenizer=False, **shape)
    with pytest.raises(Exception, match=field) as info:
        LLMEngine(
            EngineConfig(
                model=str(model), tensor_parallel_size=2, num_threads=1, skip_tokenizer_init=True
            )
        )
    assert "\n" not in str(info.value)
