"""Adapters on fused modules (Phi-3's ``qkv_proj`` and ``gate_up_proj``): one A/B pair covers the
fused output, B's rows spanning q, k and v under GQA (gate and up).

They pass the layout check on a Phi-3 base and are split at load into their parts (A shared,
B by rows) so that the parts' deltas reassemble the fused one exactly; a Llama adapter on a
Phi-3 base and a Phi-3 adapter on a Llama base are refused with the shape / target errors of
any adapter for another base, by the loader and the registry alike; a mixed batch on Phi-3
equals transformers + PEFT with each adapter merged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.checkpoint.modules import BaseModelSpec
from loraplex.lora.adapter import load_peft_adapter, read_adapter_files
from loraplex.lora.peft.config import unservable_targets
from loraplex.registry.errors import ValidationError
from loraplex.registry.inspect import BaseModelInfo, inspect_adapter
from loraplex.testing import (
    load_merged_reference,
    make_random_adapter,
    make_random_model,
    reference_greedy,
)
from loraplex.types import AdapterError

HIDDEN, HEADS, KV_HEADS, INTER = 64, 4, 2, 128
Q, KV = HEADS * (HIDDEN // HEADS), KV_HEADS * (HIDDEN // HEADS)  # 64, 32: q + 2 kv = 128
SAMPLE_TOL = 2e-4  # float32 logprobs, as tests/engine/test_mixed_batch_architectures.py
PROMPT_TOL = 1e-4


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bases")
    return {
        # Phi3Config's pad_token_id (32000) lies outside a tiny vocabulary
        "phi3": make_random_model(root / "phi3", "phi3", num_layers=2, seed=5, pad_token_id=None),
        "llama": make_random_model(root / "llama", "llama", num_layers=2, seed=5),
    }


def _config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


def _spec(d: Path) -> BaseModelSpec:
    return BaseModelSpec.from_hf_config(_config(d))


def test_phi3_spec_names_the_fused_modules(bases: dict[str, Path]) -> None:
    spec = _spec(bases["phi3"])
    assert spec.fused == ("qkv_proj", "gate_up_proj")
    assert spec.adapter_shapes == {
        "qkv_proj": (HIDDEN, Q + 2 * KV),
        "o_proj": (Q, HIDDEN),
        "gate_up_proj": (HIDDEN, 2 * INTER),
        "down_proj": (INTER, HIDDEN),
    }
    assert spec.fused_rows("qkv_proj") == (
        ("q_proj", 0, Q),
        ("k_proj", Q, Q + KV),
        ("v_proj", Q + KV, Q + 2 * KV),
    )
    assert spec.fused_rows("gate_up_proj") == (
        ("gate_proj", 0, INTER),
        ("up_proj", INTER, 2 * INTER),
    )
    assert _spec(bases["llama"]).fused == ()
    assert unservable_targets(["qkv_proj", "gate_up_proj", "o_proj", "c_attn"]) == ["c_attn"]


@pytest.mark.parametrize(
    "targets", ["all-linear", ["qkv_proj", "gate_up_proj"]], ids=["all-linear", "fused-list"]
)
def test_fused_adapter_splits_exactly(
    bases: dict[str, Path], tmp_path: Path, targets: str | list[str]
) -> None:
    """Each part's (B rows) @ A, stacked in row order, is the fused module's B @ A bit for bit;
    A is one tensor shared by the parts (counted once in nbytes)."""
    d = make_random_adapter(bases["phi3"], tmp_path / "a", r=8, target_modules=targets, seed=1)
    adapter = load_peft_adapter(d, _spec(bases["phi3"]))
    _, tensors = read_adapter_files(d)
    prefix = "base_model.model.model.layers"
    split = {
        "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    }
    for layer in range(2):
        for module, parts in split.items():
            a = tensors[f"{prefix}.{layer}.{module}.lora_A.weight"]  # [r, D]
            b = tensors[f"{prefix}.{layer}.{module}.lora_B.weight"]  # [fused d_out, r]
            got = [adapter.weights[(layer, p)] for p in parts]
            assert all(w.a is got[0].a for w in got)  # one A
            assert torch.equal(got[0].a, a)
            assert torch.equal(torch.cat([w.b for w in got]), b)
            assert torch.equal(torch.cat([w.b @ w.a for w in got]), b @ a)
    n_fused = 4 if targets == "all-linear" else 2  # (o_proj, down_proj) beside the fused ones
    assert len(adapter.weights) == 2 * (5 if n_fused == 2 else 7)
    assert adapter.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())


def _refusals(adapter: Path, base: Path) -> tuple[str, str, str]:
    """(loader message, registry reason, registry message) for ``adapter`` on ``base``."""
    with pytest.raises(AdapterError) as loader:
        load_peft_adapter(adapter, _spec(base))
    with pytest.raises(ValidationError) as registry:
        inspect_adapter(adapter, BaseModelInfo(base.name, "0" * 64, _config(base)), max_rank=64)
    return str(loader.value), registry.value.reason, str(registry.value)


def test_adapter_for_the_other_architecture_is_refused(
    bases: dict[str, Path], tmp_path: Path
) -> None:
    llama_adapter = make_random_adapter(bases["llama"], tmp_path / "llama_a", r=4, seed=2)
    phi3_adapter = make_random_adapter(bases["phi3"], tmp_path / "phi3_a", r=4, seed=3)
    msg, reason, why = _refusals(llama_adapter, bases["phi3"])
    assert reason == "unsupported_target" and "\n" not in msg
    assert msg.endswith(
        "mlp.gate_proj.lora_A.weight': target module 'gate_proj' is not supported "
        "(supported: qkv_proj, o_proj, gate_up_proj, down_proj, embed_tokens, lm_head)"
    )
    assert msg == f"adapter {llama_adapter}: {why.removeprefix(f'{reason}: ')}"  # same words
    msg, reason, why = _refusals(phi3_adapter, bases["llama"])
    assert reason == "unsupported_target" and "\n" not in msg
    assert msg.endswith(
        "mlp.gate_up_proj.lora_A.weight': target module 'gate_up_proj' is not supported "
        "(supported: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, "
        "embed_tokens, lm_head)"
    )
    assert msg == f"adapter {phi3_adapter}: {why.removeprefix(f'{reason}: ')}"


def test_fused_adapter_with_the_wrong_rows_is_refused(
    bases: dict[str, Path], tmp_path: Path
) -> None:
    """A qkv_proj B of another base's q + 2 kv rows is the usual shape mismatch."""
    from safetensors.torch import save_file

    src = make_random_adapter(
        bases["phi3"], tmp_path / "a", r=4, target_modules=["qkv_proj"], seed=4
    )
    cfg, tensors = read_adapter_files(src)
    key = "base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"
    tensors = {**tensors, key: tensors[key][: Q + KV].clone()}  # [q + kv, r]: no v rows
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    msg, reason, _ = _refusals(bad, bases["phi3"])
    assert reason == "shape_mismatch"
    assert f"expected [d_out={Q + 2 * KV}, r] (adapter made for a different base model?)" in msg


# ------------------------------------------------------------------------ mixed batch on Phi-3

ADAPTERS = {
    "qkv_r4": dict(r=4, lora_alpha=8, target_modules=["qkv_proj"], seed=11),
    "gate_up_r16_rslora": dict(
        r=16, lora_alpha=8, target_modules=["gate_up_proj"], use_rslora=True, seed=12
    ),
    "all_linear_r8": dict(r=8, target_modules="all-linear", seed=13),
    "proj_list_r8_layer1": dict(
        r=8,
        target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
        layers_to_transform=[1],
        seed=15,
    ),
    "fused_vocab_r8": dict(
        r=8,
        target_modules=["qkv_proj", "gate_up_proj", "lm_head", "embed_tokens"],
        rank_pattern={"lm_head": 4, "qkv_proj": 2},
        std=0.1,
        seed=14,
    ),
}
PROMPTS = ["What is the capital of France?", "def add(a, b):", "Hello world! How are you"]
N_NEW = 8


def test_mixed_batch_on_phi3_equals_merged_references(
    bases: dict[str, Path], tmp_path: Path
) -> None:
    model = bases["phi3"]
    paths = {n: make_random_adapter(model, tmp_path / n, **kw) for n, kw in ADAPTERS.items()}
    refs = {n: load_merged_reference(model, paths.get(n)) for n in [None, *paths]}
    llm = LLM(str(model), max_loras=len(paths), max_lora_rank=16, dtype="float32")
    names = [None, *paths]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    loras = [LoRARequest(n, str(paths[n])) if n else None for n in names]
    sp = SamplingParams(
        temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=5, prompt_logprobs=3
    )
    outs = llm.generate(prompts, sp, lora_request=loras)
    tok = llm.get_tokenizer()
    for prompt, name, out in zip(prompts, names, outs, strict=True):
        ids = tok(prompt).input_ids
        want, ref_lp = reference_greedy(refs[name], ids, N_NEW)
        got = out.outputs[0]
        assert got.token_ids == want, name
        worst = max(
            abs(v - float(ref_lp[s, t]))
            for s, lp in enumerate(got.logprobs)
            for t, v in lp.top.items()
        )
        assert worst < SAMPLE_TOL, (name, worst)
        with torch.no_grad():
            want_prompt = torch.log_softmax(refs[name](torch.tensor([ids])).logits[0].float(), -1)
        assert out.prompt_logprobs is not None
        worst = max(
            abs(v - float(want_prompt[i, t]))
            for i, entry in enumerate(out.prompt_logprobs[1:])
            for t, v in entry.items()  # type: ignore[union-attr]
        )
        assert worst < PROMPT_TOL, (name, worst)
        # each adapter moves the first step's logprobs (non-zero B): none is a silent no-op
        if name is not None:
            base_lp = reference_greedy(refs[None], ids, 1)[1][0]
            assert (ref_lp[0] - base_lp).abs().max() > 1e-3, name
    assert llm.engine.is_idle()
