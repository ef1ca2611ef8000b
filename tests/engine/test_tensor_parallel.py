"""Tensor parallelism on CPU over gloo, 2 ranks (rank 0 here, one worker process): TP=2 gives
TP=1's greedy tokens in float32 and its logprobs within float32 summation-order error, for
mixed batches of adapters of different ranks on all seven projections (and on lm_head and
embed_tokens), with GQA where ``num_kv_heads < tp`` and a vocabulary that does not split
evenly, on several architecture families; the prefix cache, hot swaps, slot eviction and
staging hold under TP; a worker killed mid-stream fails the step with a clear error, and the
engine stops serving (no hang)."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.config import EngineConfig, ServerConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.lora.tensor_parallel import SharedWeights
from loraplex.server.app import create_app
from loraplex.testing import make_per_expert_adapter, make_random_adapter, make_random_model
from loraplex.testing.server import free_port, serve_in_thread
from loraplex.testing.sync import EVENT_TIMEOUT_S, wait_until
from tests.engine.test_mixed_batch_architectures import FAMILIES as ONE_DEVICE
from tests.engine.test_moe_experts import FAMILIES as MOE_FAMILIES
from tests.engine.test_moe_experts import adapters_for

# family -> tiny model: each hits what TP splits differently (the one-device suite's families,
# tests/engine/test_mixed_batch_architectures.py, with KV heads that split over two ranks)
FAMILIES: dict[str, dict] = {
    # one KV head for two ranks (replicated), untied head, odd vocabulary (uneven shards)
    "llama_gqa": {**ONE_DEVICE["llama"], "num_kv_heads": 1, "vocab": 389},
    # q/k norms per head, tied head (the head is the vocab-parallel embedding's rows)
    "qwen3": {**ONE_DEVICE["qwen3"], "num_kv_heads": 2},
    # fused checkpoint projections (qkv_proj, gate_up_proj): cut after the fused read
    "phi3": {**ONE_DEVICE["phi3"], "num_kv_heads": 2},
    # post-norms after the all-reduce, a sliding layer, soft-capped attention and logits
    "gemma2": {**ONE_DEVICE["gemma2"], "num_kv_heads": 2},
}
PROMPTS = [[1, 5, 9, 13, 7, 2, 11], [3, 4, 5], [8, 8, 8, 8, 2, 1, 17, 30, 31], [20, 21], [6] * 5]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
LOGPROB_ATOL = 2e-4
"""float32 keeps 24 bits (eps 1.2e-7); a TP rank sums each row-parallel dot product in two
halves whose partial sums are added in the all-reduce: a different rounding order over
K <= 128 terms per dot, compounded over two layers' residual stream and a log-softmax over the
vocabulary, stays around 1e-6 relative of O(10) logits; 2e-4 leaves two orders of margin."""


def _family(root: Path, name: str) -> tuple[Path, list[Path]]:
    spec = dict(FAMILIES[name])
    vocab = spec.pop("vocab", None)
    attn = spec.pop("proj", {}).get("attn", ["q_proj", "v_proj", "o_proj"])
    model = make_random_model(
        root / "model",
        spec.pop("arch"),
        num_layers=2,
        seed=5,
        with_tokenizer=vocab is None,
        vocab_size=vocab,
        **spec,
    )
    proj = [*attn, "lm_head", "embed_tokens"]
    adapters = [
        make_random_adapter(model, root / "r4", r=4, seed=1),  # all-linear: seven projections
        make_random_adapter(model, root / "r16", r=16, seed=2, std=0.08),
        make_random_adapter(model, root / "vocab", r=8, target_modules=proj, std=0.1, seed=3),
    ]
    return model, adapters


def _run(model: Path, adapters: list[Path], tp: int, **kw: object) -> list:
    llm = LLM(
        str(model),
        tensor_parallel_size=tp,
        dtype="float32",
        num_threads=1,
        max_loras=4,
        skip_tokenizer_init=True,
        **kw,
    )
    try:
        loras = [None, *(LoRARequest(p.name, str(p)) for p in adapters), None]
        outs = llm.generate(PROMPTS, GREEDY, loras[: len(PROMPTS)])
        assert llm.engine.is_idle()
        bank = llm.engine.adapters.bank
        hidden = llm.engine.model_config.hidden_size
        q_in, _ = bank.module_shapes[(0, "q_proj")]
        _, o_out = bank.module_shapes[(0, "o_proj")]
        cut = tp if kw.get("fully_sharded_loras") else 1  # each rank's bank holds its cut only
        assert (q_in, o_out) == (hidden // cut, hidden // cut)
        return [o.outputs[0] for o in outs]
    finally:
        llm.engine.shutdown()


def assert_tp_equal(one: list, two: list) -> None:
    """Each completion of ``two`` has ``one``'s tokens, and logprobs within LOGPROB_ATOL."""
    for a, b in zip(one, two, strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert math.isclose(la.logprob, lb.logprob, abs_tol=LOGPROB_ATOL)
            for tok in la.top.keys() & lb.top.keys():  # a near tie may swap the last one
                assert math.isclose(la.top[tok], lb.top[tok], abs_tol=LOGPROB_ATOL)


@pytest.mark.parametrize(
    ("name", "shm"), [*((name, "0") for name in FAMILIES), ("llama_gqa", "1"), ("qwen3", "1")]
)
def test_tp2_equals_tp1(
    name: str, shm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through gloo, and for two families through the shared-memory step traffic too."""
    monkeypatch.setenv("LORAPLEX_TP_SHM", shm)
    model, adapters = _family(tmp_path, name)
    assert_tp_equal(_run(model, adapters, 1), _run(model, adapters, 2))


def test_windowed_kv_groups_tp2_equal_tp1(tmp_path: Path) -> None:
    """Gemma 2 (window 4) with 4-token blocks: its sliding layer's KV-cache group drops the
    blocks behind the window as the prompts and decodes pass it; every rank builds the same
    groups, so the ranks agree with one device."""
    model, adapters = _family(tmp_path, "gemma2")
    one = _run(model, adapters, 1, block_size=4)
    two = _run(model, adapters, 2, block_size=4)
    for a, b in zip(one, two, strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert math.isclose(la.logprob, lb.logprob, abs_tol=LOGPROB_ATOL)


@pytest.mark.parametrize("name", ["qwen3_moe_dense_layer", "mixtral"])
def test_moe_tp2_equals_tp1(name: str, tmp_path: Path) -> None:
    """A MoE base: each expert's columns cut as the dense MLP's (the sparse block's output
    all-reduced), the router whole; expert, router and attention LoRA in one mixed batch."""
    spec = dict(MOE_FAMILIES[name])
    experts = spec.pop("experts")
    model = make_random_model(tmp_path / "model", spec.pop("arch"), num_layers=2, seed=5, **spec)
    adapters = []
    for a, (kind, kw) in adapters_for(experts).items():
        make = make_random_adapter if kind == "peft" else make_per_expert_adapter
        adapters.append(make(model, tmp_path / a, **kw))
    one = _run(model, adapters[:3], 1, max_lora_rank=16)
    two = _run(model, adapters[:3], 2, max_lora_rank=16)
    for a, b in zip(one, two, strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert math.isclose(la.logprob, lb.logprob, abs_tol=LOGPROB_ATOL)


@pytest.mark.parametrize("name", ["llama_gqa", "qwen3"])
def test_fully_sharded_loras_equal_tp1(name: str, tmp_path: Path) -> None:
    """``--fully-sharded-loras``: A and B both cut; the same tokens and logprobs."""
    model, adapters = _family(tmp_path, name)
    one = _run(model, adapters, 1)
    two = _run(model, adapters, 2, fully_sharded_loras=True)
    for a, b in zip(one, two, strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert math.isclose(la.logprob, lb.logprob, abs_tol=LOGPROB_ATOL)


def test_activated_lora_tp2_equals_tp1(tmp_path: Path) -> None:
    """An aLoRA (invoked by ``[5, 9]``: in the first prompt, absent from others) beside a
    standard LoRA and the base: the step's plan, with an aLoRA's rows before its activation
    point left as base rows, reaches every rank; the same tokens and logprobs."""
    model, _ = _family(tmp_path, "llama_gqa")
    adapters = [
        make_random_adapter(model, tmp_path / "al", r=8, seed=4, alora_invocation_tokens=[5, 9]),
        make_random_adapter(model, tmp_path / "std", r=4, seed=5),
    ]
    llm_kw = dict(dtype="float32", num_threads=1, max_loras=2, skip_tokenizer_init=True)
    loras = [LoRARequest("al", str(adapters[0]))] * 3 + [LoRARequest("std", str(adapters[1])), None]
    prompts = [PROMPTS[0], PROMPTS[0][:1] + [5, 9] + PROMPTS[2], PROMPTS[2], *PROMPTS[3:]]
    runs = []
    for tp in (1, 2):
        llm = LLM(str(model), tensor_parallel_size=tp, **llm_kw)  # type: ignore[arg-type]
        try:
            runs.append([o.outputs[0] for o in llm.generate(prompts, GREEDY, loras)])
        finally:
            llm.engine.shutdown()
    for a, b in zip(*runs, strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert math.isclose(la.logprob, lb.logprob, abs_tol=LOGPROB_ATOL)


def _generate(e: LLMEngine, rid: str, prompt: list[int], lora: LoRARequest | None):  # type: ignore[no-untyped-def]
    e.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), lora)
    while True:
        for out in e.step():
            if out.finished:
                return out


@pytest.mark.parametrize("transfer", ["shm", "group"])
def test_prefix_cache_hot_swap_and_slot_eviction_under_tp(
    transfer: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One device slot for three adapters (every request evicts and stages another), the
    prefix cache within an adapter only, a hot swap that never reuses the old KV: each
    answer equal to the one-rank engine's. The slot writes' weights reach the worker through
    shared memory (each file gone once the write returns), or, when /dev/shm cannot take
    them, through the process group."""
    written: list[str] = []
    write = SharedWeights.write.__func__  # type: ignore[attr-defined]

    def tracked(cls: type[SharedWeights], plain: dict) -> SharedWeights:
        if transfer == "group":
            raise OSError(28, "No space left on device")
        shared = write(cls, plain)
        written.append(shared.path)
        return shared

    monkeypatch.setattr(SharedWeights, "write", classmethod(tracked))
    model, adapters = _family(tmp_path, "llama_gqa")
    prompt = list(range(3, 40))
    swap = tmp_path / "swap"
    rev2 = make_random_adapter(model, tmp_path / "rev2", r=8, std=0.2, seed=9)

    def script(tp: int) -> list:
        e = LLMEngine(
            EngineConfig(
                model=str(model),
                tensor_parallel_size=tp,
                dtype="float32",
                num_threads=1,
                max_loras=1,
                block_size=4,
                skip_tokenizer_init=True,
            )
        )
        try:
            got = []
            for i, p in enumerate([*adapters, adapters[0], adapters[1]]):
                out = _generate(e, f"{i}", prompt, LoRARequest(p.name, str(p)))
                got.append((out.outputs[0].token_ids, out.num_cached_tokens))
            shutil.rmtree(swap, ignore_errors=True)
            shutil.copytree(adapters[0], swap)
            out = _generate(e, "s1", prompt, LoRARequest("x", str(swap)))
            got.append((out.outputs[0].token_ids, out.num_cached_tokens))
            shutil.rmtree(swap)
            shutil.copytree(rev2, swap)  # same name and path, new weights
            out = _generate(e, "s2", prompt, LoRARequest("x", str(swap)))
            got.append((out.outputs[0].token_ids, out.num_cached_tokens))
            assert e.adapters is not None and e.adapters.stats.slot_evictions > 0
            assert e.is_idle()
            return got
        finally:
            e.shutdown()

    one, two = script(1), script(2)
    assert one == two
    assert len(written) >= (6 if transfer == "shm" else 0), written  # every slot write
    assert not [p for p in written if Path(p).exists()]
    cached = [c for _, c in two]
    assert cached[:3] == [0, 0, 0]  # other adapters: no sharing
    assert cached[3] > 0 and cached[4] > 0  # the same adapter again: its prefix is reused
    assert cached[5] > 0  # adapters[0]'s weights under another name: the same digest
    assert cached[6] == 0 and two[6][0] != two[5][0]  # the hot swap: new digest, no old KV


def test_shared_weights_round_trip(tmp_path: Path) -> None:
    """A slot write's file: each tensor back bit for bit in its dtype and shape, every one on
    a 64-byte boundary, the file private to this user and gone after ``remove``."""
    import torch

    g = torch.Generator().manual_seed(0)
    plain = {
        (0, "q_proj"): (torch.randn(3, 5, generator=g), torch.randn(7, 3, generator=g), 0.5),
        (1, "down_proj"): (
            torch.randn(4, 9, generator=g).bfloat16(),
            torch.randn(11, 4, generator=g).bfloat16(),
            2.0,
        ),
        (-1, "lm_head"): (torch.randn(2, 1, generator=g), torch.randn(1, 2, generator=g), 1.0),
    }
    shared = SharedWeights.write(plain)
    try:
        assert Path(shared.path).stat().st_mode & 0o077 == 0
        got = shared.read()
        for key, (a, b, scale) in plain.items():
            w = got[key]
            assert w.a.dtype == a.dtype and torch.equal(w.a, a) and torch.equal(w.b, b)
            assert w.scale == scale
            for off in (shared.layout[key][0], shared.layout[key][2]):
                assert off % 64 == 0
    finally:
        shared.remove()
    assert not Path(shared.path).exists()


@pytest.mark.parametrize("shm", ["0", "1"])
def test_a_killed_worker_fails_the_stream_clearly(
    shm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker killed while a stream runs: the stream ends with an error naming the broken
    group, /health fails, new requests are refused; nothing hangs (gloo's step traffic, and
    the shared-memory one's, whose waits watch the worker process)."""
    monkeypatch.setenv("LORAPLEX_TP_SHM", shm)
    model = make_random_model(tmp_path / "model", "qwen3", num_kv_heads=2, num_layers=2)
    config = ServerConfig(
        EngineConfig(model=str(model), tensor_parallel_size=2, dtype="float32", num_threads=1),
        served_model_name=["tiny"],
        log_level="warning",
    )
    app = create_app(config)
    state = app.state.loraplex
    with serve_in_thread(app) as url:
        assert httpx.get(f"{url}/health", timeout=EVENT_TIMEOUT_S).status_code == 200
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 400, "ignore_eos": True,
                "stream": True}  # fmt: skip
        text = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=EVENT_TIMEOUT_S) as r:
            assert r.status_code == 200
            for i, line in enumerate(r.iter_lines()):
                text.append(line)
                if i == 6:  # a few tokens out: the worker goes
                    state.engine.workers.procs[0].kill()
        stream = "\n".join(text)
        assert "tensor-parallel" in stream and '"finish_reason":"length"' not in stream
        wait_until(lambda: httpx.get(f"{url}/health", timeout=EVENT_TIMEOUT_S).status_code != 200)
        r = httpx.post(
            f"{url}/v1/completions", json={**body, "stream": False}, timeout=EVENT_TIMEOUT_S
        )
        assert r.status_code >= 500 and "error" in r.json()
    assert state.engine.failure is not None and "tensor-parallel" in state.engine.failure


def test_two_nodes_rendezvous_on_loopback(tmp_path: Path) -> None:
    """``--nnodes 2``: node 1 is a headless ``loraplex serve`` process (its rank only), node 0
    the engine here; they meet at node 0's TCP store and answer as one rank does."""
    model, adapters = _family(tmp_path, "llama_gqa")
    one = _run(model, adapters, 1)
    port = free_port()
    flags = ["-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(port), "--dtype", "float32", "--num-threads", "1",
             "--max-loras", "4", "--skip-tokenizer-init"]  # fmt: skip
    node1 = subprocess.Popen(
        [sys.executable, "-m", "loraplex", "serve", str(model), *flags, "--node-rank", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        two = _run(model, adapters, 2, nnodes=2, node_rank=0, master_port=port)
        assert [o.token_ids for o in one] == [o.token_ids for o in two]
        assert node1.wait(EVENT_TIMEOUT_S) == 0  # stopped by node 0's shutdown
        out = node1.stdout.read().decode() if node1.stdout else ""
        assert "headless node 1: ranks 1..1 of 2" in out
    finally:
        node1.kill()


def test_shapes_that_do_not_split_are_refused(tmp_path: Path) -> None:
    model = make_random_model(tmp_path / "m", num_heads=3, num_kv_heads=1, hidden_size=48)
    with pytest.raises(Exception, match="num_attention_heads=3 is not a multiple of 2"):
        LLMEngine(EngineConfig(model=str(model), tensor_parallel_size=2, num_threads=1))


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        (dict(tensor_parallel_size=3, nnodes=2), "3 ranks do not split evenly over nnodes"),
        (dict(tensor_parallel_size=2, nnodes=2, node_rank=2, master_port=1), "node_rank: must"),
        (dict(tensor_parallel_size=2, nnodes=2), "master_port: must be set"),
        (dict(tensor_parallel_size=2, device="cuda"), "runs on CPU \\(gloo\\)"),
    ],
)
def test_rendezvous_settings_are_checked(fields: dict, want: str) -> None:
    with pytest.raises(ValueError, match=want):
        EngineConfig(model="m", **fields).validate()
