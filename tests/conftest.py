"""Shared fixtures: one tiny random Llama with a tokenizer and a family of PEFT adapters."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from loraplex.testing import ALL_PROJ, ATTN_PROJ, MLP_PROJ, make_random_adapter, make_random_model

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))

# (name, kwargs) — ranks 4..64, alpha, rsLoRA, target subsets, layers_to_transform, patterns
ADAPTER_SPECS: dict[str, dict] = {
    "all_r8": dict(r=8, lora_alpha=16, target_modules=ALL_PROJ, seed=1),
    "attn_r4_rslora": dict(r=4, lora_alpha=8, target_modules=ATTN_PROJ, use_rslora=True, seed=2),
    "mlp_r16": dict(r=16, lora_alpha=8, target_modules=MLP_PROJ, seed=3),
    "all_r64_layer1": dict(
        r=64, lora_alpha=32, target_modules=ALL_PROJ, layers_to_transform=[1], seed=4
    ),
    "qv_r32_regex": dict(r=32, lora_alpha=64, target_modules=r".*\.(q_proj|v_proj)", seed=5),
    "alllinear_r12": dict(r=12, lora_alpha=12, target_modules="all-linear", seed=7),
    "patterns": dict(
        r=8,
        lora_alpha=16,
        target_modules=ALL_PROJ,
        rank_pattern={"down_proj": 4, "q_proj": 12},
        alpha_pattern={"o_proj": 3.0},
        seed=6,
    ),
}


@pytest.fixture(scope="session", autouse=True)
def _loraplex_home(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Base-digest memos and default registries go to a temp dir, never the real home, and no
    test sees the caller's ``$LORAPLEX_REGISTRY_URL``."""
    os.environ["LORAPLEX_HOME"] = str(tmp_path_factory.mktemp("home"))
    os.environ.pop("LORAPLEX_REGISTRY_URL", None)


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty registry database: a SQLite file, or a new database on the test
    PostgreSQL server (skipped without one, unless ``LORAPLEX_REQUIRE_POSTGRES=1``)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'registry.db'}"
    from tests.pg import pg_url_or_skip

    return pg_url_or_skip()


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("loraplex")


@pytest.fixture(scope="session")
def tiny_model(workdir: Path) -> Path:
    """Llama: hidden 64, 3 layers, GQA 4/2 heads, byte-level BPE tokenizer with chat template."""
    return make_random_model(workdir / "tiny-llama", num_layers=3, seed=0)


@pytest.fixture(scope="session")
def adapters(tiny_model: Path, workdir: Path) -> dict[str, Path]:
    return {
        name: make_random_adapter(tiny_model, workdir / "adapters" / name, **kw)
        for name, kw in ADAPTER_SPECS.items()
    }
