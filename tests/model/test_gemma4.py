"""Gemma 4 (text, and the language model of ``Gemma4ForConditionalGeneration``) against
transformers + PEFT unmerged: a mixed batch of the base and adapters of different ranks on
attention, MLP, the per-layer input modules (``per_layer_input_gate``, ``per_layer_projection``,
``per_layer_model_projection``), ``embed_tokens`` and ``lm_head``, over KV-sharing layers,
sliding windows prompts cross, the proportional rope and a final soft-cap that bites; on the C
kernels (LoRA and layer ops) and on the torch path; tensor parallelism (two ranks over gloo)
against one device. Also the proportional rope and Gemma 4's norm against transformers' own
functions, and the one-line refusals at start-up."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from loraplex import LLM, LoRARequest, ModelLoadError, SamplingParams
from loraplex.model.config import load_model_config, parse_model_config
from loraplex.model.gemma4 import Gemma4ForCausalLM
from loraplex.model.norms import Float32ScaleRMSNorm
from loraplex.model.quant.weights import QuantizedEmbedding
from loraplex.model.rotary import make_rotary
from loraplex.model.tensor_parallel.sharding import ShardLayout
from loraplex.testing import (
    ALL_PROJ,
    logprob_gap,
    make_random_adapter,
    make_random_model,
    reference_greedy,
)
from loraplex.testing.quant import write_dequantized, write_gptq
from loraplex.tools import plan, verify
from tests.engine.test_mixed_batch_architectures import check_mixed_batch
from tests.engine.test_tensor_parallel import GREEDY, _run, assert_same_outputs
from tests.engine.test_tensor_parallel import PROMPTS as TP_PROMPTS
from tests.model.test_quantized_bases import ON_THE_FLY, _check_mixed_batch

S, F = "sliding_attention", "full_attention"
PLE = ["per_layer_input_gate", "per_layer_projection"]
ADAPTERS = {  # three and more ranks, every kind of module Gemma 4 adapts
    "all_ple_r8": dict(r=8, target_modules=[*ALL_PROJ, *PLE], seed=1),
    "model_proj_qo_r4": dict(
        r=4, target_modules=["per_layer_model_projection", "q_proj", "o_proj"], use_rslora=True,
        seed=2,
    ),
    "ple_r16_layers": dict(r=16, lora_alpha=8, target_modules=PLE, layers_to_transform=[1, 4],
                           seed=3),
    "vocab_r2": dict(r=2, target_modules=["embed_tokens", "lm_head", "down_proj"], std=0.1,
                     seed=4),
}  # fmt: skip
PROMPTS = [
    "What is the capital of France?",
    "def add(a, b):",
    "SELECT name FROM users WHERE id = 42",
    "Once upon a time there was",
]
N_NEW = 8
SAMPLE_TOL = 2e-4  # float32 logprobs, as the mixed-batch tests of every family
PROMPT_TOL = 1e-4


def _reference(base: Path, adapter: Path | None) -> torch.nn.Module:
    """transformers (float32) with the adapter through PEFT, unmerged."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    return model.eval()


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Six layers, the last two sharing the KV of layers 2 (sliding) and 3 (full) with MLPs
    twice as wide; the full layers' heads 32 wide beside the sliding layers' 16 (the released
    models' 512 and 256)."""
    root = tmp_path_factory.mktemp("gemma4")
    model = make_random_model(
        root / "model", "gemma4_text", num_layers=6, seed=5, layer_types=[S, F] * 3,
        num_kv_shared_layers=2, final_logit_softcapping=3.0, init_std=0.05, global_head_dim=32,
        use_double_wide_mlp=True,
    )  # fmt: skip
    adapters = {n: make_random_adapter(model, root / n, **kw) for n, kw in ADAPTERS.items()}
    refs = {n: _reference(model, adapters.get(n)) for n in [None, *adapters]}
    return {"model": model, "adapters": adapters, "refs": refs}


@pytest.fixture(scope="module", params=["cpu-kernel", "torch"])
def llm(request: pytest.FixtureRequest, gemma4: dict) -> Iterator[LLM]:
    """An engine on the C LoRA and layer kernels (the CPU default) or on torch ops."""
    kernel = "1" if request.param == "cpu-kernel" else "0"
    with pytest.MonkeyPatch.context() as mp:  # both chosen once, at start-up
        mp.setenv("LORAPLEX_LORA_CPU_KERNEL", kernel)
        mp.setenv("LORAPLEX_LAYER_CPU_KERNEL", kernel)
        llm = LLM(
            str(gemma4["model"]), max_loras=len(ADAPTERS), max_lora_rank=16, dtype="float32",
            block_size=4,
        )  # fmt: skip
    assert llm.engine.model.lora is not None
    assert llm.engine.model.lora.ops.name.startswith(request.param)
    assert llm.engine.model.ops.name == request.param
    yield llm


def test_mixed_batch_equals_peft_unmerged(llm: LLM, gemma4: dict) -> None:
    adapters, refs = gemma4["adapters"], gemma4["refs"]
    check_mixed_batch(llm, adapters, refs, N_NEW, SAMPLE_TOL, PROMPTS)
    tok = llm.get_tokenizer()
    ids = torch.tensor([tok(PROMPTS[0]).input_ids])
    with torch.no_grad():  # every adapter really moves the logits (no silent no-op passes)
        plain = refs[None](ids).logits
        for name in adapters:
            assert (refs[name](ids).logits - plain).abs().max() > 1e-2, name
    assert llm.engine.is_idle()


def test_kv_sharing_layers_have_no_kv_modules(llm: LLM) -> None:
    """The adapter check and the slot bank know the shared layers have no k/v projections
    (the all-projection adapter above loaded without them), and the per-layer modules are
    there for every layer."""
    bank = llm.engine.adapters.bank.module_shapes
    assert (3, "k_proj") in bank and (4, "k_proj") not in bank and (5, "v_proj") not in bank
    assert all((i, p) in bank for i in range(6) for p in PLE)
    assert (-1, "per_layer_model_projection") in bank


def test_prefix_cache_and_chunked_prefill_over_shared_kv(gemma4: dict) -> None:
    """A second request on a shared prefix (past the window, through the KV-sharing layers and
    the wider full-attention slots) hits the prefix cache, and a prompt prefilled in chunks of
    3 gives the same output as transformers + PEFT."""
    from loraplex.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine

    name = "all_ple_r8"
    lora = LoRARequest(name, str(gemma4["adapters"][name]))
    prompt = "Multi-LoRA serving runs many adapters on one base model at once. " * 2
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for chunk in (None, 3):
        extra = {} if chunk is None else dict(max_num_batched_tokens=chunk, max_num_seqs=1)
        e = LLMEngine(EngineConfig(model=str(gemma4["model"]), dtype="float32", block_size=4,
                                   max_lora_rank=16, **extra))  # fmt: skip
        outs = []
        for rid in ("cold", "warm"):
            e.add_request(rid, prompt, greedy, lora)
            while e.has_unfinished_requests():
                outs += [o for o in e.step() if o.finished]
        ids = e.tokenize(prompt)
        want, _ = reference_greedy(gemma4["refs"][name], ids, 6)
        assert [o.outputs[0].token_ids for o in outs] == [want, want], chunk
        assert outs[0].num_cached_tokens == 0
        assert outs[1].num_cached_tokens == (len(ids) - 1) // 4 * 4 > 0
        assert e.is_idle()


def test_byte_model_and_verify_know_the_shared_and_per_layer_modules(
    gemma4: dict, capsys: pytest.CaptureFixture
) -> None:
    """``num_parameters`` and the planner count what transformers holds (no k/v in the
    KV-sharing layers, the per-layer stream's tensors); the planner's adapter counts equal what
    PEFT saved, and ``loraplex verify`` passes every adapter."""
    model = gemma4["model"]
    want = gemma4["refs"][None].num_parameters()
    assert load_model_config(model).num_parameters() == want
    shape = plan.load_model(str(model))
    assert shape.params() == want
    for name, path in gemma4["adapters"].items():
        a = plan.adapter_from_path(str(path), shape)
        assert a.file_params == a.params(shape) and not a.notes, (name, a.notes)
        argv = [str(path), "--model", str(model), "--max-tokens", "2", "--json"]
        rc = verify.main(argv)
        doc = json.loads(capsys.readouterr().out)
        assert rc == 0 and doc["verdict"] == "ok", (name, doc)


def test_values_from_keys(tmp_path: Path) -> None:
    """``attention_k_eq_v`` (the 31B's layout): the full layers' values are their keys'
    projection, over their own KV heads and head size; adapters of three ranks (v_proj where
    the sliding layers have it) in one batch, against transformers + PEFT unmerged."""
    model = make_random_model(
        tmp_path / "model", "gemma4_text", num_layers=4, seed=6, layer_types=[S, F, S, F],
        init_std=0.05, global_head_dim=32, attention_k_eq_v=True, num_global_key_value_heads=1,
    )  # fmt: skip
    specs = {"all": dict(r=8, target_modules=[*ALL_PROJ, *PLE], seed=1),
             "kv": dict(r=4, target_modules=["k_proj", "v_proj"], seed=2),
             "qo": dict(r=16, target_modules=["q_proj", "o_proj"], seed=3)}  # fmt: skip
    adapters = {n: make_random_adapter(model, tmp_path / n, **kw) for n, kw in specs.items()}
    llm = LLM(str(model), max_loras=3, max_lora_rank=16, dtype="float32", block_size=4)
    assert (1, "v_proj") not in llm.engine.adapters.bank.module_shapes  # a full layer: none
    names = [None, *adapters]
    loras = [LoRARequest(n, str(adapters[n])) if n else None for n in names]
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=3)
    outs = llm.generate(PROMPTS[: len(names)], sp, lora_request=loras)
    tok = llm.get_tokenizer()
    for name, prompt, out in zip(names, PROMPTS, outs, strict=True):
        ref = _reference(model, adapters.get(name) if name else None)
        want, ref_lp = reference_greedy(ref, tok(prompt).input_ids, N_NEW)
        assert out.outputs[0].token_ids == want, name
        assert logprob_gap(out.outputs[0].logprobs, ref_lp) < SAMPLE_TOL, name


def test_conditional_generation_serves_its_language_model(tmp_path: Path) -> None:
    """The multimodal wrapper's language model (its vision tower skipped), with an adapter on
    the per-layer modules, against transformers + PEFT."""
    model = make_random_model(
        tmp_path / "model", "gemma4", num_layers=2, seed=3, layer_types=[S, F],
        final_logit_softcapping=10.0,
    )  # fmt: skip
    text = r".*language_model.*\.(q_proj|down_proj|per_layer_input_gate|per_layer_projection)"
    adapter = make_random_adapter(model, tmp_path / "a", r=4, target_modules=text, seed=8)
    llm = LLM(str(model), max_loras=1, max_lora_rank=8, dtype="float32")
    tok = llm.get_tokenizer()
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=3)
    for lora in (None, adapter):
        ids = tok(PROMPTS[0]).input_ids
        req = LoRARequest("a", str(lora)) if lora else None
        got = llm.generate([PROMPTS[0]], sp, lora_request=req)[0].outputs[0]
        want, ref_lp = reference_greedy(_reference(model, lora), ids, N_NEW)
        assert got.token_ids == want
        assert logprob_gap(got.logprobs, ref_lp) < SAMPLE_TOL


@pytest.mark.parametrize("factor", [0.25, 1.0, 0.5])
def test_proportional_rope_equals_transformers(factor: float) -> None:
    """Gemma 4's rope on the full layers rotates the first ``factor`` of each half with
    frequencies over the whole head: the same cos/sin as transformers' function."""
    from transformers import Gemma4TextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "proportional", "partial_rotary_factor": factor, "rope_theta": 1e6}
    cfg = Gemma4TextConfig(
        head_dim=32, global_head_dim=32, num_hidden_layers=2, layer_types=[S, F],
        rope_parameters={S: {"rope_type": "default", "rope_theta": 1e4}, F: params},
    )  # fmt: skip
    inv, scale = ROPE_INIT_FUNCTIONS["proportional"](cfg, layer_type=F)
    rot = make_rotary(32, 1e6, params, torch.float32, torch.device("cpu"))
    pos = torch.arange(40)
    freqs = torch.outer(pos.float(), inv.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = rot.cos_sin(pos)
    assert scale == 1.0
    assert torch.equal(cos[:, 0], emb.cos()) and torch.equal(sin[:, 0], emb.sin())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_equals_transformers(dtype: torch.dtype) -> None:
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm as HFNorm

    g = torch.Generator().manual_seed(0)
    ref = HFNorm(48, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(1 + 0.3 * torch.randn(48, generator=g))
    ref = ref.to(dtype)
    x = (3 * torch.randn(5, 48, generator=g)).to(dtype)
    got = Float32ScaleRMSNorm(ref.weight.detach(), 1e-6)(x)
    tol = 0 if dtype == torch.bfloat16 else 1e-6  # bf16: one rounding, the same one
    assert torch.allclose(got.float(), ref(x).float(), atol=tol, rtol=tol)


def _config(**over: object) -> dict:
    text = {
        "model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"], "vocab_size": 64,
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "sliding_window": 4, "layer_types": [S, F], "per_layer_config": {},
    }  # fmt: skip
    return {**text, **over}


@pytest.mark.parametrize(
    ("over", "named"),
    [
        ({"per_layer_config": {"1": {"sliding_window": 8}}}, "layer 1 overrides"),
        ({"enable_moe_block": True}, "enable_moe_block needs num_experts"),  # the MoE class's
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
        ({"num_kv_shared_layers": 1}, "num_kv_shared_layers 1"),
    ],
)
def test_unservable_configs_are_refused_in_one_line(over: dict, named: str) -> None:
    raw = {k: v for k, v in _config(**over).items() if v is not None}
    with pytest.raises(ModelLoadError, match=named) as info:
        parse_model_config(json.loads(json.dumps(raw)))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("over", "want"),
    [
        ({}, [(16, 1, 64), (16, 1, 64)]),  # transformers 5's save of a model alike throughout
        ({"per_layer_config": {"1": {"head_dim": 32}}}, [(16, 1, 64), (32, 1, 64)]),
        ({"per_layer_config": None, "global_head_dim": 32}, [(16, 1, 64), (32, 1, 64)]),
        ({"per_layer_config": None}, [(16, 1, 64), (512, 1, 64)]),  # transformers' default
        ({"per_layer_config": None, "num_global_key_value_heads": 2, "global_head_dim": 32},
         [(16, 1, 64), (32, 1, 64)]),  # without attention_k_eq_v transformers ignores it
        ({"per_layer_config": None, "num_global_key_value_heads": 2, "global_head_dim": 32,
          "attention_k_eq_v": True}, [(16, 1, 64), (32, 2, 64)]),
        ({"num_kv_shared_layers": 2, "num_hidden_layers": 4, "layer_types": [S, F, S, F],
          "use_double_wide_mlp": True}, [(16, 1, 64)] * 2 + [(16, 1, 128)] * 2),
    ],
)  # fmt: skip
def test_layer_geometry_follows_transformers(over: dict, want: list) -> None:
    """Each layer's (head size, KV heads, MLP width), as transformers derives them."""
    raw = {k: v for k, v in _config(**over).items() if v is not None}
    assert list(parse_model_config(raw).geometry) == want


@pytest.mark.parametrize("mode", list(ON_THE_FLY))
def test_quantized_at_load(mode: str, tmp_path: Path) -> None:
    """``--quantization int8/int4`` quantizes Gemma 4's own projections as q/k/v/o (the
    per-layer stream's, a KV-sharing layer's q) and its per-layer table as the embedding (int8
    per row): a mixed batch equals transformers + PEFT on the model holding each of them
    quantized-then-dequantized."""
    model = make_random_model(
        tmp_path / "m", "gemma4_text", num_layers=4, layer_types=[S, F, S, F],
        num_kv_shared_layers=2, hidden_size_per_layer_input=32, seed=5,
    )  # fmt: skip  # int4's groups of 32 along every projection's input
    gs = ON_THE_FLY[mode]
    ref = write_dequantized(model, tmp_path / "ref", bits=8 if mode == "int8" else 4, group_size=gs)
    llm, _ = _check_mixed_batch(
        model, ref, tmp_path, adapters=QUANT_ADAPTERS, quantization=mode,
        quantization_group_size=gs,
    )  # fmt: skip
    m = llm.engine.model
    assert isinstance(m.embed_tokens_per_layer, QuantizedEmbedding)
    L = m.layers[-1]  # a KV-sharing layer: its q is its own
    assert L.qkv.nbytes < 4 * L.qkv.out_features * m.cfg.hidden_size * 0.4


def test_quantized_checkpoints_are_refused_in_one_line(tmp_path: Path) -> None:
    model = make_random_model(tmp_path / "m", "gemma4_text", num_layers=2, layer_types=[S, F])
    qdir, _ = write_gptq(model, tmp_path / "q", tmp_path / "ref", bits=8, group_size=-1)
    with pytest.raises(ModelLoadError, match=r"quantized checkpoints \(gptq") as info:
        LLM(str(qdir), dtype="float32", skip_tokenizer_init=True)
    assert "\n" not in str(info.value)


QUANT_ADAPTERS = {  # all-linear (the per-layer projections too), attention, the per-layer stream
    "all8": dict(r=8),
    "attn16": dict(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "ple4": dict(r=4, target_modules=["per_layer_input_gate", "per_layer_projection"]),
}


@pytest.fixture(scope="module")
def gemma4_tp(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Four layers (sliding, full, then two sharing the KV of layers 0 and 1, their MLPs twice
    as wide), the full layers' heads 32 wide beside the sliding layers' 16, their values their
    keys' projection over one KV head (replicated on both ranks; the sliding layers' two KV
    heads split), per-layer inputs, an odd vocabulary (uneven vocabulary cuts of the
    embedding, the head and ``embed_tokens_per_layer``); adapters of four ranks on every
    module Gemma 4 adapts."""
    root = tmp_path_factory.mktemp("gemma4_tp")
    model = make_random_model(
        root / "model", "gemma4_text", num_layers=4, seed=7, layer_types=[S, F, S, F],
        num_kv_shared_layers=2, use_double_wide_mlp=True, global_head_dim=32, init_std=0.05,
        attention_k_eq_v=True, num_global_key_value_heads=1, with_tokenizer=False,
        vocab_size=389,
    )  # fmt: skip
    specs = {**ADAPTERS, "ple_r16_layers": {**ADAPTERS["ple_r16_layers"],
                                            "layers_to_transform": [1, 3]}}  # fmt: skip
    adapters = [make_random_adapter(model, root / n, **kw) for n, kw in specs.items()]
    return {"model": model, "adapters": adapters}


@pytest.mark.parametrize("fully_sharded", [False, True])
def test_tp2_equals_tp1(gemma4_tp: dict, fully_sharded: bool) -> None:
    """Two ranks give one device's greedy tokens and logprobs (within ``LOGPROB_ATOL``) for a
    mixed batch of the base and four adapters (the per-layer projections, the full layers'
    wider heads, k_proj on layers whose values are their keys), in the default LoRA split and
    with ``--fully-sharded-loras``; each adapter really moves its row."""
    check_tp2_equals_tp1(gemma4_tp["model"], gemma4_tp["adapters"], fully_sharded)


def check_tp2_equals_tp1(model: Path, adapters: list[Path], fully_sharded: bool) -> None:
    """TP=2 gives TP=1's outputs for the base and ``adapters`` in one batch (``_run``); in
    the default LoRA split also: each adapter's row is not the base's."""
    one = _run(model, adapters, 1, max_lora_rank=16)
    two = _run(model, adapters, 2, max_lora_rank=16, fully_sharded_loras=fully_sharded)
    assert_same_outputs(one, two)
    if not fully_sharded:  # once: the adapters' rows are not the base's
        llm = LLM(str(model), dtype="float32", num_threads=1, skip_tokenizer_init=True)
        try:
            base = [o.outputs[0] for o in llm.generate(TP_PROMPTS, GREEDY)]
        finally:
            llm.engine.shutdown()
        for i in range(1, 1 + len(adapters)):
            lps = zip(one[i].logprobs, base[i].logprobs, strict=True)
            assert max(abs(x.logprob - y.logprob) for x, y in lps) > 1e-2, i


def test_rank_config_cuts_each_layer_by_its_own_shape(gemma4_tp: dict) -> None:
    """A rank's config: each layer's own head size kept, its KV heads split (two of the
    sliding layers') or replicated (the full layers' one), its MLP width halved (twice as
    wide in the KV-sharing layers); the per-layer modules whole."""
    cfg = load_model_config(gemma4_tp["model"])
    rank = Gemma4ForCausalLM.shard_config(cfg, ShardLayout.of(cfg, 1, 2))
    assert rank.geometry == ((16, 1, 64), (32, 1, 64), (16, 1, 128), (32, 1, 128))
    assert rank.kv_layer_shapes() == [(1, 16), (1, 32), (1, 16), (1, 32)]
    shapes = rank.layer_module_shapes(1)
    assert shapes["q_proj"] == (64, 2 * 32) and shapes["k_proj"] == (64, 32)
    assert shapes["o_proj"] == (64, 64) and "v_proj" not in shapes
    assert shapes["per_layer_input_gate"] == (64, 8) and shapes["per_layer_projection"] == (8, 64)
    assert rank.layer_module_shapes(3)["down_proj"] == (128, 64)
    assert "k_proj" not in rank.layer_module_shapes(3)  # a KV-sharing layer
    assert rank.outer_module_shapes()["per_layer_model_projection"] == (64, 4 * 8)


@pytest.mark.parametrize(
    ("over", "named"),
    [
        ({"attention_k_eq_v": True, "num_global_key_value_heads": 3, "per_layer_config": None},
         "layer 1: num_global_key_value_heads=3"),
        ({"per_layer_config": {"1": {"num_key_value_heads": 3}}},
         r"layer 1: per_layer_config\[1\].num_key_value_heads=3"),
    ],
)  # fmt: skip
def test_layers_that_do_not_split_are_refused_in_one_line(over: dict, named: str) -> None:
    """A layer's KV heads that neither divide nor are a multiple of the ranks, named by the
    field that sets them."""
    raw = _config(num_attention_heads=6, num_key_value_heads=2, **over)
    cfg = parse_model_config({k: v for k, v in raw.items() if v is not None})
    with pytest.raises(ModelLoadError, match=named) as info:
        Gemma4ForCausalLM.shard_config(cfg, ShardLayout.of(cfg, 0, 2))
    assert "\n" not in str(info.value)


def test_a_layer_that_does_not_split_is_refused_at_start_up(tmp_path: Path) -> None:
    """Through the engine's start (both ranks load): one line naming the field (transformers 5
    saves the full layer's KV heads as a ``per_layer_config`` override)."""
    model = make_random_model(
        tmp_path / "m", "gemma4_text", num_layers=2, layer_types=[S, F], num_heads=6,
        head_dim=16, global_head_dim=16, attention_k_eq_v=True, num_global_key_value_heads=3,
        with_tokenizer=False,
    )  # fmt: skip
    named = r"layer 1: per_layer_config\[1\]\.num_key_value_heads=3 neither divides"
    with pytest.raises(ModelLoadError, match=named) as info:
        LLM(str(model), dtype="float32", tensor_parallel_size=2, skip_tokenizer_init=True)
    assert "\n" not in str(info.value)


def test_config_defaults_follow_transformers() -> None:
    """Without ``layer_types`` / ``rope_parameters``: five sliding layers per full one, the last
    layer full, default RoPE 10k on sliding layers and proportional 0.25 at 1M on full ones."""
    cfg = parse_model_config({**_config(num_hidden_layers=8), "layer_types": None})
    assert cfg.layer_types == (S,) * 5 + (F, S, F)
    assert cfg.local_rope_theta == 1e4 and cfg.rope_theta == 1e6
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "proportional"
    assert cfg.kv_source == tuple(range(8))
