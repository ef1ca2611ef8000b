"""The engine under bad requests and failing steps: clear errors, nothing leaked behind, and
the edge cases of stop strings, seeds and revisions that review found."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from loraplex import LLM, InvalidRequestError, LoRARequest, SamplingParams
from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.model.checkpoint_files import SafetensorsFile
from loraplex.types import ModelLoadError

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _engine(model: Path, **kw) -> LLMEngine:
    kw.setdefault("dtype", "float32")
    return LLMEngine(EngineConfig(model=str(model), **kw))


def _run(engine: LLMEngine) -> dict:
    done = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_stop_token_id_outside_vocab_is_rejected_not_a_crash(tiny_model: Path) -> None:
    """min_tokens masks stop ids in the logits: an out-of-vocab id used to raise in step()."""
    e = _engine(tiny_model, enable_lora=False)
    vocab = e.model_config.vocab_size
    sp = SamplingParams(temperature=0, max_tokens=4, min_tokens=2, stop_token_ids=[vocab + 5])
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        e.add_request("r", "Hello", sp)
    assert e.is_idle() and "r" not in e.requests
    e.add_request("ok", "Hello", GREEDY)
    assert len(_run(e)["ok"].outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=float("nan")),
        dict(temperature=float("inf")),
        dict(logprobs=1.5),
        dict(seed=1.5),
    ],
)
def test_bad_sampling_values_raise_invalid_request(bad: dict) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(max_tokens=3, **bad)


def test_huge_seed_is_accepted_and_reproducible(tiny_model: Path) -> None:
    """seed + i used to overflow torch's 64-bit seed after adapter refs and queue entries."""
    e = _engine(tiny_model, enable_lora=False)
    sp = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, n=2, seed=2**64 - 1)
    e.add_request("a", "Hello", sp)
    e.add_request(
        "b", "Hello", SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=0)
    )
    done = _run(e)
    # seed + 1 wraps to 0, like torch's own 64-bit seed arithmetic
    assert done["a"].outputs[1].token_ids == done["b"].outputs[0].token_ids
    assert e.is_idle()


@pytest.mark.parametrize("adapter", ["all_r8", {"name": "a"}, 3])
def test_adapter_of_the_wrong_type_is_a_clear_error(
    tiny_model: Path, adapters: dict[str, Path], adapter: object
) -> None:
    """Not a LoRARequest (a name, a dict): InvalidRequestError naming lora_request, nothing
    held, and the engine still serves."""
    e = _engine(tiny_model, max_loras=2)
    with pytest.raises(InvalidRequestError, match="lora_request must be a LoRARequest") as err:
        e.add_request("r", "Hello", GREEDY, adapter)  # type: ignore[arg-type]
    assert err.value.param == "lora_request"
    assert not e.scheduler.waiting and "r" not in e.requests and e.is_idle()
    e.add_request("ok", "Hello", GREEDY, LoRARequest("a", adapters["all_r8"]))
    assert _run(e)["ok"].finished


def test_failed_add_request_leaves_nothing_behind(
    tiny_model: Path, adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error after the adapter was resolved must release its references and queue nothing."""
    e = _engine(tiny_model, max_loras=2)
    lora = LoRARequest("a", adapters["all_r8"])
    import loraplex.engine.intake as mod

    class Boom(RuntimeError):
        pass

    calls = {"n": 0}
    real = mod.Sequence

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise Boom("second completion")
        return real(*a, **kw)

    monkeypatch.setattr(mod, "Sequence", flaky)
    with pytest.raises(Boom):
        e.add_request("r", "Hello", SamplingParams(max_tokens=3, n=3), lora)
    monkeypatch.undo()
    assert not e.scheduler.waiting and "r" not in e.requests
    assert e.is_idle()


def test_generate_error_mid_list_with_n_and_adapter_leaves_engine_idle(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    llm = LLM(str(tiny_model), dtype="float32", max_loras=2)
    lora = LoRARequest("a", adapters["all_r8"])
    bad = SamplingParams(max_tokens=3, n=2, stop_token_ids=[10**6], min_tokens=1)
    with pytest.raises(InvalidRequestError):
        llm.generate(["Hi", "Hello"], [GREEDY, bad], [lora, lora])
    assert llm.engine.is_idle() and not llm.engine.requests
    out = llm.generate(["Hi", "Hello"], GREEDY, [lora, None])
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
    assert llm.engine.is_idle()


def test_generate_aborts_its_requests_when_a_step_raises(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(str(tiny_model), dtype="float32", enable_lora=False)
    real = llm.engine.runner.run
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(batch)

    monkeypatch.setattr(llm.engine.runner, "run", flaky)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["Hi", "Hello"], GREEDY)
    assert llm.engine.is_idle() and not llm.engine.requests
    monkeypatch.undo()
    out = llm.generate(["Hi"], GREEDY)
    assert len(out[0].outputs[0].token_ids) == 4


def test_sampler_error_does_not_advance_sequences(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If sampling raises, the step's tokens must not count as computed (the next step redoes it)."""
    e = _engine(tiny_model, enable_lora=False)
    e.add_request("r", "Hello", GREEDY)
    ref = _engine(tiny_model, enable_lora=False)
    ref.add_request("r", "Hello", GREEDY)
    want = _run(ref)["r"].outputs[0].token_ids
    real = e.sampler.__call__
    calls = {"n": 0}

    class FlakySampler:
        def __call__(self, logits, seqs):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("sampler failed")
            return real(logits, seqs)

    monkeypatch.setattr(e, "sampler", FlakySampler())
    e.step()
    with pytest.raises(RuntimeError):
        e.step()
    assert _run(e)["r"].outputs[0].token_ids == want
    assert e.is_idle()


def test_stop_string_inside_min_tokens_is_ignored(tiny_model: Path) -> None:
    """A stop string that ends within the first min_tokens tokens must not truncate the text."""
    e = _engine(tiny_model, enable_lora=False)
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    e.add_request("f", "Hello", free)
    full = _run(e)["f"].outputs[0]
    first = e.tokenizer.decode(full.token_ids[:1])
    assert len(first) >= 2
    stop = first[:2]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop], min_tokens=6)
    e.add_request("s", "Hello", sp)
    o = _run(e)["s"].outputs[0]
    assert len(o.token_ids) >= 6
    later = full.text.find(stop, len(e.tokenizer.decode(full.token_ids[:5])) - len(stop) + 1)
    if later < 0:
        assert o.finish_reason == "length" and o.text == full.text
    else:
        assert o.finish_reason == "stop" and o.text == full.text[:later]


@pytest.mark.parametrize(
    "header",
    [
        [1, 2],
        {"w": "x"},
        {"w": {"dtype": "F32", "shape": [2]}},
        {"w": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}},
        {"w": {"dtype": "F32", "shape": [-1, -2], "data_offsets": [0, 8]}},
    ],
)
def test_malformed_safetensors_header_is_a_model_load_error(tmp_path: Path, header) -> None:
    raw = json.dumps(header).encode()
    p = tmp_path / "bad.safetensors"
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 16)
    with pytest.raises(ModelLoadError, match=r"bad\.safetensors"):
        SafetensorsFile(p)


def test_output_reports_the_requested_revision(tiny_model: Path, adapters: dict[str, Path]) -> None:
    """Same content under two revisions shares one host copy; each output names its own revision."""
    e = _engine(tiny_model, max_loras=2)
    e.add_request("v1", "Hello", GREEDY, LoRARequest("a", adapters["all_r8"], revision="v1"))
    e.add_request("v2", "Hello", GREEDY, LoRARequest("a", adapters["all_r8"], revision="v2"))
    done = _run(e)
    assert done["v1"].adapter.revision == "v1"
    assert done["v2"].adapter.revision == "v2"
    assert done["v1"].adapter.sha256 == done["v2"].adapter.sha256
    assert e.is_idle()


def test_stop_strings_without_tokenizer_are_rejected(tiny_model: Path) -> None:
    """With skip_tokenizer_init there is no text: stop strings used to be silently ignored."""
    e = _engine(tiny_model, enable_lora=False, skip_tokenizer_init=True)
    with pytest.raises(InvalidRequestError, match="stop"):
        e.add_request("r", [5, 6, 7], SamplingParams(max_tokens=3, stop=["x"]))
    assert e.is_idle() and not e.requests
