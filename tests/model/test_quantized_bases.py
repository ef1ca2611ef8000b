"""Quantized bases with full-precision adapters (issue 31): every checkpoint format and the
on-the-fly modes serve mixed batches equal to a float reference.

The reference is transformers + PEFT (each adapter merged in float32) on the same model with
every projection replaced by its dequantized weight, computed from the integers and scales
before they were packed (``loraplex.testing.quant``), so it checks loraplex's unpacking and
kernels, not a copy of them. float32 throughout: tokens equal, logprobs within the float32
tolerance of the dense mixed-batch tests (the kernels sum in another order than the GEMM).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.model.quant.weights import QuantWeight
from loraplex.testing import (
    load_merged_reference,
    logprob_gap,
    make_random_adapter,
    make_random_model,
    reference_greedy,
)
from loraplex.testing.compressed import write_compressed_tensors
from loraplex.testing.quant import write_awq, write_dequantized, write_fp8, write_gptq
from loraplex.types import ModelLoadError
from tests.engine.test_mixed_batch_architectures import PROMPTS, SAMPLE_TOL

ADAPTERS = {  # five adapters of different ranks and targets, and the base
    "all8": dict(r=8),
    "attn16": dict(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp4": dict(r=4, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "qv8": dict(r=8, target_modules=["q_proj", "v_proj"], use_rslora=True),
    "vocab8": dict(r=8, target_modules=["embed_tokens", "lm_head", "down_proj"]),
}

FORMATS = {
    "gptq-w4g32-sym": lambda f, q, r: write_gptq(f, q, r, bits=4, group_size=32, sym=True),
    "gptq-w4g32-asym-actorder": lambda f, q, r: write_gptq(
        f, q, r, bits=4, group_size=32, sym=False, act_order=True
    ),
    "gptq-w8-channel": lambda f, q, r: write_gptq(f, q, r, bits=8, group_size=-1, sym=True),
    "awq-w4g32": lambda f, q, r: write_awq(f, q, r, group_size=32),
    # compressed-tensors as llm-compressor writes it (bit-identical, loraplex.testing.compressed)
    "compressed-tensors-W4A16": lambda f, q, r: write_compressed_tensors(
        f, q, r, "W4A16", group_size=32
    ),
    "compressed-tensors-W4A16_ASYM": lambda f, q, r: write_compressed_tensors(
        f, q, r, "W4A16_ASYM", group_size=32
    ),
    "compressed-tensors-W8A16": lambda f, q, r: write_compressed_tensors(
        f, q, r, "W8A16", group_size=32
    ),
}
ON_THE_FLY = {"int8": None, "int4": 32}


def _check_mixed_batch(
    model_dir: Path,
    ref_dir: Path,
    tmp: Path,
    *,
    reference: Callable[[Path | None], object] | None = None,
    tol: float = SAMPLE_TOL,
    adapters: dict[str, dict] = ADAPTERS,
    std: float = 0.05,
    new_tokens: int = 6,
    **engine: object,
) -> tuple[LLM, dict[str, tuple[Path, list[int], torch.Tensor]]]:
    """The base and ``adapters`` (made on the float reference's shapes) in one mixed batch on
    ``model_dir`` against ``reference(adapter dir or None)`` (default: transformers + PEFT
    merged on ``ref_dir``): greedy tokens equal, logprobs within ``tol``. Returns the engine and,
    per adapter, (its directory, the prompt ids, the reference's logprobs)."""
    made = {
        name: make_random_adapter(ref_dir, tmp / f"a-{name}", seed=i, std=std, **kw)
        for i, (name, kw) in enumerate(adapters.items())
    }
    ref_of = reference or functools.partial(load_merged_reference, ref_dir)
    llm = LLM(
        model=str(model_dir), dtype="float32", enable_lora=True, max_lora_rank=16,
        max_loras=len(made), num_threads=2, **engine,
    )  # fmt: skip
    tok = llm.get_tokenizer()
    names = [None, *made]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    reqs = [None if n is None else LoRARequest(n, i + 1, str(made[n])) for i, n in enumerate(names)]
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, sp, lora_request=reqs)
    checked: dict[str, tuple[Path, list[int], torch.Tensor]] = {}
    for name, prompt, out in zip(names, prompts, outs, strict=True):
        ids = tok(prompt)["input_ids"]
        adapter = None if name is None else made[name]
        want, logprobs = reference_greedy(ref_of(adapter), ids, new_tokens)
        got = out.outputs[0]
        assert got.token_ids == want, f"{name}: {got.token_ids} != {want}"
        worst = logprob_gap(got.logprobs, logprobs)
        assert worst < tol, f"{name}: logprob diff {worst}"
        if adapter is not None:
            checked[name] = (adapter, ids, logprobs)
    return llm, checked


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def float_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp(f"float-{request.param}")
    return make_random_model(tmp / "base", request.param, hidden_size=64, intermediate_size=128)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_checkpoint_format_mixed_batch(fmt: str, float_model: Path, tmp_path: Path) -> None:
    qdir, ref = FORMATS[fmt](float_model, tmp_path / "q", tmp_path / "ref")
    llm, _ = _check_mixed_batch(qdir, ref, tmp_path)
    model = llm.engine.model
    assert model.quant is not None and fmt.startswith(model.quant.method)
    # the quantized bytes are what is resident: far below the float projections
    float_bytes = sum(
        4 * lin.out_features * lin.in_features
        for L in model.layers
        for lin in (L.qkv, L.o, L.gate_up, L.down)
    )
    quant_bytes = sum(lin.nbytes for L in model.layers for lin in (L.qkv, L.o, L.gate_up, L.down))
    assert quant_bytes < float_bytes * (0.4 if model.quant.bits == 8 else 0.25)


@pytest.mark.parametrize("mode", list(ON_THE_FLY))
def test_on_the_fly_quantization(mode: str, float_model: Path, tmp_path: Path) -> None:
    gs = ON_THE_FLY[mode]
    ref = write_dequantized(
        float_model, tmp_path / "ref", bits=8 if mode == "int8" else 4, group_size=gs
    )
    llm, _ = _check_mixed_batch(
        float_model, ref, tmp_path, quantization=mode, quantization_group_size=gs,
        lora_merge_after_steps=1,
    )  # fmt: skip
    assert llm.engine.model.quant.label == (mode if gs is None else f"{mode}-g{gs}")
    assert llm.engine.merger is None  # never merged into quantized weights


def test_every_checkpoint_format_has_a_reader() -> None:
    """A format's name is declared once (config); its reader and its tensors' names are here."""
    from loraplex.config import QUANTIZED_CHECKPOINT_FORMATS
    from loraplex.model.quant.formats import _INT_SUFFIXES, READERS

    assert set(READERS) == set(QUANTIZED_CHECKPOINT_FORMATS)
    assert set(_INT_SUFFIXES) == set(QUANTIZED_CHECKPOINT_FORMATS)


def test_quantization_refusals(float_model: Path, tmp_path: Path) -> None:
    qdir, _ = write_gptq(float_model, tmp_path / "q", tmp_path / "ref", bits=4, group_size=32)
    with pytest.raises(ModelLoadError, match="does not match the checkpoint's quant_method gptq"):
        LLM(model=str(qdir), quantization="awq", skip_tokenizer_init=True)
    with pytest.raises(ModelLoadError, match="already quantized"):
        LLM(model=str(qdir), quantization="int8", skip_tokenizer_init=True)
    with pytest.raises(ModelLoadError, match="no quantization_config"):
        LLM(model=str(float_model), quantization="gptq", skip_tokenizer_init=True)
    with pytest.raises(ModelLoadError, match="group-size 48 is not supported"):
        LLM(
            model=str(float_model),
            quantization="int4",
            quantization_group_size=48,
            skip_tokenizer_init=True,
        )
    for q in ("int8", None):
        with pytest.raises(ModelLoadError, match="applies to --quantization int4 only"):
            LLM(model=str(float_model), quantization=q, quantization_group_size=64,
                skip_tokenizer_init=True)  # fmt: skip
    cfg = (qdir / "config.json").read_text().replace('"bits": 4', '"bits": 3')
    (qdir / "config.json").write_text(cfg)
    with pytest.raises(
        ModelLoadError, match=r"quantization_config.bits=3 is not supported \(supported: 4, 8\)"
    ):
        LLM(model=str(qdir), skip_tokenizer_init=True)


def test_on_the_fly_tied_embedding_is_one_int8_matrix(tmp_path: Path) -> None:
    """A tied embedding and head quantize once: the lookup and the logits read one int8 matrix
    (per-row scales), LoRA on both still exact against the dequantized reference."""
    base = make_random_model(tmp_path / "tied", "llama", hidden_size=64, intermediate_size=128,
                             tie_word_embeddings=True)  # fmt: skip
    ref = write_dequantized(base, tmp_path / "ref", bits=4, group_size=32)
    llm, _ = _check_mixed_batch(
        base, ref, tmp_path, quantization="int4", quantization_group_size=32
    )
    model = llm.engine.model
    assert model.head.quant.q.data_ptr() == model.embed_tokens.source.q.data_ptr()  # one matrix
    assert (
        model.nbytes
        < sum(lin.nbytes for lin in (model.head, model.embed_tokens))
        + sum(L.nbytes for L in model.layers)
        + model.norm.nbytes
    )  # counted once
    vocab, hidden = model.cfg.vocab_size, model.cfg.hidden_size
    assert model.embed_tokens.nbytes == vocab * hidden + 4 * vocab  # int8 values + row scales


def test_tied_pair_in_bf16_reads_the_heads_panels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 with the panel kernel, whose Linears keep a weight only in their own layout: a tied
    embedding looks its rows up in the head's panels (bit for bit the int8 rows the logits
    multiply by), so the pair is still one matrix, counted once."""
    from safetensors.torch import load_file

    from loraplex.model.quant import kernels
    from loraplex.model.quant.cpu_kernel import usable_quant_panels

    kernel = usable_quant_panels()
    if kernel is None or not kernel.bf16_dot:
        pytest.skip("no AVX512-BF16 panel kernel on this CPU")
    # every weight on the panel kernel, whatever the start-up timing would pick on this machine
    monkeypatch.setattr(
        kernels, "choose_kernel", lambda w, d, k: kernels.KernelChoice(f"panel-int{w.bits}", {})
    )
    base = make_random_model(tmp_path / "tied", "llama", hidden_size=64, intermediate_size=128,
                             tie_word_embeddings=True, dtype=torch.bfloat16)  # fmt: skip
    llm = LLM(model=str(base), dtype="bfloat16", quantization="int4",
              quantization_group_size=32, num_threads=2)  # fmt: skip
    model = llm.engine.model
    assert isinstance(model.head, kernels.PanelQuantLinear) and model.head.quant is None
    assert model.embed_tokens.source is model.head
    table = load_file(str(base / "model.safetensors"))["model.embed_tokens.weight"]
    want = QuantWeight.quantize(table, 8, None)
    ids = torch.tensor([0, 1, 31, 32, 33, model.cfg.vocab_size - 1, 7, 7])
    assert torch.equal(model.embed_tokens[ids], want.rows(ids).to(torch.bfloat16))
    assert torch.equal(model.head.dequantize(torch.float64), want.dequantize(torch.float64))
    layers = sum(L.nbytes for L in model.layers)
    assert model.nbytes == model.head.nbytes + layers + model.norm.nbytes  # counted once
    out = llm.generate(["a b c"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


# ------------------------------------------------------------------ W8A8: quantized activations


def _activation_reference(
    ref_dir: Path, qdir: Path, adapter: Path | None, act_kind: str, lora_sees_quantized: bool
) -> object:
    """transformers + PEFT, unmerged, on the dequantized weights, with each projection's input
    quantized as the checkpoint says (int8 per token; fp8 per token or by its static
    ``input_scale``) for the base product only (``lora_sees_quantized`` False: the hook sits on
    the LoRA layer's ``base_layer``), or for the whole LoRA layer (True: what loraplex must not
    do)."""
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from loraplex.model.quant.kernels import quantize_activation
    from loraplex.model.quant.weights import ActQuant

    scales: dict[str, float] = {}
    with safe_open(str(next(qdir.glob("*.safetensors"))), "pt") as f:
        for k in f.keys():
            if k.endswith(".input_scale"):
                scales[k.removesuffix(".input_scale")] = float(f.get_tensor(k).float().max())
    model = AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    projs = {p for group in FUSED_INPUTS for p in group}
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "base_layer" and not lora_sees_quantized:
            proj_name = name.removesuffix(".base_layer")
        elif leaf in projs and (lora_sees_quantized or not hasattr(mod, "base_layer")):
            proj_name = name
        else:
            continue
        prefix, proj = proj_name[proj_name.index("model.layers.") :].rsplit(".", 1)
        # one input, one scale for a fused group: the largest (as the loader fuses them)
        fused = next(g for g in FUSED_INPUTS if proj in g)
        keys = [f"{prefix}.{p}" for p in fused if f"{prefix}.{p}" in scales]
        static = max((scales[k] for k in keys), default=None) if act_kind == "fp8" else None
        act = ActQuant(act_kind, static)

        def quantize_input(_: object, args: tuple, act: ActQuant = act) -> tuple:
            x = args[0]  # [B, S, D]: quantized per token
            return (quantize_activation(x.reshape(-1, x.shape[-1]), act).reshape(x.shape),)

        mod.register_forward_pre_hook(quantize_input)
    return model.eval()


FUSED_INPUTS = (
    ("q_proj", "k_proj", "v_proj"),
    ("o_proj",),
    ("gate_proj", "up_proj"),
    ("down_proj",),
)
"""Projections reading one input (one fused GEMM in loraplex)."""


W8A8 = {  # scheme -> writer: compressed-tensors (as llm-compressor), and quant_method fp8
    "W8A8": lambda f, q, r: write_compressed_tensors(f, q, r, "W8A8"),
    "W4A8": lambda f, q, r: write_compressed_tensors(f, q, r, "W4A8", group_size=32),
    "FP8_DYNAMIC": lambda f, q, r: write_compressed_tensors(f, q, r, "FP8_DYNAMIC"),
    "FP8": lambda f, q, r: write_compressed_tensors(f, q, r, "FP8"),
    "fp8-dynamic": lambda f, q, r: write_fp8(f, q, r, activation_scheme="dynamic"),
    "fp8-static": lambda f, q, r: write_fp8(f, q, r, activation_scheme="static"),
}


@pytest.mark.parametrize("scheme", list(W8A8))
def test_w8a8_lora_reads_unquantized_activations(scheme: str, tmp_path: Path) -> None:
    """A W8A8 (or W4A8) base quantizes each projection's input for its own product; every adapter's
    delta is computed from the unquantized input. The engine equals the reference that does so,
    and the reference that quantizes the adapter's input too is measurably different (so this
    test can tell them apart)."""
    base = make_random_model(tmp_path / "base", "llama", hidden_size=64, intermediate_size=128)
    qdir, ref = W8A8[scheme](base, tmp_path / "q", tmp_path / "ref")
    kind = "int8" if scheme in ("W8A8", "W4A8") else "fp8"
    # Engine and reference compute the projections' float32 inputs in other orders; a last-ulp
    # difference can carry an input across a rounding boundary of the activation format, which
    # moves it by one step: 1/127 of its row's absmax in int8, 2^-3 of itself in float8 e4m3.
    # One such step in one input of one projection moves a logprob by about step x |w| x |dy/dh|:
    # budgets of 1e-3 (int8) and 1e-2 (float8), both far below what quantizing the adapters'
    # input does (the contrast below must exceed ten times the budget).
    act_tol = 1e-3 if kind == "int8" else 1e-2
    adapters = {name: kw for name, kw in ADAPTERS.items() if name != "vocab8"}
    llm, checked = _check_mixed_batch(
        qdir, ref, tmp_path, adapters=adapters, std=0.3, new_tokens=4, tol=act_tol,
        reference=lambda adapter: _activation_reference(ref, qdir, adapter, kind, False),
    )  # fmt: skip
    assert llm.engine.model.quant.activations == kind
    if scheme == "W4A8":  # the VNNI kernel where this CPU has it, else the emulated product
        from loraplex.model.quant.cpu_kernel import usable_quant_panels

        panel = usable_quant_panels()
        want = "panel-w4a8" if panel is not None and panel.w4a8 else "dequant"
        assert llm.engine.model.layers[0].qkv.name == want
    separated = 0.0
    for adapter, ids, logprobs in checked.values():  # the wrong semantics, for contrast
        _, wrong = reference_greedy(_activation_reference(ref, qdir, adapter, kind, True), ids, 4)
        separated = max(separated, float((wrong - logprobs).abs().max()))
    assert separated > 10 * act_tol, f"quantizing the adapters' input changes little ({separated})"


def test_w4a8_int4_values_out_of_range_refused(tmp_path: Path) -> None:
    """A W4A8 checkpoint stores its int4 values in int8 tensors: one outside [-8, 7] would
    wrap in the 4-bit storage, so the load is refused naming the tensor."""
    from safetensors.torch import load_file, save_file

    base = make_random_model(tmp_path / "base", "llama", hidden_size=64, intermediate_size=128)
    qdir, _ = write_compressed_tensors(base, tmp_path / "q", tmp_path / "ref", "W4A8",
                                       group_size=32)  # fmt: skip
    path = qdir / "model.safetensors"
    tensors = load_file(str(path))
    key = "model.layers.1.mlp.down_proj.weight"
    tensors[key][3, 5] = 9
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"down_proj.*int4 values outside \[-8, 7\]"):
        LLM(model=str(qdir), skip_tokenizer_init=True)
