"""SLO classes, weighted shares, VTC fairness, preemption order, the loading queue, rank
budgets, the slot-bank byte watermark and the request ``priority`` field.

The policy tests drive the real Scheduler and BlockPool step by step with a stand-in for the
model that appends one token to every sequence whose tokens are all computed (what the engine
does after sampling), so every count below is exact and deterministic; the adapter tests run the
real engine on the tiny model."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplex import LoRARequest, SamplingParams
from loraplex.config import EngineConfig, rank_budget_map, slo_class_table
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.scheduler import (
    OUTPUT_TOKEN_COST,
    PROMPT_TOKEN_COST,
    SCHEDULING_POLICIES,
    Scheduler,
    VirtualTokenCounter,
    rank_bucket,
)
from loraplex.engine.scheduling import POLICIES, SchedulerState, SchedulingPolicy, make_policy
from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.kv.block_pool import BlockPool
from loraplex.requests import GenerationRequest
from loraplex.types import InvalidRequestError

GOLD, STANDARD, BATCH = -1, 0, 1  # priorities with the default classes gold=8,standard=4,batch=1


def _seq(rid: str, *, prompt: int = 8, out: int = 4, priority: int = 0, tenant: str = "t",
         arrival: float = 0.0) -> Sequence:  # fmt: skip
    params = SamplingParams(max_tokens=out, ignore_eos=True)
    return Sequence(rid, None, list(range(1, prompt + 1)), params, out, arrival=arrival,
                    priority=priority, tenant=tenant)  # fmt: skip


def _sched(policy: str, *, blocks: int = 256, seqs: int = 4, tokens: int = 64,
           weights: tuple[float, ...] = (8.0, 4.0, 1.0), seat_shares: bool = True) -> Scheduler:  # fmt: skip
    """``seat_shares=False`` for tests of another rule that need lower classes to fill seats
    beside a more important one (their own test is below)."""
    pool = BlockPool(blocks, 4, enable_prefix_caching=False)
    return Scheduler(pool, None, max_num_seqs=seqs, max_num_batched_tokens=tokens,
                     policy=policy, class_weights=weights, default_class=1,
                     seat_shares=seat_shares)  # fmt: skip


def _step(s: Scheduler, served: Counter[str] | None = None) -> list[Sequence]:
    """One engine step: schedule, advance, one new token per fully computed sequence, finish
    at max_tokens. ``served`` counts each sequence tenant's scheduled tokens."""
    batch = s.schedule()
    s.after_step(batch)
    done = []
    for seq, n in batch.items:
        if served is not None:
            served[seq.tenant] += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(7)
            if len(seq.output_token_ids) >= seq.max_tokens:
                s.finish(seq, "length")
                done.append(seq)
    return done


def _admitted(s: Scheduler) -> list[str]:
    return [q.request_id for q in s.running]


# ------------------------------------------------------------------------ class order


@pytest.mark.parametrize(
    ("policy", "first"), [("fcfs", "b0"), ("priority", "gold"), ("fair", "gold")]
)
def test_class_order_at_admission(policy: str, first: str) -> None:
    s = _sched(policy, seqs=1)
    for i in range(3):
        s.add(_seq(f"b{i}", priority=BATCH, arrival=i))
    s.add(_seq("gold", priority=GOLD, arrival=9))
    _step(s)
    assert _admitted(s) == [first]


def test_priority_policy_orders_by_priority_then_arrival() -> None:
    s = _sched("priority", seqs=8, tokens=1000)
    for rid, p, t in [("c", 2, 0), ("a", -3, 3), ("b", 0, 1), ("a2", -3, 2), ("d", 5, 4)]:
        s.add(_seq(rid, priority=p, arrival=t))
    _step(s)
    assert _admitted(s) == ["a2", "a", "b", "c", "d"]  # running is kept in priority order


def test_fcfs_refuses_to_preempt_for_admission_but_classes_do() -> None:
    for policy, expect in (("fcfs", ["b0", "b1"]), ("fair", ["gold", "b0"])):
        s = _sched(policy, seqs=2)
        s.add(_seq("b0", priority=BATCH, out=50))
        s.add(_seq("b1", priority=BATCH, out=50))
        _step(s)
        s.add(_seq("gold", priority=GOLD))
        _step(s)
        assert sorted(_admitted(s)) == sorted(expect), policy
        if policy == "fair":  # the newest batch sequence went back to the waiting queue's front
            assert s.waiting[0].request_id == "b1" and s.waiting[0].num_computed_tokens == 0


# ------------------------------------------------------------------------ weighted shares


def test_weighted_shares_and_no_starvation() -> None:
    """Both classes backlogged: gold (weight 8) gets ~8/9 of the tokens, batch (1) ~1/9, never 0."""
    s = _sched("fair", seqs=2, tokens=16, weights=(8.0, 1.0))
    s.default_class = 0
    served: Counter[str] = Counter()
    for i in range(200):
        s.add(_seq(f"g{i}", priority=0, tenant="gold"))
        s.add(_seq(f"b{i}", priority=1, tenant="batch"))
    for _ in range(300):
        _step(s, served)
    total = served["gold"] + served["batch"]
    assert served["batch"] > 0
    share = served["batch"] / total
    assert 1 / 9 * 0.7 < share < 1 / 9 * 1.3, served
    fcfs = _sched("fcfs", seqs=2, tokens=16)  # fcfs: whoever came first takes everything
    fcfs_served: Counter[str] = Counter()
    for i in range(200):
        fcfs.add(_seq(f"b{i}", priority=1, tenant="batch"))
    for i in range(200):
        fcfs.add(_seq(f"g{i}", priority=0, tenant="gold"))
    for _ in range(300):
        _step(fcfs, fcfs_served)
    assert fcfs_served["gold"] == 0


# ------------------------------------------------------------------------ VTC


def test_vtc_balances_two_flooding_tenants_within_a_class() -> None:
    def run(policy: str) -> Counter[str]:
        s = _sched(policy, seqs=4, tokens=32)
        served: Counter[str] = Counter()
        n = {"big": 0, "small": 0}
        for tenant, inflight in (("big", 24), ("small", 6)):
            for _ in range(inflight):
                s.add(_seq(f"{tenant}{n[tenant]}", tenant=tenant, prompt=12, out=6))
                n[tenant] += 1
        for _ in range(400):  # closed loop: each finished request is replaced by its tenant
            for done in _step(s, served):
                t = done.tenant
                assert t is not None
                s.add(_seq(f"{t}{n[t]}", tenant=t, prompt=12, out=6))
                n[t] += 1
        return served

    fair, fcfs = run("fair"), run("fcfs")
    assert abs(fair["big"] - fair["small"]) <= 0.1 * max(fair.values()), fair
    assert fcfs["big"] > 2 * fcfs["small"], fcfs  # fcfs follows the arrival rate


def test_vtc_counter_lifts_a_returning_tenant_to_the_active_minimum() -> None:
    v: VirtualTokenCounter[str] = VirtualTokenCounter()
    v.join("a")
    v.join("b")
    v.charge("a", 100.0)
    v.charge("b", 40.0)
    v.join("c")  # new: starts at min(active) = 40, not 0
    assert v["c"] == 40.0
    v.leave("c")
    v.charge("b", 100.0)
    v.join("c")  # returning: lifted to min(100, 140)
    assert v["c"] == 100.0
    v.charge("c", 500.0)
    v.leave("c")
    v.join("c")  # a counter above the minimum is kept
    assert v["c"] == 600.0


def test_service_charges_prompt_and_output_tokens_by_their_weights() -> None:
    s = _sched("fair", seqs=1, tokens=100)
    s.add(_seq("x", prompt=10, out=3, tenant="t"))
    for _ in range(3):
        _step(s)
    # prompt 10 tokens, then two decode steps of one output token each
    want = 10 * PROMPT_TOKEN_COST + 2 * OUTPUT_TOKEN_COST
    assert s.tenant_service[(1, "t")] == want
    assert s.class_service[1] == pytest.approx(want / 4.0)


# ------------------------------------------------------------------------ preemption order


@pytest.mark.parametrize(
    ("policy", "victim"), [("fcfs", "b1"), ("priority", "b0"), ("fair", "hog")]
)
def test_preemption_under_kv_pressure_takes_the_lowest_class_first(
    policy: str, victim: str
) -> None:
    """5 blocks of 4 tokens: gold's 3-token prompt and three 4-token prompts leave one free;
    after a token each, three sequences need a block: the first gets the free one, the second
    preempts: fcfs the newest, priority the largest priority value, fair the lowest class and
    there the tenant most over its share (not the newest)."""
    s = _sched(policy, blocks=5, seqs=4, tokens=1000, seat_shares=False)
    prio = {"b0": 2, "hog": 0, "b1": 1} if policy == "priority" else dict.fromkeys("x", 0)
    s.add(_seq("gold", prompt=3, out=8, priority=GOLD))
    for rid in ("b0", "hog", "b1"):
        s.add(_seq(rid, prompt=4, out=8, priority=prio.get(rid, BATCH), tenant=rid))
    s.tenant_service.charge((2, "hog"), 1000.0)  # hog has been served far more
    _step(s)
    assert s.pool.num_free == 1 and len(s.running) == 4
    batch = s.schedule()
    assert batch.num_preempted == 1
    assert [q.request_id for q in s.waiting] == [victim]
    assert s.waiting[0].status is SequenceStatus.WAITING and not s.waiting[0].block_ids
    assert sorted(q.request_id for q, _ in batch.items) == sorted(
        {"gold", "b0", "hog", "b1"} - {victim}
    )


def test_rank_bucket() -> None:
    budgets = {8: 12, 64: 4}
    assert [rank_bucket(r, budgets) for r in (1, 8, 9, 64, 65)] == [8, 8, 64, 64, None]


def test_policy_names_agree_with_config() -> None:
    from loraplex import config

    assert config.SCHEDULING_POLICIES == SCHEDULING_POLICIES


# ------------------------------------------------------------------------ policy objects


class ShortestPromptFirst(SchedulingPolicy):
    """A policy from outside the registry: shortest prompt first, the longest one preempted
    under KV pressure, and a waiting sequence preempts a running one with a longer prompt."""

    name = "spf"

    def __init__(self) -> None:
        self.steps = 0

    def running_key(self, state: SchedulerState, seq: Sequence) -> int:
        return len(seq.prompt_token_ids)

    def admission_order(self, state: SchedulerState, waiting: list[Sequence]) -> Iterator[Sequence]:
        return iter(sorted(waiting, key=lambda s: len(s.prompt_token_ids)))

    def victim(self, state: SchedulerState, candidates: list[Sequence]) -> Sequence:
        return max(candidates, key=lambda s: len(s.prompt_token_ids))

    def outranks(self, state: SchedulerState, seq: Sequence, other: Sequence) -> bool:
        return len(seq.prompt_token_ids) < len(other.prompt_token_ids)

    def begin_step(self, state: SchedulerState) -> None:
        self.steps += 1


def test_a_policy_object_plugs_in() -> None:
    spf = ShortestPromptFirst()
    pool = BlockPool(256, 4, enable_prefix_caching=False)
    s = Scheduler(pool, None, max_num_seqs=3, max_num_batched_tokens=1000, policy=spf)
    assert s.policy is spf
    for rid, n in (("long", 20), ("short", 2), ("mid", 9), ("tiny", 1)):
        s.add(_seq(rid, prompt=n, out=50))
    _step(s)
    assert _admitted(s) == ["tiny", "short", "mid"] and spf.steps == 1  # kept in its order
    s.add(_seq("mini", prompt=1, out=50))  # outranks "mid": it preempts it to get in
    batch = s.schedule()
    assert batch.num_preempted == 1 and spf.steps == 2
    assert _admitted(s) == ["tiny", "mini", "short"]
    assert [q.request_id for q in s.waiting] == ["mid", "long"]


def test_a_registry_entry_is_a_policy_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(POLICIES, "spf", ShortestPromptFirst)
    a, b = _sched("spf"), _sched("spf")
    assert isinstance(a.policy, ShortestPromptFirst) and a.policy is not b.policy  # one each
    assert {name: type(make_policy(name)).name for name in SCHEDULING_POLICIES} == {
        name: name for name in SCHEDULING_POLICIES
    }


def test_an_unknown_policy_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown scheduling policy 'sjf' \(choose from fcfs, priority, fair\)"):  # fmt: skip
        _sched("sjf")
    with pytest.raises(TypeError, match="SchedulingPolicy"):
        _sched(object())  # type: ignore[arg-type]


def test_the_scheduler_core_has_no_policy_names() -> None:
    """Every policy decision is the policy object's: no branch on a policy's name is left."""
    import loraplex.engine.scheduler as core

    source = Path(core.__file__).read_text()
    names = "|".join(SCHEDULING_POLICIES)
    assert not re.findall(rf"(==|!=|\bin)\s*\(?\s*[\"']({names})[\"']", source)
    assert re.findall(r"\bself\.policy\.\w+", source)  # the check sees what it looks for


# ------------------------------------------------------------------------ engine: adapters

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _engine(model: Path, **kw: object) -> LLMEngine:
    kw.setdefault("dtype", "float32")
    return LLMEngine(EngineConfig(model=str(model), **kw))  # type: ignore[arg-type]


def _finish_all(e: LLMEngine) -> set[str]:
    done = set()
    while e.has_unfinished_requests():
        done |= {o.request_id for o in e.step() if o.finished}
    return done


def test_loading_queue_never_blocks_ready_requests(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    """One device slot, held by a running gold request: a gold request for another adapter
    waits in the loading queue (it may not preempt its own class), and a base request behind
    it runs at once although its class is lower."""
    e = _engine(tiny_model, max_loras=1, scheduling_policy="fair")
    held = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, priority=GOLD)
    e.add_request("holder", "Hello", held, LoRARequest("a", adapters["all_r8"]))
    e.step()
    gold = dataclasses.replace(GREEDY, priority=GOLD)
    e.add_request("gold-cold", "Hi there", gold, LoRARequest("m", adapters["mlp_r16"]))
    e.add_request("base", "Hi there", dataclasses.replace(GREEDY, priority=BATCH))
    e.step()
    assert [s.request_id for s in e.scheduler.loading] == ["gold-cold"]
    assert sorted(s.request_id for s in e.scheduler.running) == ["base", "holder"]
    assert e.num_waiting == 1 and e.waiting_adapter_digests() == {
        e.scheduler.loading[0].adapter.ref.sha256  # type: ignore[union-attr]
    }
    assert _finish_all(e) == {"holder", "gold-cold", "base"}
    assert e.is_idle()


def test_a_higher_class_takes_a_device_slot_from_a_lower_one(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    """fair: a batch request alone holds the only slot; a gold request for another adapter
    preempts it (its slot freed and given to gold), fcfs waits in the loading queue."""
    for policy in ("fair", "fcfs"):
        e = _engine(tiny_model, max_loras=1, scheduling_policy=policy)
        long = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                              priority=BATCH if policy == "fair" else 0)  # fmt: skip
        e.add_request("batch", "Hello", long, LoRARequest("a", adapters["all_r8"]))
        e.step()
        gold = dataclasses.replace(GREEDY, priority=GOLD if policy == "fair" else 0)
        e.add_request("gold", "Hi there", gold, LoRARequest("m", adapters["mlp_r16"]))
        e.step()
        running = [s.request_id for s in e.scheduler.running]
        if policy == "fair":
            assert running == ["gold"] and [s.request_id for s in e.scheduler.waiting] == ["batch"]
            assert e.scheduler.num_preemptions == 1
        else:
            assert running == ["batch"] and [s.request_id for s in e.scheduler.loading] == ["gold"]
        assert _finish_all(e) == {"batch", "gold"}
        assert e.is_idle()


def test_rank_bucket_slot_budgets(tiny_model: Path, adapters: dict[str, Path]) -> None:
    """Rank <= 8 may hold one slot: the second low-rank adapter waits while a rank-16 one runs."""
    e = _engine(tiny_model, max_loras=3, lora_rank_slot_budgets="8:1,64:2")
    long = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    e.add_request("r8", "Hello", long, LoRARequest("a", adapters["all_r8"]))
    e.add_request("r4", "Hello", GREEDY, LoRARequest("b", adapters["attn_r4_rslora"]))
    e.add_request("r16", "Hello", GREEDY, LoRARequest("c", adapters["mlp_r16"]))
    e.step()
    assert sorted(s.request_id for s in e.scheduler.running) == ["r16", "r8"]
    assert [s.request_id for s in e.scheduler.loading] == ["r4"]
    done: set[str] = set()
    while e.has_unfinished_requests():
        running = {s.request_id for s in e.scheduler.running}
        assert not {"r8", "r4"} <= running  # never both low-rank adapters at once
        done |= {o.request_id for o in e.step() if o.finished}
    assert done == {"r8", "r4", "r16"}
    assert e.is_idle()


def test_slot_bank_byte_watermark(tiny_model: Path) -> None:
    """--max-lora-device-fraction caps the bank's bytes: 8 slots asked, as many as fit given."""
    probe = _engine(tiny_model, max_loras=1, num_kv_blocks=8)
    assert probe.adapters is not None
    shapes = probe.adapters.bank.module_shapes
    per_slot = 64 * sum(d_in + d_out for d_in, d_out in shapes.values()) * 4  # rank 64, fp32
    assert probe.adapters.bank.nbytes == per_slot
    memory = 40 * per_slot
    e = _engine(tiny_model, max_loras=8, kv_cache_memory_bytes=memory,
                max_lora_device_fraction=0.08)  # fmt: skip
    assert e.adapters is not None
    assert e.adapters.bank.max_loras == e.adapters.max_loras == 3  # 0.08 * 40 = 3.2 slots
    assert e.adapters.bank.nbytes <= 0.08 * memory
    roomy = _engine(tiny_model, max_loras=2, kv_cache_memory_bytes=memory,
                    max_lora_device_fraction=0.5)  # fmt: skip
    assert roomy.adapters is not None and roomy.adapters.bank.max_loras == 2  # max_loras rules
    with pytest.raises(ValueError, match="--max-lora-device-fraction"):
        _engine(tiny_model, kv_cache_memory_bytes=memory, max_lora_device_fraction=0.01)


def test_lora_slot_count_arithmetic() -> None:
    c = EngineConfig(model="m", max_loras=16, max_lora_device_fraction=0.25)
    assert c.lora_slot_count(1000, 40_000) == 10  # 10_000 bytes hold 10 slots
    assert c.lora_slot_count(1000, 400_000) == 16  # never more than max_loras
    assert EngineConfig(model="m", max_loras=16).lora_slot_count(10**9, 1) == 16  # no cap
    with pytest.raises(ValueError, match="cannot hold one adapter slot"):
        c.lora_slot_count(1000, 3_999)


# ------------------------------------------------------------------------ engine: classes


def test_request_priority_and_class_sources(tiny_model: Path, adapters: dict[str, Path]) -> None:
    fcfs = _engine(tiny_model, num_kv_blocks=16)
    with pytest.raises(InvalidRequestError, match="scheduling-policy") as info:
        fcfs.prepare_request(GenerationRequest("p", "Hi", dataclasses.replace(GREEDY, priority=1)))
    assert info.value.param == "priority"
    e = _engine(tiny_model, num_kv_blocks=16, scheduling_policy="fair",
                tenant_slo_classes="acme=batch")  # fmt: skip
    assert e.adapter_catalog is not None
    spec = e.adapter_catalog.spec(LoRARequest("a", adapters["all_r8"]))

    def prio(params: SamplingParams = GREEDY, **spec_fields: object) -> tuple[int, str | None]:
        s = dataclasses.replace(spec, **spec_fields) if spec_fields else spec
        p = e.prepare_request(GenerationRequest("p", "Hi", params, s))
        try:
            seq = p.request.seqs[0]
            return seq.priority, seq.tenant
        finally:
            e.discard_prepared(p)

    assert prio() == (0, "a")  # no class anywhere: the default; the adapter is the client
    assert prio(slo_class="gold") == (-1, "a")
    assert prio(slo_class="gold", tenant="acme") == (-1, "acme")  # the manifest's class wins
    assert prio(tenant="acme") == (1, "acme")  # the tenant's class
    assert prio(priority=2) == (-2, "a")  # manifest priority: higher is more important
    assert prio(slo_class="platinum", priority=1) == (-1, "a")  # unknown class: unset
    assert prio(dataclasses.replace(GREEDY, priority=5), slo_class="gold") == (5, "a")
    p = e.prepare_request(GenerationRequest("base", "Hi", GREEDY))
    assert (p.request.seqs[0].priority, p.request.seqs[0].tenant) == (0, None)
    e.discard_prepared(p)
    assert e.adapters is not None and e.adapters.is_idle()


def test_class_tables_parse() -> None:
    assert slo_class_table("gold=8, standard=4,batch=0.5") == (
        ("gold", 8.0), ("standard", 4.0), ("batch", 0.5))  # fmt: skip
    assert rank_budget_map("64:4,8:12") == {8: 12, 64: 4}
    for bad in ("gold", "gold=0", "gold=x", "gold=1,gold=2", "g old=1", "gold=inf"):
        with pytest.raises(ValueError):
            slo_class_table(bad)
    for bad in ("8", "8:0", "x:1", "8:1,8:2", "0:3"):
        with pytest.raises(ValueError):
            rank_budget_map(bad)


def test_fair_caps_a_lower_class_prefill_per_step_while_a_higher_one_is_active() -> None:
    """Budget 90, weights 8:1 (gold:batch active): while gold has prompt work, batch prompt
    chunks get int(90/9) = 10 tokens a step; while gold only decodes, and alone, batch gets
    the whole budget (no starvation by the cap); decodes are never capped."""
    s = _sched("fair", seqs=8, tokens=90, weights=(8.0, 1.0), seat_shares=False)
    s.default_class = 0
    s.add(_seq("g", prompt=4, out=40, priority=0, tenant="gold"))
    for i in range(3):
        s.add(_seq(f"b{i}", prompt=40, out=2, priority=1, tenant="batch"))
    batch = s.schedule()
    chunks = {q.request_id: n for q, n in batch.items}
    assert chunks["g"] == 4 and sum(n for r, n in chunks.items() if r != "g") == 10
    s.after_step(batch)
    batch.items[0][0].output_token_ids.append(7)  # gold's first token: it only decodes now
    batch = s.schedule()  # no more important prompt work: batch gets the rest of the budget
    chunks = {q.request_id: n for q, n in batch.items}
    assert chunks["g"] == 1 and sum(n for r, n in chunks.items() if r != "g") == 89
    s.add(_seq("g2", prompt=20, out=4, priority=0, tenant="gold"))  # gold prompt work again
    s.after_step(batch)
    batch.items[0][0].output_token_ids.append(7)
    chunks = {q.request_id: n for q, n in s.schedule().items}
    assert chunks["g"] == 1 and chunks["g2"] == 20
    assert sum(n for r, n in chunks.items() if not r.startswith("g")) == 10  # capped again
    alone = _sched("fair", seqs=8, tokens=90, weights=(8.0, 1.0), seat_shares=False)
    for i in range(3):
        alone.add(_seq(f"b{i}", prompt=40, out=2, priority=1, tenant="batch"))
    assert sum(n for _, n in alone.schedule().items) == 90
    fcfs = _sched("fcfs", seqs=8, tokens=90)
    fcfs.add(_seq("g", prompt=4, out=40, priority=-1))
    for i in range(3):
        fcfs.add(_seq(f"b{i}", prompt=40, out=2, priority=1))
    assert sum(n for _, n in fcfs.schedule().items) == 90  # fcfs: no caps


def test_a_sequence_admitted_then_preempted_in_the_same_step_waits_again() -> None:
    """fair, one seat: batch (least served) is admitted first, its charge puts its class above
    gold's, so gold preempts it in the same step; batch must be back in the waiting queue once
    (it was lost before this was fixed, and its request never finished)."""
    s = _sched("fair", seqs=1, tokens=100, weights=(8.0, 4.0, 1.0))
    s.add(_seq("b0", prompt=8, out=2, priority=BATCH))
    s.add(_seq("gold", prompt=8, out=2, priority=GOLD))
    s.class_service.served.update({0: 5.0, 2: 4.0})
    batch = s.schedule()
    assert [q.request_id for q, _ in batch.items] == ["gold"] and batch.num_preempted == 1
    assert [q.request_id for q in s.waiting] == ["b0"]
    assert s.class_service[2] == 4.0  # the preempted chunk's charge was taken back
    s.after_step(batch)
    batch.items[0][0].output_token_ids.append(7)  # gold's first token (what _step does)
    done: set[str] = set()
    while s.has_unfinished():
        done |= {q.request_id for q in _step(s)}
    assert done == {"b0", "gold"}


# ------------------------------------------------------------------------ headroom, hysteresis


def test_fair_keeps_headroom_seats_for_a_recently_active_higher_class() -> None:
    """Gold ran two at once: for ``headroom_window`` steps after, batch may take only the seats
    gold does not need (4 - 2), so the next gold request gets a seat at once, without a
    preemption; once the window has passed without gold, batch takes every seat."""
    s = _sched("fair", seqs=4, tokens=1000, seat_shares=False)
    s.headroom_window = 40
    s.add(_seq("g0", out=2, priority=GOLD, tenant="gold"))
    s.add(_seq("g1", out=2, priority=GOLD, tenant="gold"))
    for i in range(12):
        s.add(_seq(f"b{i}", out=30, priority=BATCH, tenant="batch"))
    _step(s)
    assert sorted(_admitted(s)) == ["b0", "b1", "g0", "g1"]  # headroom is spare seats only
    while any(q.priority == GOLD for q in s.running):
        _step(s)
    assert s.recent_peak(0) == 2 and s.headroom(2) == 2
    for _ in range(30):
        _step(s)
        assert len(s.running) <= 2 and all(q.priority == BATCH for q in s.running)
    s.add(_seq("g2", out=4, priority=GOLD, tenant="gold"))
    _step(s)
    assert "g2" in _admitted(s) and s.num_preemptions == 0
    while "g2" in _admitted(s):
        _step(s)
    last_seen = s.step_index  # the last schedule() that counted g2
    while s.step_index < last_seen + s.headroom_window:
        assert len(s.running) <= 3  # gold's recent peak is 1 now
        _step(s)
    assert s.recent_peak(0) == 0 and s.headroom(2) == 0
    _step(s)
    assert len(s.running) == 4 and s.num_preemptions == 0


def test_seat_shares_cap_a_lower_class_while_a_more_important_one_is_active() -> None:
    """Batch alone fills all 8 seats. Once gold has been seen, batch may run only its weight
    share of the seats (gold=8, batch=1: max(1, floor(8 * 1/9)) = 1): running batch sequences
    are not preempted for it, but as they finish no new ones start, while gold still gets
    in; a window after gold's last sequence, batch fills the engine again."""
    s = _sched("fair", seqs=8, tokens=1000, weights=(8.0, 1.0))
    s.headroom_window = 20
    for i in range(30):
        s.add(_seq(f"b{i}", out=6 + i % 3, priority=BATCH, tenant="batch"))
    _step(s)
    assert len(s.running) == 8 and s.seat_share(1) is None  # no gold yet: no cap
    s.add(_seq("g0", out=40, priority=GOLD, tenant="gold"))
    _step(s)
    assert "g0" in _admitted(s) and s.seat_share(1) == 1
    batch_running = []
    while "g0" in _admitted(s):
        done = _step(s)  # batch rows of the step: still running + finished in it
        batch_running.append(sum(q.priority == BATCH for q in [*s.running, *done]))
    assert batch_running[0] > 1  # the ones running when gold came finish in their time
    assert max(batch_running[-20:]) == 1 and min(batch_running[-20:]) == 1  # never starved
    s.add(_seq("g1", out=3, priority=GOLD, tenant="gold"))
    _step(s)
    assert "g1" in _admitted(s)  # a gold arrival finds a seat
    while "g1" in _admitted(s):
        _step(s)
    last_seen = s.step_index
    while s.step_index < last_seen + s.headroom_window:
        assert sum(q.priority == BATCH for q in s.running) <= 1
        _step(s)
    _step(s)
    assert s.seat_share(1) is None and len(s.running) == 8  # the whole engine is batch's again


def test_seat_shares_follow_the_weights_of_the_active_classes() -> None:
    """Three classes (8, 4, 1) over 16 seats: a class's share counts only the more important
    classes active in the window; the most important class is never capped; off: no caps."""
    s = _sched("fair", seqs=16, tokens=1000)
    s.add(_seq("std", out=50, priority=STANDARD, tenant="s"))
    _step(s)
    assert s.seat_share(0) is None and s.seat_share(1) is None
    assert s.seat_share(2) == 3  # floor(16 * 1 / (1 + 4))
    s.add(_seq("gold", out=50, priority=GOLD, tenant="g"))
    _step(s)
    assert s.seat_share(1) == 5  # floor(16 * 4 / (4 + 8))
    assert s.seat_share(2) == 1  # max(1, floor(16 * 1 / 13))
    off = _sched("fair", seqs=8, tokens=1000, seat_shares=False)
    off.add(_seq("gold", out=50, priority=GOLD, tenant="g"))
    _step(off)
    assert off.seat_share(2) is None
    assert _sched("priority", seqs=8).seat_share(2) is None


def test_headroom_leaves_a_lower_class_one_seat_and_yields_to_a_class_owed_service() -> None:
    s = _sched("fair", seqs=3, tokens=1000)
    for i in range(6):
        s.add(_seq(f"g{i}", out=2, priority=GOLD, tenant="gold"))
    s.add(_seq("b", out=3, priority=BATCH, tenant="batch"))
    s.schedule()
    assert s.recent_peak(0) == 3  # capped at max_num_seqs
    assert s.headroom(2) == 0  # gold holds all three seats: nothing left to keep
    s.class_service.served[0] = s.class_service[2] + 1.0  # gold over its share now
    assert s.headroom(2) == 0  # a backlogged class over its share holds no seats back
    idle = _sched("fair", seqs=3, tokens=1000)
    for i in range(6):
        idle.add(_seq(f"g{i}", out=1, priority=GOLD, tenant="gold"))
    while idle.has_unfinished():
        _step(idle)
    assert idle.recent_peak(0) == 3 and idle.headroom(2) == 2  # never the last seat
    idle.add(_seq("b", out=2, priority=BATCH, tenant="batch"))
    _step(idle)
    assert _admitted(idle) == ["b"]


def test_fair_preempts_the_least_computed_work_and_not_the_same_one_twice() -> None:
    """Two seats held by batch: a gold arrival preempts the one with the fewest computed tokens
    (not the newest); when the next gold arrives shortly after, that one (back and again the
    cheapest) is cooling down, so the other batch request is preempted instead."""
    s = _sched("fair", seqs=2, tokens=1000)
    s.headroom_window = 1  # no headroom: this test is about preemption
    s.add(_seq("b-long", prompt=12, out=60, priority=BATCH, tenant="batch"))
    s.add(_seq("b-short", prompt=4, out=60, priority=BATCH, tenant="batch"))
    s.add(_seq("b-mid", prompt=8, out=60, priority=BATCH, tenant="batch"))
    _step(s)
    assert _admitted(s) == ["b-long", "b-short"]
    s.add(_seq("g0", prompt=4, out=1, priority=GOLD, tenant="gold"))
    _step(s)
    assert [q.request_id for q in s.waiting] == ["b-short", "b-mid"] and s.num_preemptions == 1
    _step(s)  # g0 finished in its step: b-short is back (recomputing: the least work again)
    assert sorted(_admitted(s)) == ["b-long", "b-short"]
    short = next(q for q in s.running if q.request_id == "b-short")
    long = next(q for q in s.running if q.request_id == "b-long")
    assert short.num_computed_tokens < long.num_computed_tokens
    s.add(_seq("g1", prompt=4, out=1, priority=GOLD, tenant="gold"))
    _step(s)
    assert [q.request_id for q in s.waiting] == ["b-long", "b-mid"] and s.num_preemptions == 2
    assert short.status is SequenceStatus.RUNNING  # cooling down: not preempted twice in a row


def test_preemption_cooldown_holds_a_higher_class_back_rather_than_thrash() -> None:
    """The only lower-class seat holder was just preempted and re-admitted: a gold arrival
    within the cooldown waits for a seat instead of preempting it again."""
    s = _sched("fair", seqs=1, tokens=1000)
    s.headroom_window = 1
    b = _seq("b", prompt=4, out=200, priority=BATCH, tenant="batch")
    s.add(b)
    _step(s)
    s.add(_seq("g0", prompt=4, out=1, priority=GOLD, tenant="gold"))
    _step(s)  # g0 preempts b, runs its prompt and finishes
    _step(s)  # b is back
    assert _admitted(s) == ["b"] and s.num_preemptions == 1
    s.add(_seq("g1", prompt=4, out=1, priority=GOLD, tenant="gold"))
    _step(s)
    assert _admitted(s) == ["b"] and [q.request_id for q in s.waiting] == ["g1"]
    assert s.num_preemptions == 1
    assert b.preempted_at_step is not None
    while s.step_index + 1 - b.preempted_at_step < s.preempt_cooldown:
        _step(s)
        assert s.num_preemptions == 1
    _step(s)  # the cooldown is over: gold gets its seat
    assert [q.request_id for q in s.waiting] == ["b"] and s.num_preemptions == 2


def test_kv_pressure_preemption_prefers_sequences_not_cooling_down() -> None:
    """Under KV pressure a recently preempted sequence goes last, but it still goes when it is
    the only candidate (memory must always free)."""
    s = _sched("fair", blocks=5, seqs=4, tokens=1000, seat_shares=False)
    s.add(_seq("gold", prompt=3, out=8, priority=GOLD))
    for rid in ("b0", "hog", "b1"):
        s.add(_seq(rid, prompt=4, out=8, priority=BATCH, tenant=rid))
    s.tenant_service.charge((2, "hog"), 1000.0)
    _step(s)
    hog = next(q for q in s.running if q.request_id == "hog")
    hog.preempted_at_step = s.step_index  # as if preempted and back just now
    batch = s.schedule()
    assert batch.num_preempted == 1 and [q.request_id for q in s.waiting] == ["b1"]
    assert s._victim([hog]) is hog


def test_a_middle_class_may_not_take_seats_kept_for_a_higher_one() -> None:
    """Gold's recent peak keeps two of four seats: standard (between gold and batch) may not
    take them while they are free, though it outranks the running batch (it would take a
    seat gold needs, and gold would then preempt); without the headroom it gets in at once."""
    s = _sched("fair", seqs=4, tokens=1000, seat_shares=False)
    for i in range(2):
        s.add(_seq(f"g{i}", out=1, priority=GOLD, tenant="gold"))
    s.add(_seq("b0", out=80, priority=BATCH, tenant="batch"))
    s.add(_seq("b1", out=80, priority=BATCH, tenant="batch"))
    while any(q.priority == GOLD for q in [*s.running, *s.waiting]):
        _step(s)
    assert sorted(_admitted(s)) == ["b0", "b1"] and s.headroom(1) == 2
    s.add(_seq("std", out=4, priority=STANDARD, tenant="std"))
    _step(s)
    assert sorted(_admitted(s)) == ["b0", "b1"] and s.num_preemptions == 0
    s.headroom_window = 0  # gold's peak forgotten: standard takes a free seat at once
    _step(s)
    assert sorted(_admitted(s)) == ["b0", "b1", "std"] and s.num_preemptions == 0
