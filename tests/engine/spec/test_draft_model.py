"""The draft-model proposer: greedy drafts equal the draft model's own greedy continuation
(transformers), after any acceptance too; batching changes nothing; draft LoRAs draft as PEFT
does; sampled drafts carry the distribution they were drawn from; a foreign tokenizer is
refused; running out of draft KV gives no draft and leaks nothing."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from loraplex.config import EngineConfig
from loraplex.config.speculative import SpeculativeConfig, parse_speculative_config
from loraplex.engine.builder import EngineParts, build_parts
from loraplex.engine.sampler import _filter_min_p, _filter_top_k_top_p
from loraplex.engine.sequence import Sequence
from loraplex.engine.spec.draft_model import DraftModelProposer
from loraplex.engine.spec.proposer import NO_DRAFT
from loraplex.lora.adapter import LoRAAdapter
from loraplex.requests import LoRARequest, SamplingParams
from loraplex.testing import (
    ALL_PROJ,
    load_merged_reference,
    make_random_adapter,
    make_random_model,
    reference_greedy,
)
from loraplex.types import AdapterError

K = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 2-layer target with a tokenizer, a 1-layer narrower draft of the same vocabulary (the
    target's tokenizer files), a draft LoRA and two target adapters."""
    root = tmp_path_factory.mktemp("spec-draft")
    target = make_random_model(root / "target", num_layers=2, seed=0)
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    draft = make_random_model(
        root / "draft", num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1,
        intermediate_size=64, vocab_size=vocab, seed=1, with_tokenizer=False,
    )  # fmt: skip
    for name in TOKENIZER_FILES:
        if (target / name).is_file():
            shutil.copy(target / name, draft / name)
    return dict(
        target=target,
        draft=draft,
        draft_lora=make_random_adapter(
            draft, root / "draft-lora", r=8, target_modules=ALL_PROJ, seed=3, std=0.3
        ),
        lora_x=make_random_adapter(target, root / "lora-x", r=4, seed=4),
        lora_y=make_random_adapter(target, root / "lora-y", r=4, seed=5),
    )


def target_config(models: dict[str, Path], **kw: object) -> EngineConfig:
    base = dict(
        model=str(models["target"]), dtype="float32", num_threads=1, enable_lora=True,
        max_loras=2, max_lora_rank=8, max_num_seqs=8, max_model_len=128,
    )  # fmt: skip
    return EngineConfig(**{**base, **kw})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def target(models: dict[str, Path]) -> EngineParts:
    return build_parts(target_config(models))


def spec_obj(models: dict[str, Path], **kw: object) -> dict[str, object]:
    """The ``speculative_config`` JSON object of the draft model."""
    obj = {"method": "draft_model", "model": str(models["draft"]), "num_speculative_tokens": K}
    return {**obj, **kw}


def spec_of(models: dict[str, Path], **kw: object) -> SpeculativeConfig:
    return parse_speculative_config(spec_obj(models, **kw))


@pytest.fixture(scope="module")
def proposer(models: dict[str, Path], target: EngineParts) -> DraftModelProposer:
    spec = spec_of(models, draft_lora_modules={"tenant-x": str(models["draft_lora"])})
    return DraftModelProposer.build(target_config(models), spec, target)


@pytest.fixture(scope="module")
def hf_draft(models: dict[str, Path]) -> torch.nn.Module:
    return load_merged_reference(models["draft"], None)


@pytest.fixture(scope="module")
def target_adapters(models: dict[str, Path], target: EngineParts) -> dict[str, LoRAAdapter]:
    """Host copies of two target adapters (their names are what the proposer reads)."""
    assert target.lora is not None
    out = {}
    for name, key in (("tenant-x", "lora_x"), ("tenant-y", "lora_y")):
        spec = target.lora.catalog.spec(LoRARequest(name, str(models[key])))
        out[name], _ = target.lora.adapters.acquire(spec, count=False)
    return out


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def new_seq(
    ids: list[int], params: SamplingParams = GREEDY, adapter: LoRAAdapter | None = None, **kw
) -> Sequence:
    return Sequence(f"r{random.random()}", None, list(ids), params, 64, adapter=adapter, **kw)


def greedy(model: torch.nn.Module, ids: list[int], k: int = K) -> list[int]:
    return reference_greedy(model, ids, k)[0] if k else []


def test_greedy_drafts_equal_the_draft_models_greedy_continuation(
    proposer: DraftModelProposer, hf_draft: torch.nn.Module
) -> None:
    for seed, n in ((0, 5), (1, 17), (2, 33)):  # within a block, across one, across two
        ids = prompt(seed, n)
        seq = new_seq(ids)
        (draft,) = proposer.propose([seq], [K])
        assert draft.tokens == greedy(hf_draft, ids), (seed, n)
        assert draft.probs is None
        proposer.finish(seq)
    assert proposer.shadows == {}


def test_drafts_follow_the_target_after_acceptance_and_rejection(
    proposer: DraftModelProposer, hf_draft: torch.nn.Module
) -> None:
    """Rounds as the lead's verifier runs them: accept a prefix of the draft, then append the
    target's token (a correction, or a bonus after a full acceptance); every next draft is the
    draft model's greedy continuation of the new context."""
    rng = random.Random(7)
    seq = new_seq(prompt(3, 14))
    accepted_all = rejected = 0
    for _ in range(8):
        (draft,) = proposer.propose([seq], [K])
        assert draft.tokens == greedy(hf_draft, seq.all_token_ids)
        shadow = proposer.shadows[seq].seq
        assert shadow.num_computed_tokens == seq.num_tokens + K - 1
        j = rng.randrange(K + 1)  # drafts accepted
        seq.output_token_ids += draft.tokens[:j]
        if j < K:  # the target's correction differs from the rejected draft
            seq.output_token_ids.append((draft.tokens[j] + 1 + rng.randrange(50)) % 300)
            rejected += 1
        else:
            seq.output_token_ids.append(rng.randrange(300))
            accepted_all += 1
    assert rejected and accepted_all  # both paths ran
    proposer.finish(seq)


def test_drafts_follow_tokens_decoded_without_drafts(
    proposer: DraftModelProposer, hf_draft: torch.nn.Module
) -> None:
    """Steps without speculation (k = 0 for the sequence) append tokens the last draft never
    saw: the shadow rolls back to the first token that differs, not just the last one."""
    seq = new_seq(prompt(4, 10))
    for m, keep in ((3, 0), (2, 1), (K, 2), (1, 0)):
        (draft,) = proposer.propose([seq], [K])
        assert draft.tokens == greedy(hf_draft, seq.all_token_ids)
        seq.output_token_ids += draft.tokens[:keep]  # agree with the draft for `keep` tokens
        seq.output_token_ids.append((draft.tokens[keep] + 1) % 300)  # then differ
        seq.output_token_ids += prompt(m, m)  # and decode more with k = 0
        assert proposer.propose([seq], [0]) == [NO_DRAFT]
    (draft,) = proposer.propose([seq], [K])
    assert draft.tokens == greedy(hf_draft, seq.all_token_ids)
    proposer.finish(seq)


def test_batched_drafts_equal_one_at_a_time(
    proposer: DraftModelProposer, hf_draft: torch.nn.Module
) -> None:
    prompts = [prompt(10 + i, n) for i, n in enumerate((6, 19, 31, 3))]
    limits = [K, 2, 3, 0]
    alone = []
    for ids, k in zip(prompts, limits, strict=True):
        seq = new_seq(ids)
        (d,) = proposer.propose([seq], [k])
        alone.append(d.tokens)
        proposer.finish(seq)
    seqs = [new_seq(ids) for ids in prompts]
    together = proposer.propose(seqs, limits)
    assert [d.tokens for d in together] == alone
    assert together[3] is NO_DRAFT
    for ids, k, got in zip(prompts, limits, alone, strict=True):
        assert got == greedy(hf_draft, ids, k)
    # a second round after different acceptances, still batched
    for seq, d, j in zip(seqs[:3], together[:3], (1, 0, 3), strict=True):
        seq.output_token_ids += [*d.tokens[:j], 7]
    again = proposer.propose(seqs, [K, K, K, K])
    for seq, d in zip(seqs, again, strict=True):
        assert d.tokens == greedy(hf_draft, seq.all_token_ids), seq.request_id
    for seq in seqs:
        proposer.finish(seq)


def test_draft_lora_drafts_as_peft(
    proposer: DraftModelProposer,
    models: dict[str, Path],
    hf_draft: torch.nn.Module,
    target_adapters: dict[str, LoRAAdapter],
) -> None:
    """A request of adapter tenant-x drafts with its draft LoRA; tenant-y (no draft LoRA), the
    base model and a composition draft with the plain draft model, all in one batch."""
    peft = load_merged_reference(models["draft"], models["draft_lora"])
    x, y = target_adapters["tenant-x"], target_adapters["tenant-y"]
    prompts = [prompt(20 + i, 9 + 5 * i) for i in range(3)]
    changed = 0
    for ids in prompts:
        seqs = [
            new_seq(ids, adapter=x),
            new_seq(ids, adapter=y),
            new_seq(ids),
            new_seq(ids, adapter=x, composed=(y,), scales=(1.0, 1.0)),
        ]
        got = [d.tokens for d in proposer.propose(seqs, [K] * 4)]
        want_lora, want_base = greedy(peft, ids), greedy(hf_draft, ids)
        assert got == [want_lora, want_base, want_base, want_base]
        changed += want_lora != want_base
        for seq in seqs:
            proposer.finish(seq)
    assert changed  # the draft LoRA really moves the drafts (non-zero B)


def test_sampled_drafts_carry_their_distributions(
    proposer: DraftModelProposer, hf_draft: torch.nn.Module
) -> None:
    """Each probs row is the draft's distribution at that position under the request's
    temperature, min_p, top_k and top_p (float32 logits: 1e-5), sums to 1, and holds the
    drawn token."""
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.01, max_tokens=64)
    for seed in range(3):
        ids = prompt(30 + seed, 12)
        seq = new_seq(ids, params)
        (draft,) = proposer.propose([seq], [K])
        assert draft.probs is not None and draft.probs.dtype == torch.float32
        assert draft.probs.shape == (K, hf_draft.config.vocab_size)
        ctx = list(ids)
        with torch.no_grad():
            for j, tok in enumerate(draft.tokens):
                row = hf_draft(torch.tensor([ctx])).logits[0, -1].float() / params.temperature
                row = _filter_top_k_top_p(_filter_min_p(row, params.min_p), 40, 0.9)
                want = row.softmax(-1)
                torch.testing.assert_close(draft.probs[j], want, atol=1e-5, rtol=0)
                assert float(draft.probs[j, tok]) > 0
                assert int((draft.probs[j] > 0).sum()) <= 40
                ctx.append(tok)
        torch.testing.assert_close(draft.probs.sum(-1), torch.ones(K), atol=1e-5, rtol=0)
        proposer.finish(seq)


def test_a_different_tokenizer_is_refused(
    models: dict[str, Path], target: EngineParts, tmp_path: Path
) -> None:
    config = target_config(models)
    vocab = json.loads((models["target"] / "config.json").read_text())["vocab_size"]
    wider = make_random_model(
        tmp_path / "wider", num_layers=1, hidden_size=32, vocab_size=vocab + 8, with_tokenizer=False
    )
    with pytest.raises(ValueError, match=r"draft model .*wider.* vocabulary of"):
        DraftModelProposer.build(config, spec_of(models, model=str(wider)), target)
    # the same size, two tokens' ids swapped: another tokenizer
    swapped = tmp_path / "swapped"
    shutil.copytree(models["draft"], swapped)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    v = tok["model"]["vocab"]
    a, b = sorted(v, key=v.get)[100:102]
    v[a], v[b] = v[b], v[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    bare = replace(target, tokenizer=None)  # skip_tokenizer_init: the target's files decide
    for cfg, parts in ((config, target), (replace(config, skip_tokenizer_init=True), bare)):
        with pytest.raises(ValueError, match=r"draft model .*swapped.* does not share the target"):
            DraftModelProposer.build(cfg, spec_of(models, model=str(swapped)), parts)
    # not a decoder loraplex runs, and no model at all
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    for bad in (bert, tmp_path / "missing"):
        with pytest.raises(ValueError, match=f"draft model '{bad}'"):
            DraftModelProposer.build(config, spec_of(models, model=str(bad)), target)


def test_a_draft_lora_that_does_not_fit_the_draft_is_refused(
    models: dict[str, Path], target: EngineParts
) -> None:
    """A LoRA of the target given as a draft LoRA: refused at build, naming both."""
    spec = spec_of(models, draft_lora_modules={"tenant-x": str(models["lora_x"])})
    with pytest.raises(AdapterError, match=r"draft model .*draft.*the draft LoRA for 'tenant-x'.*"):
        DraftModelProposer.build(target_config(models), spec, target)


def test_no_room_in_the_draft_kv_gives_no_draft_and_leaks_nothing(
    models: dict[str, Path], hf_draft: torch.nn.Module
) -> None:
    """Two sequences of 64 tokens at most: 8 draft blocks of 16. Four sequences of 40 tokens
    need 3 blocks each, drafts or not: two draft, two get none; once the first two finish
    the others draft; after all finish every block is free."""
    config = target_config(models, enable_lora=False, max_num_seqs=2, max_model_len=64)
    tgt = build_parts(config)
    p = DraftModelProposer.build(config, spec_of(models), tgt)
    assert p.kv.pool.num_blocks == 8
    assert p.memory_bytes() == p.parts.cache.nbytes > 0  # type: ignore[union-attr]
    seqs = [new_seq(prompt(40 + i, 40)) for i in range(4)]
    drafts = p.propose(seqs, [K] * 4)
    assert [len(d) for d in drafts] == [K, K, 0, 0]
    assert drafts[2] is NO_DRAFT and seqs[2] not in p.shadows
    assert p.kv.pool.num_free == 2
    p.finish(seqs[0])
    p.finish(seqs[1])
    drafts = p.propose(seqs[2:], [K, K])
    assert [d.tokens for d in drafts] == [greedy(hf_draft, s.all_token_ids) for s in seqs[2:]]
    # a sequence too long for the draft: no draft, no error
    long = new_seq(prompt(50, 65))  # past the draft's max_model_len
    assert p.propose([long], [K]) == [NO_DRAFT]
    for seq in seqs:
        p.finish(seq)
    assert p.kv.pool.num_free == p.kv.pool.num_blocks and not p.shadows
    p.close()
    p.close()
    assert p.propose([seqs[0]], [K]) == [NO_DRAFT]


def test_long_catch_ups_take_several_steps(
    models: dict[str, Path], hf_draft: torch.nn.Module
) -> None:
    """At most max_num_batched_tokens (16) catch-up tokens per propose, the shortest first: a
    40-token prompt drafts at its third call, a short one beside it at every call."""
    config = target_config(models, enable_lora=False, max_num_batched_tokens=16)
    p = DraftModelProposer.build(config, spec_of(models), build_parts(config))
    long, short = new_seq(prompt(80, 40)), new_seq(prompt(81, 5))
    got = [p.propose([long, short], [K, K]) for _ in range(3)]
    assert [len(d[0]) for d in got] == [0, 0, K]
    assert got[2][0].tokens == greedy(hf_draft, long.all_token_ids)
    assert all(d[1].tokens == greedy(hf_draft, short.all_token_ids) for d in got)
    p.close()


def test_idle_shadows_give_way(models: dict[str, Path], hf_draft: torch.nn.Module) -> None:
    """Shadows of sequences not drafting now (waiting, preempted) are freed when a drafting
    sequence needs their blocks."""
    config = target_config(models, enable_lora=False, max_num_seqs=2, max_model_len=64)
    p = DraftModelProposer.build(config, spec_of(models), build_parts(config))
    first = [new_seq(prompt(60 + i, 30)) for i in range(2)]
    assert all(p.propose(first, [K, K]))
    later = [new_seq(prompt(70 + i, 30)) for i in range(2)]
    drafts = p.propose(later, [K, K])
    assert [d.tokens for d in drafts] == [greedy(hf_draft, s.all_token_ids) for s in later]
    assert set(p.shadows) == set(later)
    p.close()
    assert p.kv.pool.num_free == p.kv.pool.num_blocks


def test_draft_loras_are_held_until_close(models: dict[str, Path], target: EngineParts) -> None:
    spec = spec_of(models, draft_lora_modules={"tenant-x": str(models["draft_lora"])})
    p = DraftModelProposer.build(target_config(models), spec, target)
    assert p.parts is not None and p.parts.lora is not None
    cache = p.parts.lora.adapters
    (adapter, slot) = p.draft_loras["tenant-x"]
    assert cache.is_pinned(adapter.ref.sha256) and cache.slot_users[slot] == 1
    assert not cache.is_idle()
    p.close()
    assert cache.is_idle() and not cache.is_pinned(adapter.ref.sha256)


def test_on_cuda_the_target_leaves_room_for_the_draft(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The draft is loaded after the target on the same device: the target's KV cache is sized
    from what --gpu-memory-utilization leaves once the draft's weights (at the serving dtype,
    from its checkpoint's headers) and its KV share are set aside (no GPU needed: the device's
    free and total memory are given)."""
    from safetensors.torch import load_file

    from loraplex.engine.builder import MemoryBudget
    from loraplex.engine.spec.draft_budget import (
        DRAFT_KV_SHARE,
        draft_weight_bytes,
        target_kv_budget,
    )
    from loraplex.model.config import load_model_config

    stored = load_file(str(models["draft"] / "model.safetensors"))
    assert draft_weight_bytes(models["draft"], torch.bfloat16) == 2 * sum(
        t.numel() for t in stored.values()
    )
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * gib, 80 * gib))
    mc = load_model_config(models["target"], "vllm")
    plain = target_config(models, gpu_memory_utilization=0.9)
    with_draft = replace(plain, speculative_config=spec_obj(models))
    cuda = torch.device("cuda")
    alone = MemoryBudget(plain, mc, cuda, torch.float32).after_weights()
    assert alone == int(80 * gib * 0.9) - 10 * gib
    shared = MemoryBudget(with_draft, mc, cuda, torch.float32).after_weights()
    weights = draft_weight_bytes(models["draft"], torch.float32)
    assert shared == target_kv_budget(alone, weights)
    assert shared + weights + DRAFT_KV_SHARE * shared <= alone  # the draft fits beside it
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        target_kv_budget(weights, weights)
