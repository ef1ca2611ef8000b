"""Start-up decisions: dtype, KV sizing, max_model_len, option validation."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from loraplex import LLM
from loraplex.config import EngineConfig, LoRAModule, ServerConfig
from loraplex.engine import builder
from loraplex.engine.builder import resolve_dtype
from loraplex.engine.llm_engine import LLMEngine
from loraplex.kv.cache import PagedKVCache
from loraplex.model.config import load_model_config


def test_auto_dtype_prefers_fast_types(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_model_config(tiny_model)
    bf16_cfg = type(cfg)(**{**cfg.__dict__, "torch_dtype": "bfloat16"})
    cpu = torch.device("cpu")
    monkeypatch.setattr(builder, "cpu_has_fast_bf16", lambda: False)
    assert resolve_dtype("auto", bf16_cfg, cpu) == torch.float32
    monkeypatch.setattr(builder, "cpu_has_fast_bf16", lambda: True)
    assert resolve_dtype("auto", bf16_cfg, cpu) == torch.bfloat16
    assert resolve_dtype("auto", cfg, cpu) == torch.float32  # a float32 checkpoint stays float32
    assert resolve_dtype("bfloat16", cfg, cpu) == torch.bfloat16
    assert resolve_dtype("auto", bf16_cfg, torch.device("cuda")) == torch.bfloat16


@pytest.mark.parametrize("fast_bf16", [True, False], ids=["avx512-bf16-cpu", "plain-cpu"])
def test_auto_dtype_end_to_end_on_each_kind_of_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fast_bf16: bool
) -> None:
    """A bfloat16 checkpoint under ``dtype="auto"``: the engine and its KV cache follow the
    capability probe, whatever CPU runs the test; the adapter slot tables and host copies
    follow the model's dtype (the CPU kernel reads bf16 rows as they are)."""
    from loraplex.checkpoint.modules import BaseModelSpec
    from loraplex.lora.adapter import load_peft_adapter
    from loraplex.requests import LoRARequest
    from loraplex.testing import ALL_PROJ, make_random_adapter, make_random_model

    model = make_random_model(tmp_path / "bf16", dtype=torch.bfloat16, seed=5)
    adapter = make_random_adapter(model, tmp_path / "a", r=4, target_modules=ALL_PROJ, seed=6)
    monkeypatch.setattr(builder, "cpu_has_fast_bf16", lambda: fast_bf16)
    want = torch.bfloat16 if fast_bf16 else torch.float32
    engine = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=8, max_loras=1))
    assert engine.dtype == want and engine.cache.k.dtype == want
    tables = want
    assert engine.model.lora is not None and engine.model.lora.bank.dtype == tables
    assert engine.adapters is not None and engine.adapters.dtype == tables
    assert engine.adapter_catalog is not None
    got, _ = engine.adapters.acquire(engine.adapter_catalog.spec(LoRARequest("a", str(adapter))))
    mc = engine.model_config
    spec = BaseModelSpec(mc.num_layers, mc.module_shapes, mc.model_type)
    assert got.nbytes == load_peft_adapter(adapter, spec, dtype=tables).nbytes
    engine.adapters.release(got)


def test_kv_budget_and_max_model_len(tiny_model: Path) -> None:
    cfg = load_model_config(tiny_model)
    per_block = PagedKVCache.bytes_per_block(
        cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32
    )
    e = LLMEngine(
        EngineConfig(model=str(tiny_model), dtype="float32", kv_cache_memory_bytes=10 * per_block)
    )
    assert e.pool.num_blocks == 10 and e.max_model_len == 160
    # by default never more than max_num_seqs full-length sequences
    e = LLMEngine(EngineConfig(model=str(tiny_model), dtype="float32", max_num_seqs=2))
    assert e.pool.num_blocks == 2 * cfg.max_position_embeddings // 16
    assert e.max_model_len == cfg.max_position_embeddings
    with pytest.raises(ValueError, match="max_model_len"):
        LLMEngine(EngineConfig(model=str(tiny_model), max_model_len=10**6))
    with pytest.raises(ValueError, match="KV cache"):
        LLMEngine(EngineConfig(model=str(tiny_model), num_kv_blocks=2, max_model_len=64))


def test_bad_options_are_named(tiny_model: Path) -> None:
    with pytest.raises(TypeError, match="max_lora"):
        LLM(str(tiny_model), max_lora=3)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(str(tiny_model), max_loras=8, max_cpu_loras=2)
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(tiny_model), dtype="float8")


def test_max_cpu_loras_is_one_rule_on_the_config(tiny_model: Path) -> None:
    """``max_cpu_loras`` not given is ``max(max_loras, 32)``, for every way in (the Python
    config, ``LLM``, ``serve``, ``generate``); one given below ``max_loras`` is an error."""
    for max_loras, want in ((4, 32), (64, 64)):
        e = EngineConfig(model="m", max_loras=max_loras)
        e.validate()
        assert e.max_cpu_loras == want
    assert EngineConfig(model="m", max_loras=64, max_cpu_loras=100).max_cpu_loras == 100
    llm = LLM(str(tiny_model), max_loras=64, max_lora_rank=8, dtype="float32", num_threads=1)
    assert llm.engine.adapters is not None and llm.engine.adapters.max_cpu_loras == 64
    with pytest.raises(ValueError, match=r"max_cpu_loras: must be >= max_loras \(64\), got 8"):
        EngineConfig(model="m", max_loras=64, max_cpu_loras=8).validate()


def test_configs_are_frozen() -> None:
    """A config is never changed in place: ``dataclasses.replace`` derives another."""
    e = EngineConfig(model="m")
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.max_loras = 3  # type: ignore[misc]
    s = ServerConfig(engine=e)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.engine = e  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        LoRAModule("a", "/a").warm = "host"  # type: ignore[misc]
    assert dataclasses.replace(s, engine=dataclasses.replace(e, max_loras=3)).engine.max_loras == 3


def test_linear_backend_chosen_once(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), dtype="float32", enable_lora=False)
    m = llm.engine.model
    assert m.linear_impl in ("panel", "onednn-packed", "dense")
    impls = {type(layer.qkv) for layer in m.layers} | {type(m.head)}
    assert len(impls) == 1
