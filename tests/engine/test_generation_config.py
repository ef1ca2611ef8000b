"""``generation_config.json`` gives the model's default sampling parameters, as in vLLM:
``--generation-config auto`` (the model directory's), ``vllm`` (none) or a directory, with
``--override-generation-config`` over them; its EOS ids join the model's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from loraplex.config import EngineConfig
from loraplex.engine.client import EngineClient, LLMEngine
from loraplex.model.config import load_model_config
from loraplex.types import ModelLoadError

GEN = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
       "repetition_penalty": 1.1, "max_new_tokens": 33, "do_sample": True,
       "eos_token_id": [2, 7]}  # fmt: skip
WANT = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.1, "max_tokens": 33}  # fmt: skip


@pytest.fixture
def model(tiny_model: Path, tmp_path: Path) -> Path:
    d = tmp_path / "model"
    shutil.copytree(tiny_model, d)
    (d / "generation_config.json").write_text(json.dumps(GEN))
    return d


def test_auto_reads_the_model_directory(model: Path) -> None:
    mc = load_model_config(model)
    assert mc.generation_defaults == WANT
    base = load_model_config(model, "vllm")
    assert base.generation_defaults == {}
    assert 7 in mc.eos_token_ids and 7 not in base.eos_token_ids
    assert set(base.eos_token_ids) <= set(mc.eos_token_ids)


def test_a_directory_and_overrides(model: Path, tmp_path: Path) -> None:
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.2}))
    assert load_model_config(model, str(other)).generation_defaults == {"temperature": 0.2}
    mc = load_model_config(model, "auto", {"temperature": 0.0, "max_new_tokens": 5})
    assert mc.generation_defaults == {**WANT, "temperature": 0.0, "max_tokens": 5}
    with pytest.raises(ModelLoadError, match="unknown sampling parameter"):
        load_model_config(model, "auto", {"warmth": 1})


def test_bad_values_fail_at_start_up(model: Path) -> None:
    (model / "generation_config.json").write_text(json.dumps({"top_k": "many"}))
    with pytest.raises(ModelLoadError, match=r"top_k must be an integer"):
        load_model_config(model)


def test_engine_client_exposes_the_defaults_and_eos(model: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(model), device="cpu", enable_lora=False))
    client = EngineClient(engine)
    assert client.generation_defaults == WANT
    client.generation_defaults["temperature"] = 9.0  # a copy: the engine's stay
    assert client.generation_defaults == WANT
    assert 7 in engine.eos_token_ids
    off = LLMEngine(
        EngineConfig(model=str(model), device="cpu", enable_lora=False, generation_config="vllm")
    )
    assert EngineClient(off).generation_defaults == {}
