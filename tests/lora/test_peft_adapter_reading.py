"""Reading and validating PEFT LoRA adapter directories (loraplex.lora.adapter).

PEFT itself is the reference: the parsed factors and scales must equal what a loaded PeftModel
holds, and ``W + scale * B @ A`` must equal PEFT's ``merge_and_unload`` weights.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.checkpoint.modules import (
    PROJ_NAMES,
    VOCAB_LAYER,
    VOCAB_MODULES,
    BaseModelSpec,
    block_of,
    projection_shapes,
)
from loraplex.lora.adapter import (
    LoRAAdapter,
    compute_adapter_digest,
    load_peft_adapter,
    read_adapter_files,
)
from loraplex.lora.peft.config import UNSUPPORTED_FIELDS
from loraplex.testing import (
    ALL_PROJ,
    ATTN_PROJ,
    MLP_PROJ,
    load_merged_reference,
    make_random_adapter,
    make_random_model,
)
from loraplex.types import AdapterError

NUM_LAYERS = 3
PREFIX = "base_model.model.model.layers"


# --------------------------------------------------------------------------- fixtures, helpers


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Llama: hidden 64, 3 layers, GQA (k/v d_out 32 != q d_out 64), MLP 128."""
    return make_random_model(
        tmp_path_factory.mktemp("base"),
        hidden_size=64,
        num_layers=NUM_LAYERS,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        with_tokenizer=False,
    )


@pytest.fixture(scope="module")
def spec(base_dir: Path) -> BaseModelSpec:
    return BaseModelSpec.from_hf_config(json.loads((base_dir / "config.json").read_text()))


@pytest.fixture(scope="module")
def default_adapter(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An all-linear r=8 adapter in safetensors format, shared by read-only tests."""
    return make_random_adapter(base_dir, tmp_path_factory.mktemp("ad") / "my-adapter", r=8)


def peft_reference(base_dir: Path, adapter_dir: Path) -> dict[tuple[int, str], tuple]:
    """(layer, proj) -> (A, B, scale, r) as a PeftModel loaded from ``adapter_dir`` holds them."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir))
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, LoraLayer) and "default" in mod.r:
            parts = name.split(".")
            if parts[-1] in VOCAB_MODULES:
                key = (VOCAB_LAYER, parts[-1])
            else:
                key = (int(parts[parts.index("layers") + 1]), parts[-1])
            if "default" in mod.lora_embedding_A:  # nn.Embedding: A [r, vocab], B [hidden, r]
                a, b = mod.lora_embedding_A["default"], mod.lora_embedding_B["default"]
            else:
                a, b = mod.lora_A["default"].weight, mod.lora_B["default"].weight
            out[key] = (
                a.detach().clone(),
                b.detach().clone(),
                mod.scaling["default"],
                mod.r["default"],
            )
    return out


def assert_matches_peft(adapter: LoRAAdapter, ref: dict[tuple[int, str], tuple]) -> None:
    assert set(adapter.weights) == set(ref)
    for key, (a, b, scale, r) in ref.items():
        w = adapter.weights[key]
        assert w.rank == r, key
        assert w.scale == pytest.approx(scale, rel=1e-12), key
        torch.testing.assert_close(w.a, a, rtol=0, atol=0)
        torch.testing.assert_close(w.b, b, rtol=0, atol=0)


def hand_config(**overrides: Any) -> dict[str, Any]:
    """A minimal valid adapter_config.json: r=4, alpha 8, q_proj+v_proj, all layers."""
    cfg: dict[str, Any] = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }
    cfg.update(overrides)
    return cfg


def module_name(layer: int, proj: str) -> str:
    block = "self_attn" if proj in ATTN_PROJ else "mlp"
    return f"{PREFIX}.{layer}.{block}.{proj}"


def hand_tensors(
    spec: BaseModelSpec,
    layers: range | list[int] = range(NUM_LAYERS),
    projs: tuple[str, ...] = ("q_proj", "v_proj"),
    r: int = 4,
    infix: str = "",
) -> dict[str, torch.Tensor]:
    """Random, correctly shaped lora_A/lora_B tensors keyed as PEFT saves them."""
    gen = torch.Generator().manual_seed(1)
    out = {}
    for layer in layers:
        for proj in projs:
            d_in, d_out = spec.module_shapes[proj]
            out[f"{module_name(layer, proj)}.lora_A{infix}.weight"] = torch.randn(
                r, d_in, generator=gen
            )
            out[f"{module_name(layer, proj)}.lora_B{infix}.weight"] = torch.randn(
                d_out, r, generator=gen
            )
    return out


def write_adapter(
    out_dir: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], fmt: str = "st"
) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "adapter_config.json").write_text(json.dumps(config))
    if fmt == "st":
        save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    else:
        torch.save(tensors, str(out_dir / "adapter_model.bin"))
    return out_dir


def assert_refused(path: Path, spec: BaseModelSpec, *needles: str, **kwargs: Any) -> str:
    """load_peft_adapter raises AdapterError naming the path and every needle; returns message."""
    with pytest.raises(AdapterError) as info:
        load_peft_adapter(path, spec, **kwargs)
    msg = str(info.value)
    assert str(path) in msg
    for needle in needles:
        assert needle in msg, (needle, msg)
    return msg


# --------------------------------------------------------------------------- agreement with PEFT


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"target_modules": "all-linear"}, id="all-linear"),
        pytest.param({"target_modules": ATTN_PROJ}, id="attention"),
        pytest.param({"target_modules": MLP_PROJ, "r": 4, "lora_alpha": 4}, id="mlp"),
        pytest.param(
            {"target_modules": r".*\.layers\.[02]\.(self_attn\.(q|v)|mlp\.down)_proj"},
            id="regex-string",
        ),
        pytest.param({"target_modules": ALL_PROJ, "layers_to_transform": [0, 2]}, id="layers-list"),
        pytest.param(
            {"target_modules": ["q_proj", "down_proj"], "layers_to_transform": 1}, id="layers-int"
        ),
        pytest.param(
            {
                "r": 8,
                "rank_pattern": {"q_proj": 4, "layers.1.mlp.down_proj": 2},
                # "self_attn" is no suffix of any module key: PEFT ignores it, so must we
                "alpha_pattern": {
                    "self_attn": 11,
                    "v_proj": 3.0,
                    r"layers\.2\.self_attn\.o_proj": 5,
                },
            },
            id="rank-alpha-pattern",
        ),
        pytest.param({"r": 16, "lora_alpha": 8, "use_rslora": True}, id="rslora"),
        pytest.param(
            {
                "r": 8,
                "target_modules": ["q_proj", "lm_head", "embed_tokens"],
                "rank_pattern": {"lm_head": 4, "embed_tokens": 6},
                "alpha_pattern": {"embed_tokens": 3.0},
            },
            id="lm-head-and-embedding",
        ),
        pytest.param(
            {"r": 4, "lora_alpha": 8, "use_rslora": True, "target_modules": ["lm_head"]},
            id="lm-head-only-rslora",
        ),
        pytest.param(
            {
                "r": 8,
                "use_rslora": True,
                "rank_pattern": {"k_proj": 2},
                "alpha_pattern": {"up_proj": 7},
            },
            id="rslora-pattern",
        ),
    ],
)
def test_matches_peft(
    base_dir: Path, spec: BaseModelSpec, tmp_path: Path, kwargs: dict[str, Any]
) -> None:
    adapter_dir = make_random_adapter(base_dir, tmp_path / "ad", **kwargs)
    adapter = load_peft_adapter(adapter_dir, spec)
    ref = peft_reference(base_dir, adapter_dir)
    assert ref, "PEFT adapted nothing: the case is broken"
    assert_matches_peft(adapter, ref)
    assert adapter.target_modules == tuple(sorted({p for _, p in ref}))
    assert adapter.rank == max(r for *_, r in ref.values())


def test_peft_copies_of_the_base_embedding_are_not_kept(
    base_dir: Path, spec: BaseModelSpec, tmp_path: Path
) -> None:
    """PEFT saves the base's embedding / head matrices beside a LoRA on them
    (save_embedding_layers="auto"): checked against the base's shape, then left out, and the
    served factors own their memory (the read buffer holding the copies can go)."""
    d = make_random_adapter(
        base_dir, tmp_path / "ad", r=4, target_modules=["q_proj", "lm_head", "embed_tokens"]
    )
    names = set(load_file(str(d / "adapter_model.safetensors")))
    copies = {f"{EMB}.base_layer.weight", "base_model.model.lm_head.base_layer.weight"}
    assert copies <= names
    adapter = load_peft_adapter(d, spec)
    assert set(adapter.weights) >= {(VOCAB_LAYER, "embed_tokens"), (VOCAB_LAYER, "lm_head")}
    owned = sum(t.untyped_storage().nbytes() for w in adapter.weights.values() for t in (w.a, w.b))
    assert owned == adapter.nbytes


def test_scale_values(base_dir: Path, spec: BaseModelSpec, tmp_path: Path) -> None:
    """Scale is alpha/r, alpha/sqrt(r) with rsLoRA, with per-module pattern rank and alpha."""
    plain = make_random_adapter(
        base_dir,
        tmp_path / "plain",
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "up_proj"],
        rank_pattern={"up_proj": 2},
        alpha_pattern={"layers.0.self_attn.q_proj": 4},
    )
    w = load_peft_adapter(plain, spec).weights
    assert w[(0, "q_proj")].scale == 4 / 8
    assert w[(1, "q_proj")].scale == 16 / 8
    assert w[(1, "up_proj")].scale == 16 / 2 and w[(1, "up_proj")].rank == 2
    rs = make_random_adapter(
        base_dir, tmp_path / "rs", r=16, lora_alpha=8, use_rslora=True, target_modules=["v_proj"]
    )
    w = load_peft_adapter(rs, spec).weights
    assert all(m.scale == pytest.approx(8 / math.sqrt(16)) for m in w.values())


def test_merged_weights_equal_peft_merge_and_unload(
    base_dir: Path, spec: BaseModelSpec, tmp_path: Path
) -> None:
    """Pins the semantics: W_eff = W + scale * B @ A, exactly what merge_and_unload computes."""
    adapter_dir = make_random_adapter(
        base_dir,
        tmp_path / "ad",
        r=8,
        lora_alpha=12,
        use_rslora=True,
        rank_pattern={"gate_proj": 4},
        alpha_pattern={"o_proj": 3},
        std=0.2,
    )
    adapter = load_peft_adapter(adapter_dir, spec)
    base = load_file(str(base_dir / "model.safetensors"))
    merged = load_merged_reference(base_dir, adapter_dir).state_dict()
    for layer in range(spec.num_layers):
        for proj in PROJ_NAMES:
            key = (
                f"model.layers.{layer}.{'self_attn' if proj in ATTN_PROJ else 'mlp'}.{proj}.weight"
            )
            w = adapter.weights[(layer, proj)]
            ours = base[key] + w.scale * (w.b @ w.a)  # [d_out, d_in]
            assert not torch.equal(base[key], merged[key]), "adapter must change the weight"
            torch.testing.assert_close(ours, merged[key], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- the format tables


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({}, id="tiny-gqa"),
        pytest.param({"head_dim": 32, "num_key_value_heads": 1}, id="explicit-head-dim"),
        pytest.param({"num_key_value_heads": None}, id="mha-default-kv-heads"),
    ],
)
def test_projection_shapes_are_what_transformers_builds(
    base_dir: Path, overrides: dict[str, Any]
) -> None:
    """The one table of projection shapes (loader, registry and planner all use it) equals the
    nn.Linear weights transformers builds from the same config.json."""
    from transformers import LlamaConfig, LlamaForCausalLM

    raw = {**json.loads((base_dir / "config.json").read_text()), **overrides}
    raw = {k: v for k, v in raw.items() if v is not None}
    spec = BaseModelSpec.from_hf_config(raw)
    hf = {k: v for k, v in raw.items() if k not in ("architectures", "transformers_version")}
    model = LlamaForCausalLM(LlamaConfig(**hf))
    layers = model.model.layers
    assert spec.num_layers == len(layers)
    assert set(spec.module_shapes) == set(PROJ_NAMES)
    for proj, (d_in, d_out) in spec.module_shapes.items():
        weight = getattr(getattr(layers[0], block_of(proj)), proj).weight  # [d_out, d_in]
        assert tuple(weight.shape) == (d_out, d_in), proj
    assert projection_shapes(*_dims(raw)) == spec.module_shapes


def _dims(raw: dict[str, Any]) -> tuple[int, int, int, int, int]:
    heads = raw["num_attention_heads"]
    hd = raw.get("head_dim") or raw["hidden_size"] // heads
    kv = raw.get("num_key_value_heads") or heads
    return raw["hidden_size"], heads, kv, hd, raw["intermediate_size"]


def test_every_refused_config_field_is_digested() -> None:
    """Unsupported variants are part of the digest, so if one is ever supported its adapters
    can never share a digest with plain LoRA."""
    from loraplex.lora.digest import _DIGEST_FIELDS

    assert set(UNSUPPORTED_FIELDS) <= set(_DIGEST_FIELDS)
    assert {"init_lora_weights", "bias"} <= set(_DIGEST_FIELDS)


# --------------------------------------------------------------------------- identity, dtype


def test_name_revision_and_dtype(default_adapter: Path, spec: BaseModelSpec) -> None:
    adapter = load_peft_adapter(default_adapter, spec)
    assert adapter.ref.name == "my-adapter"
    assert adapter.ref.revision == adapter.ref.sha256[:12]
    assert adapter.path == str(default_adapter)
    assert adapter.config["peft_type"] == "LORA"
    assert adapter.target_modules == tuple(sorted(PROJ_NAMES))
    assert adapter.rank == 8
    params = sum(8 * (d_in + d_out) for d_in, d_out in spec.module_shapes.values()) * NUM_LAYERS
    assert adapter.nbytes == params * 4

    half = load_peft_adapter(
        default_adapter, spec, name="x", revision="v2", dtype=torch.bfloat16, max_lora_rank=8
    )
    assert (half.ref.name, half.ref.revision) == ("x", "v2")
    assert half.ref.sha256 == adapter.ref.sha256  # identity is of the stored weights
    assert half.nbytes == params * 2
    for key, w in half.weights.items():
        assert w.a.dtype == w.b.dtype == torch.bfloat16
        torch.testing.assert_close(w.a, adapter.weights[key].a.to(torch.bfloat16))


def test_adapter_name_infix_accepted(spec: BaseModelSpec, tmp_path: Path) -> None:
    plain = write_adapter(tmp_path / "plain", hand_config(), hand_tensors(spec))
    infix = write_adapter(tmp_path / "infix", hand_config(), hand_tensors(spec, infix=".default"))
    a, b = load_peft_adapter(plain, spec), load_peft_adapter(infix, spec)
    assert (
        set(a.weights) == set(b.weights) == {(i, p) for i in range(3) for p in ("q_proj", "v_proj")}
    )
    for key in a.weights:
        torch.testing.assert_close(a.weights[key].a, b.weights[key].a, rtol=0, atol=0)


def test_digest_same_for_bin_and_safetensors(
    base_dir: Path, spec: BaseModelSpec, tmp_path: Path
) -> None:
    st = make_random_adapter(base_dir, tmp_path / "st", seed=3, save_format="safetensors")
    pt = make_random_adapter(base_dir, tmp_path / "pt", seed=3, save_format="bin")
    assert (pt / "adapter_model.bin").is_file() and not (pt / "adapter_model.safetensors").exists()
    a, b = load_peft_adapter(st, spec), load_peft_adapter(pt, spec)
    assert a.ref.sha256 == b.ref.sha256
    for key in a.weights:
        torch.testing.assert_close(a.weights[key].b, b.weights[key].b, rtol=0, atol=0)
    other = make_random_adapter(base_dir, tmp_path / "other", seed=4)
    assert load_peft_adapter(other, spec).ref.sha256 != a.ref.sha256


def test_digest_canonical_form(default_adapter: Path) -> None:
    config, tensors = read_adapter_files(default_adapter)
    digest = compute_adapter_digest(config, tensors)
    assert len(digest) == 64 and int(digest, 16) >= 0

    # key order and non-math config fields do not matter; equal math spelled differently neither
    reordered = dict(reversed(list(tensors.items())))
    assert compute_adapter_digest(dict(reversed(list(config.items()))), reordered) == digest
    cosmetic = {
        **config,
        "base_model_name_or_path": "elsewhere",
        "peft_version": "9.9",
        "revision": "x",
    }
    assert compute_adapter_digest(cosmetic, tensors) == digest
    respelled = {
        **config,
        "lora_alpha": float(config["lora_alpha"]),
        "target_modules": list(reversed(config["target_modules"])),
        "rank_pattern": None,
    }
    assert compute_adapter_digest(respelled, tensors) == digest

    # any changed weight element, dtype or math config field changes the digest
    name = sorted(tensors)[5]
    changed = dict(tensors)
    changed[name] = tensors[name].clone()
    changed[name][1, 2] += 1e-6
    assert compute_adapter_digest(config, changed) != digest
    cast = {k: v.to(torch.float16) for k, v in tensors.items()}
    assert compute_adapter_digest(config, cast) != digest
    renamed = dict(tensors)
    renamed[name.replace("layers.0", "layers.9")] = renamed.pop(name)
    assert compute_adapter_digest(config, renamed) != digest
    for field, value in [
        ("lora_alpha", 17),
        ("use_rslora", True),
        ("alpha_pattern", {"q_proj": 3}),
        ("rank_pattern", {"q_proj": 3}),
        ("layers_to_transform", [0]),
        ("target_modules", ["q_proj"]),
        ("use_dora", True),
        ("peft_type", "IA3"),
    ]:
        assert compute_adapter_digest({**config, field: value}, tensors) != digest, field


def test_rewritten_file_same_digest(
    default_adapter: Path, spec: BaseModelSpec, tmp_path: Path
) -> None:
    """Re-saving the same tensors in another key order keeps the identity."""
    config, tensors = read_adapter_files(default_adapter)
    copy = write_adapter(tmp_path / "copy", config, dict(reversed(list(tensors.items()))))
    assert (
        load_peft_adapter(copy, spec).ref.sha256
        == load_peft_adapter(default_adapter, spec).ref.sha256
    )


# --------------------------------------------------------------------------- refusals: files


def test_refuses_missing_and_corrupt_files(
    default_adapter: Path, spec: BaseModelSpec, tmp_path: Path
) -> None:
    assert_refused(tmp_path / "nope", spec, "directory not found")

    no_cfg = tmp_path / "no_cfg"
    no_cfg.mkdir()
    (no_cfg / "adapter_model.safetensors").write_bytes(
        (default_adapter / "adapter_model.safetensors").read_bytes()
    )
    assert_refused(no_cfg, spec, "adapter_config.json")

    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "adapter_config.json").write_text(json.dumps(hand_config()))
    assert_refused(no_weights, spec, "missing weights file")

    bad_json = write_adapter(tmp_path / "bad_json", hand_config(), hand_tensors(spec))
    (bad_json / "adapter_config.json").write_text('{"peft_type": "LORA", ')
    assert_refused(bad_json, spec, "adapter_config.json", "not valid JSON")

    not_obj = write_adapter(tmp_path / "not_obj", hand_config(), hand_tensors(spec))
    (not_obj / "adapter_config.json").write_text("[1, 2]")
    assert_refused(not_obj, spec, "adapter_config.json", "JSON object")

    truncated = write_adapter(tmp_path / "truncated", hand_config(), hand_tensors(spec))
    st = truncated / "adapter_model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    assert_refused(truncated, spec, "adapter_model.safetensors")

    garbage = write_adapter(tmp_path / "garbage", hand_config(), hand_tensors(spec), fmt="bin")
    (garbage / "adapter_model.bin").write_bytes(b"not a pickle at all")
    assert_refused(garbage, spec, "adapter_model.bin")


# --------------------------------------------------------------------------- refusals: config


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"peft_type": "IA3"}, "peft_type"),
        ({"peft_type": None}, "peft_type"),
        ({"use_dora": True}, "use_dora"),
        ({"modules_to_save": ["lm_head"]}, "full replacement weights for lm_head"),
        ({"modules_to_save": ["embed_tokens", "lm_head"]}, "for embed_tokens, lm_head"),
        (
            {"ensure_weight_tying": True, "target_modules": ["q_proj", "v_proj", "lm_head"]},
            "ensure_weight_tying=True with lm_head targeted",
        ),
        ({"bias": "all"}, "bias"),
        ({"bias": "lora_only"}, "bias"),
        ({"lora_bias": True}, "lora_bias"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"layer_replication": [[0, 2], [1, 3]]}, "layer_replication"),
        ({"use_qalora": True}, "use_qalora"),
        ({"target_parameters": ["mlp.experts.down_proj"]}, "target_parameters"),
        ({"trainable_token_indices": [1, 2]}, "trainable_token_indices"),
        ({"alora_invocation_tokens": []}, "alora_invocation_tokens must be a list"),
        ({"alora_invocation_tokens": [5, -1]}, "alora_invocation_tokens must be a list"),
        ({"alora_invocation_tokens": "5 6"}, "alora_invocation_tokens must be a list"),
        ({"alora_invocation_tokens": [5, True]}, "alora_invocation_tokens must be a list"),
        ({"alora_invocation_tokens": [5] * 1025}, "alora_invocation_tokens must be a list"),
        (
            {"alora_invocation_tokens": [5], "target_modules": ["q_proj", "embed_tokens"]},
            "activated LoRA applies to linear layers only",
        ),
        ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights"),
        ({"init_lora_weights": "loftq"}, "init_lora_weights"),
        ({"r": 0}, "r must"),
        ({"lora_alpha": "big"}, "lora_alpha"),
        ({"target_modules": None}, "target_modules"),
        ({"target_modules": "(unclosed"}, "target_modules"),
        ({"rank_pattern": {"q_proj": "4"}}, "rank_pattern"),
        ({"layers_to_transform": "0"}, "layers_to_transform"),
    ],
)
def test_refuses_config(
    spec: BaseModelSpec, tmp_path: Path, overrides: dict[str, Any], field: str
) -> None:
    path = write_adapter(tmp_path / "ad", hand_config(**overrides), hand_tensors(spec))
    assert_refused(path, spec, field)


def test_activated_lora_loads_with_its_invocation(spec: BaseModelSpec, tmp_path: Path) -> None:
    cfg = hand_config(alora_invocation_tokens=[5, 6, 7])
    adapter = load_peft_adapter(write_adapter(tmp_path / "ad", cfg, hand_tensors(spec)), spec)
    assert adapter.alora_invocation_tokens == (5, 6, 7)
    plain = write_adapter(tmp_path / "plain", hand_config(), hand_tensors(spec))
    assert load_peft_adapter(plain, spec).alora_invocation_tokens is None
    # the invocation is part of the identity: another sequence, another digest
    other = hand_config(alora_invocation_tokens=[5, 6])
    moved = load_peft_adapter(write_adapter(tmp_path / "o", other, hand_tensors(spec)), spec)
    assert moved.ref.sha256 != adapter.ref.sha256


def test_hand_made_adapter_loads(spec: BaseModelSpec, tmp_path: Path) -> None:
    """The baseline of the refusal tests is itself valid (so each refusal is about one change)."""
    for fmt in ("st", "bin"):
        path = write_adapter(tmp_path / fmt, hand_config(), hand_tensors(spec), fmt=fmt)
        adapter = load_peft_adapter(path, spec)
        assert adapter.target_modules == ("q_proj", "v_proj")
        assert {w.scale for w in adapter.weights.values()} == {2.0}


# --------------------------------------------------------------------------- refusals: tensors

Edit = Callable[[dict[str, torch.Tensor], BaseModelSpec], None]


def _add(name: str, shape: tuple[int, ...]) -> Edit:
    def edit(t: dict[str, torch.Tensor], spec: BaseModelSpec) -> None:
        t[name] = torch.randn(shape)

    return edit


def _replace(name: str, shape: tuple[int, ...]) -> Edit:
    def edit(t: dict[str, torch.Tensor], spec: BaseModelSpec) -> None:
        assert name in t
        t[name] = torch.randn(shape)

    return edit


def _poison(name: str, value: float) -> Edit:
    def edit(t: dict[str, torch.Tensor], spec: BaseModelSpec) -> None:
        t[name] = t[name].clone()
        t[name][0, 0] = value

    return edit


def _add_module(layer: int, proj: str, r: int = 4) -> Edit:
    def edit(t: dict[str, torch.Tensor], spec: BaseModelSpec) -> None:
        d_in, d_out = spec.module_shapes.get(proj, (64, 64))
        t[f"{module_name(layer, proj)}.lora_A.weight"] = torch.randn(r, d_in)
        t[f"{module_name(layer, proj)}.lora_B.weight"] = torch.randn(d_out, r)

    return edit


EMB = "base_model.model.model.embed_tokens"


def _add_vocab(name: str, r: int = 4, a: tuple[int, int] | None = None) -> Edit:
    """PEFT's tensors of a LoRA on ``embed_tokens`` or ``lm_head`` (``a``: A's shape)."""

    def edit(t: dict[str, torch.Tensor], spec: BaseModelSpec) -> None:
        d_in, d_out = spec.vocab_shapes[name]
        a_shape = a or (r, d_in)
        if name == "embed_tokens":
            t[f"{EMB}.lora_embedding_A"] = torch.randn(a_shape)
            t[f"{EMB}.lora_embedding_B"] = torch.randn(d_out, a_shape[0])
        else:
            t["base_model.model.lm_head.lora_A.weight"] = torch.randn(a_shape)
            t["base_model.model.lm_head.lora_B.weight"] = torch.randn(d_out, a_shape[0])

    return edit


def _chain(*edits: Edit) -> Edit:
    def edit(t: dict[str, torch.Tensor], spec: BaseModelSpec) -> None:
        for e in edits:
            e(t, spec)

    return edit


def _drop(name: str) -> Edit:
    def edit(t: dict[str, torch.Tensor], spec: BaseModelSpec) -> None:
        del t[name]

    return edit


def _clear(t: dict[str, torch.Tensor], spec: BaseModelSpec) -> None:
    t.clear()


def _int_dtype(t: dict[str, torch.Tensor], spec: BaseModelSpec) -> None:
    name = f"{module_name(0, 'q_proj')}.lora_A.weight"
    t[name] = torch.ones(t[name].shape, dtype=torch.int32)


def _duplicate_with_infix(t: dict[str, torch.Tensor], spec: BaseModelSpec) -> None:
    name = f"{module_name(0, 'q_proj')}.lora_A.weight"
    t[name.replace("lora_A.", "lora_A.other.")] = t[name].clone()


QA = f"{module_name(0, 'q_proj')}.lora_A.weight"
QB = f"{module_name(0, 'q_proj')}.lora_B.weight"
VB = f"{module_name(1, 'v_proj')}.lora_B.weight"


@pytest.mark.parametrize(
    ("edit", "config", "kwargs", "needles"),
    [
        pytest.param(
            _add_vocab("embed_tokens"),
            {},
            {},
            ("model.embed_tokens", "not targeted"),
            id="embedding-untargeted",
        ),
        pytest.param(
            _add(f"{EMB}.lora_A.weight", (4, 512)),
            {},
            {},
            ("embed_tokens.lora_A", "lora_embedding_A / lora_embedding_B"),
            id="embed-tokens-as-linear",
        ),
        pytest.param(
            _add("base_model.model.lm_head.lora_B.weight", (512, 4)),
            {"target_modules": ["q_proj", "v_proj", "lm_head"]},
            {},
            ("module lm_head", "lora_A weight missing"),
            id="lm-head-without-a",
        ),
        pytest.param(
            _add_vocab("lm_head", a=(4, 32)),
            {"target_modules": ["q_proj", "v_proj", "lm_head"]},
            {},
            ("lm_head.lora_A", "d_in=64"),
            id="lm-head-a-shape",
        ),
        pytest.param(
            _add_vocab("embed_tokens", a=(4, 500)),
            {"target_modules": ["q_proj", "v_proj", "embed_tokens"]},
            {},
            ("lora_embedding_A", "d_in=512"),
            id="embedding-a-vocab",
        ),
        pytest.param(
            _add_vocab("lm_head"),
            {"target_modules": ["q_proj", "v_proj", "lm_head"], "rank_pattern": {"lm_head": 8}},
            {},
            ("lm_head.lora_A", "configured rank 8", "rank_pattern"),
            id="lm-head-rank-pattern",
        ),
        pytest.param(
            None,
            {"target_modules": ["q_proj", "v_proj", "embed_tokens"]},
            {},
            ("module model.embed_tokens is targeted", "no LoRA tensors"),
            id="embedding-targeted-but-missing",
        ),
        pytest.param(
            _chain(_add_vocab("embed_tokens"), _add(f"{EMB}.base_layer.weight", (520, 64))),
            {"target_modules": ["q_proj", "v_proj", "embed_tokens"]},
            {},
            ("embed_tokens.base_layer.weight", "[512, 64]", "resized vocabulary"),
            id="base-copy-resized",
        ),
        pytest.param(
            _add("base_model.model.lm_head.base_layer.weight", (512, 64)),
            {},
            {},
            ("lm_head.base_layer.weight", "without a LoRA on lm_head"),
            id="base-copy-without-lora",
        ),
        pytest.param(
            _add("base_model.model.lm_head.weight", (512, 64)),
            {},
            {},
            ("lm_head.weight", "full replacement weights for lm_head"),
            id="full-head-weights",
        ),
        pytest.param(
            _add(f"{module_name(0, 'q_proj')}.lora_magnitude_vector", (64,)),
            {},
            {},
            ("lora_magnitude_vector", "DoRA"),
            id="dora-tensor",
        ),
        pytest.param(
            _add(f"{module_name(0, 'q_proj')}.lora_B.bias", (64,)),
            {},
            {},
            ("q_proj.lora_B.bias",),
            id="lora-bias-tensor",
        ),
        pytest.param(
            _add("base_model.model.model.norm.weight", (64,)),
            {},
            {},
            ("model.norm.weight",),
            id="unknown-tensor",
        ),
        pytest.param(
            _add_module(0, "qkv_proj"), {}, {}, ("qkv_proj", "not supported"), id="unknown-proj"
        ),
        pytest.param(
            _add_module(3, "q_proj"), {}, {}, ("layers.3", "num_layers 3"), id="layer-oob"
        ),
        pytest.param(_replace(QA, (4, 32)), {}, {}, (QA, "d_in=64"), id="a-shape"),
        pytest.param(_replace(VB, (64, 4)), {}, {}, (VB, "d_out=32"), id="b-shape"),
        pytest.param(_replace(QB, (64, 3)), {}, {}, ("rank mismatch", QB), id="ab-rank-mismatch"),
        pytest.param(_replace(QA, (4, 64, 1)), {}, {}, (QA, "2-D"), id="a-3d"),
        pytest.param(None, {"r": 8}, {}, (QA, "configured rank 8", "(r)"), id="rank-vs-r"),
        pytest.param(
            None,
            {"rank_pattern": {"q_proj": 2}},
            {},
            (QA, "configured rank 2", "rank_pattern"),
            id="rank-vs-rank-pattern",
        ),
        pytest.param(None, {}, {"max_lora_rank": 2}, (QA, "max_lora_rank 2"), id="max-rank"),
        pytest.param(_poison(QA, float("nan")), {}, {}, (QA, "non-finite"), id="nan"),
        pytest.param(_poison(VB, float("inf")), {}, {}, (VB, "non-finite"), id="inf"),
        pytest.param(
            _add_module(1, "gate_proj"), {}, {}, ("mlp.gate_proj", "not targeted"), id="untargeted"
        ),
        pytest.param(
            None,
            {"layers_to_transform": [0, 1]},
            {},
            ("layers.2.self_attn.q_proj", "not targeted"),
            id="untargeted-layer",
        ),
        pytest.param(
            None,
            {"target_modules": r".*\.layers\.[01]\.self_attn\.(q|v)_proj"},
            {},
            ("layers.2.self_attn.q_proj", "not targeted"),
            id="untargeted-regex",
        ),
        pytest.param(
            None,
            {"exclude_modules": ["v_proj"]},
            {},
            ("v_proj", "not targeted"),
            id="excluded",
        ),
        pytest.param(
            None,
            {"target_modules": ["q_proj", "v_proj", "k_proj"]},
            {},
            ("k_proj", "no LoRA tensors"),
            id="targeted-but-missing",
        ),
        pytest.param(_drop(QB), {}, {}, ("q_proj", "lora_B weight missing"), id="a-without-b"),
        pytest.param(_int_dtype, {}, {}, (QA, "floating point"), id="int-dtype"),
        pytest.param(_duplicate_with_infix, {}, {}, ("duplicates",), id="duplicate"),
        pytest.param(_clear, {}, {}, ("no LoRA tensors",), id="empty"),
    ],
)
def test_refuses_tensors(
    spec: BaseModelSpec,
    tmp_path: Path,
    edit: Edit | None,
    config: dict[str, Any],
    kwargs: dict[str, Any],
    needles: tuple[str, ...],
) -> None:
    tensors = hand_tensors(spec)
    if edit is not None:
        edit(tensors, spec)
    path = write_adapter(tmp_path / "ad", hand_config(**config), tensors)
    assert_refused(path, spec, *needles, **kwargs)


# --------------------------------------------------------------------------- base-model mismatch


def test_refuses_adapter_for_other_hidden_size(
    spec: BaseModelSpec, tmp_path_factory: pytest.TempPathFactory
) -> None:
    other_base = make_random_model(
        tmp_path_factory.mktemp("other"),
        hidden_size=32,
        num_layers=NUM_LAYERS,
        intermediate_size=64,
        with_tokenizer=False,
    )
    adapter_dir = make_random_adapter(other_base, tmp_path_factory.mktemp("ad") / "x")
    assert_refused(adapter_dir, spec, "different base model")


def test_refuses_layer_count_mismatch(default_adapter: Path, spec: BaseModelSpec) -> None:
    fewer = BaseModelSpec(num_layers=2, module_shapes=spec.module_shapes)
    assert_refused(default_adapter, fewer, "layer 2 >= base model num_layers 2")
    more = BaseModelSpec(num_layers=4, module_shapes=spec.module_shapes)
    assert_refused(default_adapter, more, "layers.3", "no LoRA tensors")


# --------------------------------------------------------------------------- non-finite check


def _insert_gap(path: Path, gap: bytes) -> None:
    """Rewrite a safetensors file with ``gap`` between its first and second tensors (data order):
    bytes no tensor owns, which a reader must not mistake for tensor values."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header, data = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    cut = min(v["data_offsets"][1] for v in entries.values() if v["data_offsets"][0] == 0)
    for v in entries.values():
        if v["data_offsets"][0] >= cut:
            v["data_offsets"] = [o + len(gap) for o in v["data_offsets"]]
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(len(new).to_bytes(8, "little") + new + data[:cut] + gap + data[cut:])


@pytest.mark.parametrize("case", ["overflow", "fp16_overflow", "nan_between_tensors"])
def test_finite_tensors_load_whatever_their_sum(
    spec: BaseModelSpec, tmp_path: Path, case: str
) -> None:
    """All values finite: the one-pass check over the buffer may not prove it (the sum
    overflows; a NaN lies between tensors), and then every tensor is checked on its own."""
    tensors = hand_tensors(spec)
    if case == "overflow":
        tensors = {k: torch.full_like(t, 3e38) for k, t in tensors.items()}
    elif case == "fp16_overflow":
        tensors = {k: torch.full_like(t, 6e4, dtype=torch.float16) for k, t in tensors.items()}
    path = write_adapter(tmp_path / "ad", hand_config(), tensors)
    if case == "nan_between_tensors":
        _insert_gap(path / "adapter_model.safetensors", struct.pack("<f", math.nan))
    adapter = load_peft_adapter(path, spec)
    for (layer, proj), w in adapter.weights.items():
        name = f"{module_name(layer, proj)}.lora_A.weight"
        torch.testing.assert_close(w.a, tensors[name].float(), rtol=0, atol=0)
        torch.testing.assert_close(w.b, tensors[name.replace("lora_A", "lora_B")].float())
    assert len(adapter.weights) == len(tensors) // 2


@pytest.mark.parametrize("where", ["last_value", "two_tensors", "fp16"])
def test_non_finite_values_are_named_in_any_position(
    spec: BaseModelSpec, tmp_path: Path, where: str
) -> None:
    tensors = hand_tensors(spec)
    last = max(tensors)  # sorted last: the last tensor in the file
    if where == "last_value":
        tensors[last][-1, -1] = math.inf
        needle = last
    elif where == "two_tensors":  # the first in layout order is named
        tensors[VB][0, 0] = -math.inf
        tensors[QA][1, 2] = math.nan
        needle = QA
    else:
        tensors = {k: t.half() for k, t in tensors.items()}
        tensors[QB][3, 1] = math.nan
        needle = QB
    path = write_adapter(tmp_path / "ad", hand_config(), tensors)
    msg = assert_refused(path, spec, needle, "non-finite")
    assert msg.count("non-finite") == 1
