"""The stale-scale push test on the Triton LoRA path, under Triton's CPU interpreter.

Not collected by the suite itself: ``tests/engine/test_push.py`` runs this file in its own pytest
process with ``TRITON_INTERPRET=1`` (see ``tests/interpreted.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/engine/test_push.py"

from loraplex import LLM  # noqa: E402
from loraplex.lora.triton_ops import TritonLoRAOps  # noqa: E402
from loraplex.testing import make_random_adapter, make_random_model  # noqa: E402
from tests.engine.push_cases import check_stale_scale  # noqa: E402


def test_no_double_scaling_on_the_triton_path(tmp_path_factory: pytest.TempPathFactory) -> None:
    root: Path = tmp_path_factory.mktemp("push-triton")
    model = make_random_model(root / "m", num_layers=2, seed=0)
    adapter = make_random_adapter(model, root / "a", r=8, seed=3)
    llm = LLM(str(model), enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32",
              disk_cache_dir=str(root / "disk"), disk_cache_bytes=1 << 26)  # fmt: skip
    assert llm.engine.model.lora is not None
    llm.engine.model.lora.ops = TritonLoRAOps()  # what a CUDA engine picks at start-up
    check_stale_scale(llm, model, adapter, root)
