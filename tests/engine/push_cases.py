"""Shared pieces of the push tests (``test_push.py``, and ``interpreted_push_triton.py`` under
Triton's interpreter): a PEFT reference whose weights follow each pushed revision, and the
stale-scale check (push, evict to host and to disk, reload, compare logits each time)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.lora.peft.files import CONFIG_NAME, SAFETENSORS_NAME
from loraplex.testing import check_greedy

PROMPT = [5, 17, 42, 9, 100, 7]
TOL = 2e-3  # float32 engine vs float32 PEFT: logprob gaps are ~1e-5; ties are the risk


def read_peft_dir(adapter_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A PEFT adapter directory as (state dict with PEFT's key names, config dict)."""
    tensors = load_file(str(adapter_dir / SAFETENSORS_NAME))
    return tensors, json.loads((adapter_dir / CONFIG_NAME).read_text())


def revision_tensors(base: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """The weights a training loop has at ``step``: ``base`` moved by a step-seeded delta
    (A and B both change, so every revision computes something else)."""
    g = torch.Generator().manual_seed(1000 + step)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}


class PeftReference:
    """transformers + PEFT, unmerged, whose LoRA weights are set to one revision at a time."""

    def __init__(self, base_dir: Path, adapter_dir: Path) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
        self.model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()

    def use(self, tensors: dict[str, torch.Tensor]) -> Any:
        from peft import set_peft_model_state_dict

        res = set_peft_model_state_dict(self.model, tensors)
        bad = [k for k in res.unexpected_keys if "lora_" in k]
        assert not bad, bad
        return self.model


def check_stale_scale(llm: LLM, base_dir: Path, adapter_dir: Path, tmp: Path) -> None:
    """Push an adapter, then serve it from the device, from host memory (evicted from its slot)
    and from the disk tier (evicted from host memory), and once more after pushing the same
    bytes again: every time the logprobs equal PEFT's (unmerged) within float32 tolerance, so
    no path scaled ``B`` (or anything else) twice."""
    engine = llm.engine
    cache = engine.adapters
    assert cache is not None and cache.disk is not None
    tensors, config = read_peft_dir(adapter_dir)
    ref = PeftReference(base_dir, adapter_dir).use(tensors)
    sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5)
    lr = LoRARequest("live", lora_tensors=tensors, peft_config=config, revision="step-1")
    got = llm.add_lora(lr, persist_disk=True)
    named = LoRARequest("live")

    def served(where: str) -> None:
        out = llm.generate([PROMPT], sp, lora_request=named)[0]
        assert out.lora_revision == "step-1", where
        check_greedy(out.outputs[0], ref, PROMPT, TOL)

    served("first use")  # into a device slot
    assert cache.tier_of(got.sha256) == "device"
    served("in its slot")
    cache.evict(got.sha256, tiers=("device",))
    assert cache.tier_of(got.sha256) == "host"
    served("from host memory")
    cache.unpin(got.sha256)  # the push pin keeps it in host memory; an operator lifts it
    cache.evict(got.sha256, tiers=("device", "host"))
    assert cache.tier_of(got.sha256) == "disk"
    served("reloaded from the disk tier")
    assert engine.add_lora(lr) == got  # the same bytes again: the same identity
    served("pushed again")
    cache.check_invariants()
