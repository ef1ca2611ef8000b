"""In-process pushes (``LLMEngine.add_lora`` / ``LLM.add_lora`` with tensors, LoRARequests
carrying tensors): exact across atomic revision swaps under load, never scaled twice across
evictions and reloads, and every bad input refused with nothing changed."""

from __future__ import annotations

import functools
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.lora.backends import select_lora_ops
from loraplex.testing import (
    check_greedy,
    logprob_gap,
    make_random_adapter,
    make_random_model,
    reference_greedy,
)
from loraplex.types import AdapterError, InvalidRequestError, pushed_source
from tests.engine.push_cases import (
    TOL,
    PeftReference,
    check_stale_scale,
    read_peft_dir,
    revision_tensors,
)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 2-layer Llama (hidden 64) and a rank-8 all-linear adapter for it."""
    root = tmp_path_factory.mktemp("push")
    model = make_random_model(root / "m", num_layers=2, seed=0)
    return model, make_random_adapter(model, root / "a", r=8, seed=3)


@pytest.mark.parametrize("ops", ["cpu-kernel", "torch"])
def test_no_double_scaling_across_evictions(
    small: tuple[Path, Path], tmp_path: Path, ops: str
) -> None:
    """Stale-scale test on the C kernel and torch paths (Triton: interpreted_push_triton.py)."""
    model, adapter = small
    llm = LLM(str(model), enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32",
              disk_cache_dir=str(tmp_path / "disk"), disk_cache_bytes=1 << 26)  # fmt: skip
    assert llm.engine.model.lora is not None
    llm.engine.model.lora.ops = select_lora_ops("cpu", name=ops)
    check_stale_scale(llm, model, adapter, tmp_path)


def test_exact_across_twenty_pushes_under_sixteen_streams(small: tuple[Path, Path]) -> None:
    """20 pushes of changing weights under one name while 16 streams generate: each response
    equals PEFT with the revision it names, keeps one host copy from admission to its end, and
    a KV block is only ever hit by requests of its own revision (the prefix cache keys by
    digest); replaced revisions leave host memory once their last request ends."""
    model, adapter = small
    engine = LLMEngine(EngineConfig(model=str(model), enable_lora=True, max_loras=4,
                                    max_lora_rank=8, dtype="float32", block_size=4))  # fmt: skip
    cache = engine.adapters
    assert cache is not None
    base, config = read_peft_dir(adapter)
    revisions: dict[str, dict[str, torch.Tensor]] = {}

    def push(step: int) -> None:
        label = f"step-{step}"
        revisions[label] = revision_tensors(base, step)
        lr = LoRARequest("live", lora_tensors=revisions[label], peft_config=config, revision=label)
        engine.add_lora(lr)

    prompts = [[5, 17, 42, 9, 100, 7, 3, 8], [11, 12, 13, 14, 15, 16, 17, 18], [200, 3, 9, 9]]
    push(0)
    pushes, ids, done = 1, 0, {}
    prompt_of: dict[str, list[int]] = {}
    digest_of: dict[str, str] = {}  # request id -> the digest of the host copy it holds
    hash_digest: dict[bytes, str] = {}  # every prefix-cache key seen -> the digest it keys

    def admit() -> None:
        nonlocal ids
        rid = f"r{ids}"
        prompt_of[rid] = prompts[ids % len(prompts)]
        sp = SamplingParams(temperature=0.0, max_tokens=2 + ids % 5, logprobs=3)  # staggered
        engine.add_request(rid, prompt_of[rid], sp, LoRARequest("live"))
        ids += 1

    for _ in range(16):
        admit()
    steps = 0
    while engine.has_unfinished_requests():
        for rid, req in engine.requests.items():
            for seq in req.seqs:
                assert seq.adapter is not None
                d = seq.adapter.ref.sha256
                assert digest_of.setdefault(rid, d) == d, "a request changed revision"
                for h in seq.block_hashes:
                    assert hash_digest.setdefault(h, d) == d, "a KV key shared by two revisions"
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
                if pushes < 20:
                    admit()  # keep 16 streams while pushes go on
        steps += 1
        if pushes < 20:
            push(pushes)
            pushes += 1
    assert pushes == 20 and len(done) == ids
    served = {out.lora_revision for out in done.values()}
    assert len(served) >= 10, served  # the streams really ran across many revisions
    ref = PeftReference(model, adapter)

    @functools.cache
    def expected(revision: str, prompt: tuple[int, ...]) -> tuple[list[int], torch.Tensor]:
        """PEFT's greedy tokens and logprobs with ``revision`` (the longest any stream asked)."""
        return reference_greedy(ref.use(revisions[revision]), list(prompt), 6)

    seen: set[tuple[str, tuple[int, ...]]] = set()
    for rid in sorted(done, key=lambda r: int(r[1:])):
        out = done[rid]
        assert out.adapter is not None and out.adapter.sha256 == digest_of[rid]
        key = (out.adapter.sha256, tuple(prompt_of[rid]))
        if out.num_cached_tokens:
            assert key in seen, f"{rid} hit KV of no earlier request of its revision"
        seen.add(key)
        want, ref_lp = expected(out.lora_revision, key[1])
        got = out.outputs[0]
        n = len(got.token_ids)
        assert got.token_ids == want[:n], (rid, out.lora_revision)
        assert logprob_gap(got.logprobs, ref_lp[:n]) < TOL
    # a fresh revision never hits the blocks the earlier ones left cached for the same prompt;
    # its own second request does
    push(20)
    sp = SamplingParams(temperature=0.0, max_tokens=2)
    outs: list = []
    for rid in ("again-1", "again-2"):
        engine.add_request(rid, prompts[0], sp, LoRARequest("live"))
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.finished]
    assert [o.lora_revision for o in outs] == ["step-20", "step-20"]
    assert outs[0].num_cached_tokens == 0 and outs[1].num_cached_tokens > 0
    # every replaced revision left the device and host tiers with its last request
    last = engine.pushed.spec_of("live") if engine.pushed else None
    assert last is not None and last.ref.revision == "step-20"
    assert {d for d, *_ in cache.loaded()} == {last.sha256}
    assert not engine.pushed.retiring  # type: ignore[union-attr]
    cache.check_invariants()


def test_tensor_request_and_name_resolution(small: tuple[Path, Path]) -> None:
    """A LoRARequest with tensors is served as pushed; a name alone gets the revision last
    added; the output names it; pushing the same bytes twice keeps one identity."""
    model, adapter = small
    llm = LLM(str(model), enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32")
    tensors, config = read_peft_dir(adapter)
    sp = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3)
    direct = LoRARequest("t", lora_tensors=tensors, peft_config=config, revision="v1")
    out = llm.generate([[5, 6, 7, 8]], sp, lora_request=direct)[0]
    assert out.lora_revision == "v1" and out.adapter is not None
    check_greedy(out.outputs[0], PeftReference(model, adapter).use(tensors), [5, 6, 7, 8], TOL)
    again = llm.generate([[5, 6, 7, 8]], sp, lora_request=LoRARequest("t"))[0]
    assert again.adapter == out.adapter and again.outputs[0].token_ids == out.outputs[0].token_ids
    with pytest.raises(AdapterError, match="never added"):
        llm.generate([[5]], sp, lora_request=LoRARequest("nobody"))


def test_bad_pushes_are_refused_and_change_nothing(small: tuple[Path, Path]) -> None:
    model, adapter = small
    llm = LLM(str(model), enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32")
    engine, cache = llm.engine, llm.engine.adapters
    assert cache is not None and engine.pushed is not None
    tensors, config = read_peft_dir(adapter)
    good = llm.add_lora(LoRARequest("n", lora_tensors=tensors, peft_config=config, revision="a"))
    before = (cache.loaded(), engine.pushed.spec_of("n"))
    a_key = next(k for k in tensors if "lora_A" in k)
    b_key = next(k for k in tensors if "lora_B" in k)
    bad: list[tuple[dict, dict, str]] = [
        ({**tensors, a_key: torch.zeros(8, 65)}, config, "shape"),  # not the base's d_in
        ({**tensors, b_key: tensors[b_key].to(torch.int32)}, config, "float"),  # wrong dtype
        (
            {**tensors, "model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 64)},
            config,
            "unexpected|not a LoRA|unsupported",
        ),
        (tensors, {**config, "r": "eight"}, "r"),
        (tensors, {**config, "use_dora": True}, "DoRA|dora"),
        ({**tensors, a_key: torch.full_like(tensors[a_key], float("nan"))}, config, "non-finite"),
        ({}, config, "non-empty"),
    ]
    for t, c, why in bad:
        with pytest.raises(AdapterError, match=why):
            llm.add_lora(LoRARequest("n", lora_tensors=t, peft_config=c, revision="b"))
        assert (cache.loaded(), engine.pushed.spec_of("n")) == before
    other = {k: v + 1 for k, v in tensors.items()}
    with pytest.raises(AdapterError, match="already has a revision 'a'"):
        llm.add_lora(LoRARequest("n", lora_tensors=other, peft_config=config, revision="a"))
    with pytest.raises(AdapterError, match="disk tier"):
        llm.add_lora(LoRARequest("n", lora_tensors=other, peft_config=config), persist_disk=True)
    with pytest.raises(InvalidRequestError, match="go together"):
        LoRARequest("n", lora_tensors=tensors)
    assert (cache.loaded(), engine.pushed.spec_of("n")) == before
    spec = engine.pushed.spec_of("n")
    assert spec is not None and spec.ref == good and spec.source_uri == pushed_source(good.sha256)


def test_triton_path_under_the_interpreter() -> None:
    """The stale-scale test on the Triton path (its own process: see tests/interpreted.py)."""
    from tests.interpreted import run_interpreted

    run_interpreted(Path(__file__).parent / "interpreted_push_triton.py", 1)


def test_pushes_across_names_keep_their_own_revisions(small: tuple[Path, Path]) -> None:
    """Two names pushed in turn: each name's requests get its own latest revision."""
    model, adapter = small
    llm = LLM(str(model), enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32")
    base, config = read_peft_dir(adapter)
    got = defaultdict(list)
    for step in range(3):
        for name in ("x", "y"):
            lr = LoRARequest(name, lora_tensors=revision_tensors(base, step + 10 * (name == "y")),
                             peft_config=config, revision=f"s{step}")  # fmt: skip
            got[name].append(llm.add_lora(lr))
    for name in ("x", "y"):
        sp = SamplingParams(temperature=0.0, max_tokens=2)
        out = llm.generate([[1, 2, 3]], sp, lora_request=LoRARequest(name))[0]
        assert out.adapter == got[name][-1]
