"""Gemma 2, Gemma 3 text and Gemma 3's language model (``Gemma3ForConditionalGeneration``)
against transformers: base-model logits in float32 for prompts longer than the sliding window,
with alternating window/global layers, the local RoPE base, q/k norms and soft-caps that bite;
whole prefills, chunked prefills over a cached prefix and decode steps past the window. Also
the config hooks (old and new Gemma 3 layouts) and the text-only loading of a multimodal
checkpoint."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex import ModelLoadError
from loraplex.kv.cache import PagedKVCache
from loraplex.model.attention import (
    AttentionMetadata,
    PrefillSpan,
    WindowMasks,
    causal_mask,
    decode_mask,
)
from loraplex.model.config import load_model_config, parse_model_config
from loraplex.model.decoder import DecoderForCausalLM, ForwardBatch
from loraplex.model.gemma import GemmaConfig
from loraplex.model.loading import load_model
from loraplex.testing import load_merged_reference, make_random_model

CPU = torch.device("cpu")
WINDOW = 8
PROMPT_LEN = 24  # three windows
BLOCK = 4
ALTERNATE = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
TOL = dict(rtol=1e-4, atol=1e-4)  # float32 through 4 layers, as the Llama numerics tests

FAMILIES: dict[str, dict] = {
    # attention and final soft-caps small enough to bite; query_pre_attn_scalar != head_dim
    "gemma2": dict(
        arch="gemma2",
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
        query_pre_attn_scalar=24,
    ),
    # q/k norms, local rope base 10k on sliding layers, linear-scaled 1M base on global ones
    "gemma3_text": dict(
        arch="gemma3_text",
        final_logit_softcapping=3.0,
        query_pre_attn_scalar=24,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
        },
    ),
    # the language model of a vision-language checkpoint (a tiny SigLIP tower beside it)
    "gemma3": dict(arch="gemma3", query_pre_attn_scalar=24),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    spec = dict(FAMILIES[request.param])
    d = make_random_model(
        tmp_path_factory.mktemp(request.param),
        spec.pop("arch"),
        num_layers=4,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=ALTERNATE,
        with_tokenizer=False,
        vocab_size=96,
        seed=7,
        **spec,
    )
    return {"name": request.param, "dir": d, "ref": load_merged_reference(d, None)}


def _load(d: Path) -> DecoderForCausalLM:
    return load_model(d, load_model_config(d), torch.float32, CPU)


def _step(
    model: DecoderForCausalLM, start: int, end: int, ids: list[int], decode: bool
) -> ForwardBatch:
    """One sequence's positions ``[start, end)`` (cache slots = positions) as a ForwardBatch
    whose masks are built as the runner builds them: the global ones and one set per window."""
    n = end - start
    meta = AttentionMetadata(slot_mapping=torch.arange(start, end))
    if decode:
        assert n == 1
        nblk = -(-end // BLOCK)
        meta.decode_block_table = torch.arange(nblk)[None, :]  # [1, nblk]
        meta.decode_tokens = torch.tensor([0])
        meta.decode_all = True
        lens = torch.tensor([end])
        meta.decode_mask = decode_mask(lens, nblk * BLOCK)
        meta.decode_lens = lens
        meta.windowed = [
            WindowMasks(decode=decode_mask(lens, nblk * BLOCK, w), size=w) for w in model.windows
        ]
    elif start == 0:
        meta.prefills = [PrefillSpan(0, n)]
        meta.windowed = [
            WindowMasks(prefill=[causal_mask(0, n, w) if n > w else None]) for w in model.windows
        ]
    else:
        mask = causal_mask(start, end)
        meta.prefills = [PrefillSpan(0, n, torch.arange(end), mask)]
        meta.windowed = [WindowMasks(prefill=[causal_mask(start, end, w)]) for w in model.windows]
    return ForwardBatch(
        input_ids=torch.tensor(ids[start:end]),
        positions=torch.arange(start, end),
        attn=meta,
        logits_indices=torch.arange(n),
    )


def _logits(model: DecoderForCausalLM, ids: list[int], cuts: list[int]) -> torch.Tensor:
    """Logits [len(ids), V] of every position, run as the chunks between ``cuts`` (a chunk of
    one token after the first is a decode step)."""
    c = model.cfg
    cache = PagedKVCache(c.num_layers, 16, BLOCK, c.num_kv_heads, c.head_dim, torch.float32, CPU)
    rows = []
    for start, end in itertools.pairwise(cuts):
        batch = _step(model, start, end, ids, decode=start > 0 and end - start == 1)
        rows.append(model.forward(batch, cache))
    return torch.cat(rows)


def _ids(seed: int = 0) -> list[int]:
    return torch.randint(
        3, 96, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


@torch.no_grad()
def _hf_logits(ref: object, ids: list[int]) -> torch.Tensor:
    return ref(torch.tensor([ids])).logits[0].float()  # type: ignore[operator]


WHOLE = [0, PROMPT_LEN]
CHUNKED = [0, 5, 17, *range(18, PROMPT_LEN + 1)]  # fresh 5, 12 over a cached prefix, 7 decodes


@pytest.mark.parametrize("cuts", [WHOLE, CHUNKED], ids=["whole-prefill", "chunked-decode"])
def test_logits_equal_transformers(family: dict, cuts: list[int]) -> None:
    model = _load(family["dir"])
    assert model.windows == (WINDOW,)
    assert [L.window for L in model.layers] == [0, None, 0, None]
    ids = _ids()
    got = _logits(model, ids, cuts)
    torch.testing.assert_close(got, _hf_logits(family["ref"], ids), **TOL)


def _variant(src: Path, dst: Path, **text_fields: object) -> Path:
    """``src``'s weights with config fields changed (in ``text_config`` for a multimodal one)."""
    dst.mkdir()
    raw = json.loads((src / "config.json").read_text())
    if "text_config" in raw:
        raw["text_config"] = {**raw["text_config"], **text_fields}
    else:
        raw = {**raw, **text_fields}
    (dst / "config.json").write_text(json.dumps(raw))
    save_file(load_file(str(src / "model.safetensors")), str(dst / "model.safetensors"))
    return dst


def test_window_and_softcaps_change_the_logits(family: dict, tmp_path: Path) -> None:
    """The prompt crosses the window and the caps bite: without them, other logits."""
    ids = _ids(1)
    got = _logits(_load(family["dir"]), ids, WHOLE)
    unwindowed = _load(_variant(family["dir"], tmp_path / "nowin", sliding_window=4 * PROMPT_LEN))
    assert not torch.allclose(got, _logits(unwindowed, ids, WHOLE), **TOL)
    spec = FAMILIES[family["name"]]
    caps = [k for k in ("attn_logit_softcapping", "final_logit_softcapping") if k in spec]
    for key in caps:
        uncapped = _load(_variant(family["dir"], tmp_path / key, **{key: None}))
        assert not torch.allclose(got, _logits(uncapped, ids, WHOLE), **TOL), key
    if "final_logit_softcapping" in spec:
        assert float(got.abs().max()) <= spec["final_logit_softcapping"]


# ----------------------------------------------------------------------------------- config


def _gemma3_raw(**fields: object) -> dict:
    base = {
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 7,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 96,
        "sliding_window": 512,
    }
    return {**base, **fields}


def test_gemma3_config_layouts() -> None:
    """The layout before ``rope_parameters`` (a hub Gemma 3 config.json) and the new one."""
    old = parse_model_config(
        _gemma3_raw(
            rope_theta=1e6,
            rope_local_base_freq=10000.0,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            sliding_window_pattern=6,
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=256,
        )
    )
    assert isinstance(old, GemmaConfig)
    assert old.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    assert (old.rope_theta, old.local_rope_theta) == (1e6, 10000.0)
    assert old.rope_scaling == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert old.local_rope_scaling is None
    assert (old.hidden_act, old.tie_word_embeddings, old.query_pre_attn_scalar) == (
        "gelu_pytorch_tanh",
        True,
        256.0,
    )
    new = parse_model_config(
        _gemma3_raw(
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            },
            layer_types=["full_attention"] * 7,
        )
    )
    assert new.layer_types == ("full_attention",) * 7 and new.rope_scaling is None
    gemma2 = parse_model_config({**_gemma3_raw(), "architectures": ["Gemma2ForCausalLM"]})
    assert gemma2.layer_types[:3] == ("sliding_attention", "full_attention", "sliding_attention")
    with pytest.raises(ModelLoadError, match="use_bidirectional_attention"):
        parse_model_config(_gemma3_raw(use_bidirectional_attention=True))
    with pytest.raises(ModelLoadError, match="unsupported rope_scaling type 'dynamic'"):
        parse_model_config(
            _gemma3_raw(
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                    "full_attention": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4.0},
                }
            )
        )


# ---------------------------------------------------------------------------------- loading


def test_conditional_generation_loads_only_the_text_weights(tmp_path: Path) -> None:
    d = make_random_model(
        tmp_path / "vlm", "gemma3", num_layers=2, head_dim=16, with_tokenizer=False, vocab_size=96
    )
    tensors = load_file(str(d / "model.safetensors"))
    vision = [n for n in tensors if n.startswith(("vision_tower.", "multi_modal_projector."))]
    assert vision and any(n.startswith("language_model.model.layers.") for n in tensors)
    model = _load(d)
    assert model.cfg.model_type == "gemma3" and model.cfg.final_logit_softcapping is None
    assert torch.equal(model.embed_tokens, tensors["language_model.model.embed_tokens.weight"])
    # the newer layout of the same checkpoint loads the same weights
    newer = {
        n.replace("language_model.model.", "model.language_model.").replace(
            "vision_tower.", "model.vision_tower."
        ): t
        for n, t in tensors.items()
    }
    (tmp_path / "newer").mkdir()
    (tmp_path / "newer" / "config.json").write_text((d / "config.json").read_text())
    save_file(newer, str(tmp_path / "newer" / "model.safetensors"))
    again = _load(tmp_path / "newer")
    assert torch.equal(again.layers[1].post_mlp.weight, model.layers[1].post_mlp.weight)
    assert torch.equal(again.embed_tokens, model.embed_tokens)
    rogue = "language_model.model.layers.0.self_attn.rogue.weight"
    (tmp_path / "rogue").mkdir()
    (tmp_path / "rogue" / "config.json").write_text((d / "config.json").read_text())
    save_file({**tensors, rogue: torch.zeros(3)}, str(tmp_path / "rogue" / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=f"unexpected tensor '{rogue}'"):
        _load(tmp_path / "rogue")
