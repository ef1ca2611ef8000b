"""Structured outputs: JSON Schema, regex, choice, EBNF and Lark grammars constrain generation;
constrained, unconstrained and different-adapter sequences share one batch; grammars are
compiled off the engine thread and cached; a grammar that cannot be compiled is a clear
InvalidRequestError naming the field, and nothing is left behind."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import jsonschema
import pytest

from loraplex import LLM, InvalidRequestError, LoRARequest, SamplingParams
from loraplex.engine.structured import choice_ebnf, grammar_key
from loraplex.requests import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "size": {"enum": ["small", "large"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["ok", "size", "tags"],
    "additionalProperties": False,
}
PROMPT = "Answer in JSON please:"


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> LLM:
    return LLM(str(tiny_model), dtype="float32", enable_lora=True, max_loras=2)


def _sp(so: StructuredOutput | None, **kw: object) -> SamplingParams:
    base: dict = dict(temperature=0.8, seed=3, max_tokens=120)
    base.update(kw)
    return SamplingParams(structured=so, **base)


def test_every_kind_constrains_a_mixed_batch(llm: LLM, adapters: dict[str, Path]) -> None:
    lora = LoRARequest("all_r8", str(adapters["all_r8"]))
    choices = ('caf\u00e9 "au lait"', "tea\\milk", "water")
    specs = [
        StructuredOutput(json_schema=SCHEMA),
        StructuredOutput(json_schema={"type": "object"}),  # OpenAI's json_object
        StructuredOutput(regex=r"[a-c]{2}-\d{3}"),
        StructuredOutput(choice=choices),
        StructuredOutput(grammar='root ::= "x" ("y" | "z")+ "!"'),
        StructuredOutput(grammar='start: "ab" NUM\nNUM: /[0-9]{1,4}/'),  # Lark
        None,
    ]
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = llm.generate(PROMPT, plain, lora)[0].outputs[0]
    sps = [_sp(so) for so in specs] + [plain]
    loras = [lora if i % 2 else None for i in range(len(specs))] + [lora]
    outs = llm.generate([PROMPT] * len(sps), sps, loras)
    texts = [o.outputs[0].text for o in outs]
    for o in outs[:6]:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0]
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert isinstance(json.loads(texts[1]), dict)
    assert re.fullmatch(r"[a-c]{2}-\d{3}", texts[2])
    assert texts[3] in choices
    assert re.fullmatch(r"x[yz]+!", texts[4])
    assert re.fullmatch(r"ab[0-9]{1,4}", texts[5])
    # the unconstrained rows are untouched by their neighbours' masks
    assert outs[-1].outputs[0].token_ids == alone.token_ids
    assert llm.engine.is_idle()


def test_greedy_and_sampled_choices(llm: LLM) -> None:
    so = StructuredOutput(choice=["yes", "no", "maybe so"])
    seen = set()
    for seed in range(6):
        out = llm.generate(PROMPT, _sp(so, seed=seed, temperature=1.5, n=2))[0]
        seen |= {o.text for o in out.outputs}
    assert seen <= {"yes", "no", "maybe so"} and len(seen) >= 2
    g = llm.generate(PROMPT, _sp(so, temperature=0))[0].outputs[0]
    assert g.text in {"yes", "no", "maybe so"} and g.finish_reason == "stop"


def test_grammar_with_min_tokens_and_penalties(llm: LLM) -> None:
    """min_tokens cannot force text the grammar forbids; penalties and bias act within it."""
    so = StructuredOutput(regex=r"(ab|cd)")
    out = llm.generate(PROMPT, _sp(so, min_tokens=5, repetition_penalty=1.5))[0].outputs[0]
    assert out.text in ("ab", "cd")
    tok = llm.get_tokenizer()
    bias = {t: -100.0 for t in tok("ab", add_special_tokens=False).input_ids}
    biased = llm.generate(PROMPT, _sp(so, temperature=0, logit_bias=bias))[0].outputs[0]
    assert biased.text in ("ab", "cd")


def test_compiled_once_off_the_engine_thread(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), dtype="float32", enable_lora=False)
    backend = llm.engine.structured_outputs
    threads: list[str] = []
    real = backend._compile

    def recording(so: StructuredOutput):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread().name)
        return real(so)

    backend._compile = recording  # type: ignore[method-assign]
    so = StructuredOutput(json_schema=SCHEMA)
    same = StructuredOutput(json_schema=json.loads(json.dumps(SCHEMA, sort_keys=True)))
    outs = llm.generate([PROMPT] * 3, [_sp(so), _sp(same), _sp(so, seed=11)])
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    assert backend.num_compiled == 1 and len(threads) == 1
    assert threads[0].startswith("loraplex-grammar")
    assert threads[0] != threading.current_thread().name
    assert grammar_key(so) == grammar_key(same)


@pytest.mark.parametrize(
    "so, field",
    [
        (StructuredOutput(regex="(((a"), "regex"),
        (StructuredOutput(grammar="root ::= undefined_rule"), "grammar"),
        (StructuredOutput(json_schema={"type": "nonsense"}), "json_schema"),
    ],
)
def test_uncompilable_grammar_is_a_clear_error(
    llm: LLM, adapters: dict[str, Path], so: StructuredOutput, field: str
) -> None:
    lora = LoRARequest("all_r8", str(adapters["all_r8"]))
    with pytest.raises(InvalidRequestError, match=field) as e:
        llm.generate(PROMPT, _sp(so), lora)
    assert e.value.param == field
    assert llm.engine.is_idle() and not llm.engine.requests
    # and a failure is not cached: the same engine serves valid grammars after it
    ok = llm.generate(PROMPT, _sp(StructuredOutput(regex="ok")))[0].outputs[0]
    assert ok.text == "ok"


def test_structured_output_spec_validation() -> None:
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutput()
    with pytest.raises(InvalidRequestError, match="exactly one") as e:
        StructuredOutput(regex="a", choice=("a",))
    assert e.value.param == "choice"
    with pytest.raises(InvalidRequestError, match="choice") as e:
        StructuredOutput(choice=("a", ""))
    with pytest.raises(InvalidRequestError, match="json_schema"):
        StructuredOutput(json_schema="{}")  # type: ignore[arg-type]
    assert StructuredOutput(choice=["a", "b"]).choice == ("a", "b")
    assert StructuredOutput(regex="x").kind == "regex"
    assert choice_ebnf(('a"b',)) == 'root ::= "a\\"b"'
    with pytest.raises(InvalidRequestError, match="structured"):
        SamplingParams(structured={"regex": "a"})  # type: ignore[arg-type]


def test_structured_outputs_need_a_tokenizer(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), dtype="float32", enable_lora=False, skip_tokenizer_init=True)
    with pytest.raises(InvalidRequestError, match="tokenizer") as e:
        llm.generate([[5, 6, 7]], _sp(StructuredOutput(regex="a+")))
    assert e.value.param == "structured_outputs"
    assert llm.engine.is_idle()
