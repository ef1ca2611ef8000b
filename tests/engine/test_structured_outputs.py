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
        # OpenAI's json_object, asking for whitespace: a free-form object has no length bound,
        # and a random model closes it soonest when it may write whitespace (compact JSON is
        # the schema's row above, bounded by its schema)
        StructuredOutput(json_schema={"type": "object"}, disable_any_whitespace=False),
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


# -- JSON whitespace: compact by default, whitespace per request or flag, unbounded only when asked
# A flat schema of booleans and enums: its longest compact text is known, so a bound on the
# whitespace per gap bounds the whole output.
FLAT = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]}},
    "required": ["ok", "size"],
    "additionalProperties": False,
}
OK_ONLY = {  # the finding: {"ok": boolean} with max_tokens 40
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


def whitespace_ids(tok: object) -> list[int]:
    """The vocabulary's whitespace-only tokens (newline, space, tab, ...)."""
    n = len(tok)  # type: ignore[arg-type]
    texts = ((t, tok.decode([t])) for t in range(n))  # type: ignore[attr-defined]
    return [t for t, s in texts if s and not s.strip(" \n\r\t")]


def token_budget(schema: dict, per_gap: int, separators: tuple[str, str] = (",", ":")) -> int:
    """The most tokens a constrained output of the flat ``schema`` can take: its longest text
    with ``separators`` plus, for k members, 4k gaps (after ``{``, around each ``:`` and ``,``,
    before ``}``) of at most ``per_gap`` whitespace characters; every token is at least one
    character, and one more for the stop token."""
    longest = {
        k: False if v.get("type") == "boolean" else max(v["enum"], key=lambda e: len(json.dumps(e)))
        for k, v in schema["properties"].items()
    }
    text = json.dumps(longest, separators=separators)
    return len(text) + 4 * len(longest) * per_gap + 1


@pytest.fixture(scope="module")
def ws_bias(llm: LLM) -> dict[int, float]:
    """logit_bias that makes a random model all but certain to write whitespace."""
    ids = whitespace_ids(llm.get_tokenizer())
    assert {"\n", " "} <= {llm.get_tokenizer().decode([t]) for t in ids}
    return {t: 100.0 for t in ids}


def test_whitespace_modes_and_bound() -> None:
    from loraplex.config import EngineConfig
    from loraplex.config.fields import setting_of
    from loraplex.engine.structured import (
        MAX_JSON_WHITESPACE,
        WHITESPACE_MODES,
        json_schema_options,
        json_whitespace,
    )

    flag = setting_of(EngineConfig.__dataclass_fields__["structured_outputs_whitespace"])
    assert flag is not None and set(flag.choices) == set(WHITESPACE_MODES)
    assert EngineConfig(model="m").structured_outputs_whitespace == "compact"
    assert f"at most {MAX_JSON_WHITESPACE} characters" in flag.help
    assert json_schema_options("bounded") == {
        "any_whitespace": True,
        "max_whitespace_cnt": MAX_JSON_WHITESPACE,
    }
    assert json_schema_options("any") == {"any_whitespace": True}
    assert json_schema_options("compact") == {"any_whitespace": False}
    with pytest.raises(ValueError, match="bounded"):
        json_schema_options("pretty")
    unset, compact, spaced = (
        StructuredOutput(json_schema=FLAT),
        StructuredOutput(json_schema=FLAT, disable_any_whitespace=True),
        StructuredOutput(json_schema=FLAT, disable_any_whitespace=False),
    )
    # the request's choice against each server mode
    for server, want in (("compact", ("compact", "compact", "bounded")),
                         ("bounded", ("bounded", "compact", "bounded")),
                         ("any", ("any", "compact", "any"))):  # fmt: skip
        got = tuple(json_whitespace(so, server) for so in (unset, compact, spaced))
        assert got == want, server
    assert grammar_key(unset) == grammar_key(compact)  # compact by default
    assert grammar_key(spaced) == grammar_key(unset, "bounded")
    keys = {grammar_key(unset), grammar_key(spaced), grammar_key(unset, "any")}
    assert len(keys) == 3  # each mode is its own compiled grammar
    assert grammar_key(compact, "any") == grammar_key(compact)  # the request's compact wins
    regex = StructuredOutput(regex="a", disable_any_whitespace=True)
    assert grammar_key(regex) == grammar_key(StructuredOutput(regex="a"), "any")
    with pytest.raises(InvalidRequestError, match="disable_any_whitespace"):
        StructuredOutput(json_schema=FLAT, disable_any_whitespace=1)  # type: ignore[arg-type]


def _accepts(state: object, tok: object, text: str) -> bool:
    ids = tok(text, add_special_tokens=False).input_ids  # type: ignore[operator]
    return all(state.accept(t) for t in ids)  # type: ignore[attr-defined]


def test_bounded_grammar_keeps_pretty_json(llm: LLM) -> None:
    """By default JSON is one compact line; a request that asks for whitespace
    (disable_any_whitespace false) gets the bounded grammar, where pretty-printed JSON is legal
    (indent 4 three levels deep, indent 2 seven deep) and a gap of more than
    MAX_JSON_WHITESPACE characters is not."""
    from loraplex.engine.structured import MAX_JSON_WHITESPACE

    tok, backend = llm.get_tokenizer(), llm.engine.structured_outputs
    assert backend.whitespace == "compact"
    deep: dict = {"ok": True}
    for _ in range(6):
        deep = {"d": deep}
    nested = StructuredOutput(json_schema={"type": "object"}, disable_any_whitespace=False)
    for indent, value in ((4, deep["d"]["d"]["d"]["d"]), (2, deep)):
        assert _accepts(backend.new_state(nested), tok, json.dumps(value, indent=indent))
    too_far = "{" + " " * (MAX_JSON_WHITESPACE + 1) + '"ok": true}'
    assert _accepts(backend.new_state(nested), tok, "{" + " " * MAX_JSON_WHITESPACE + '"a": 1}')
    assert not _accepts(backend.new_state(nested), tok, too_far)
    for compact in (
        StructuredOutput(json_schema=FLAT),
        StructuredOutput(json_schema=FLAT, disable_any_whitespace=True),
    ):
        assert _accepts(backend.new_state(compact), tok, '{"ok": true, "size": "small"}')
        assert not _accepts(backend.new_state(compact), tok, '{"ok":true,"size":"small"}')
        assert not _accepts(backend.new_state(compact), tok, '{\n"ok": true')


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 5), (1.0, 17)])
def test_whitespace_loving_model_writes_compact_json_by_default(
    llm: LLM, ws_bias: dict[int, float], temperature: float, seed: int | None
) -> None:
    """The issue's finding: a model pushed to whitespace, {"ok": boolean}, max_tokens 40. By
    default the answer is the compact text itself (it parses, one line), within the token
    budget of at most one whitespace character per gap."""
    sp = _sp(StructuredOutput(json_schema=OK_ONLY), temperature=temperature, seed=seed,
             max_tokens=40, logit_bias=ws_bias)  # fmt: skip
    out = llm.generate(PROMPT, sp)[0].outputs[0]
    assert out.finish_reason == "stop", out
    value = json.loads(out.text)
    jsonschema.validate(value, OK_ONLY)
    assert out.text == json.dumps(value)  # one line, ", " and ": " separators
    assert len(out.token_ids) <= token_budget(OK_ONLY, 1)


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 5), (1.0, 17)])
def test_whitespace_loving_model_closes_its_json_within_budget(
    llm: LLM, ws_bias: dict[int, float], temperature: float, seed: int | None
) -> None:
    """Asked for whitespace (disable_any_whitespace false: the bounded grammar), the random
    model pushed to whitespace still closes the JSON: at most MAX_JSON_WHITESPACE whitespace
    characters per gap leave it a derived token budget."""
    from loraplex.engine.structured import MAX_JSON_WHITESPACE

    budget = token_budget(FLAT, MAX_JSON_WHITESPACE)
    spaced = StructuredOutput(json_schema=FLAT, disable_any_whitespace=False)
    sp = _sp(spaced, temperature=temperature, seed=seed, max_tokens=budget, logit_bias=ws_bias)
    out = llm.generate(PROMPT, sp)[0].outputs[0]
    assert out.finish_reason == "stop", out
    assert len(out.token_ids) <= budget
    jsonschema.validate(json.loads(out.text), FLAT)
    assert len(out.text) - len(re.sub(r"\s", "", out.text)) > 8  # it did favour whitespace
    assert not re.search(rf"\s{{{MAX_JSON_WHITESPACE + 1}}}", out.text)


def test_compact_per_request_and_old_grammar_by_flag(
    llm: LLM, ws_bias: dict[int, float], tiny_model: Path
) -> None:
    """disable_any_whitespace: one line whatever the bias. --structured-outputs-whitespace any
    (the old grammar): the same model and budget write only whitespace and never close."""
    from loraplex.engine.structured import MAX_JSON_WHITESPACE

    budget = token_budget(FLAT, MAX_JSON_WHITESPACE)
    compact = StructuredOutput(json_schema=FLAT, disable_any_whitespace=True)
    out = llm.generate(PROMPT, _sp(compact, max_tokens=budget, logit_bias=ws_bias))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == json.dumps(json.loads(out.text))  # separators ", " and ": ", one line
    jsonschema.validate(json.loads(out.text), FLAT)

    old = LLM(str(tiny_model), dtype="float32", enable_lora=False,
              structured_outputs_whitespace="any")  # fmt: skip
    assert old.engine.structured_outputs.whitespace == "any"
    sp = _sp(StructuredOutput(json_schema=FLAT), temperature=0, max_tokens=budget,
             logit_bias=ws_bias)  # fmt: skip
    run = old.generate(PROMPT, sp)[0].outputs[0]
    assert run.finish_reason == "length" and len(run.token_ids) == budget
    assert re.fullmatch(r"\{\s+", run.text), run.text  # "{" then whitespace to the end
    with pytest.raises(json.JSONDecodeError):
        json.loads(run.text)
    # a request's disable_any_whitespace still gets compact JSON from that engine
    fixed = old.generate(PROMPT, _sp(compact, max_tokens=budget, logit_bias=ws_bias))[0]
    jsonschema.validate(json.loads(fixed.outputs[0].text), FLAT)


def test_serve_flag_and_request_field(tiny_model: Path) -> None:
    from loraplex.server.args import parse_serve_args
    from loraplex.server.protocol import ChatCompletionRequest, CompletionRequest

    for argv, want in (([], "compact"), (["--structured-outputs-whitespace", "any"], "any"),
                       (["--structured-outputs-whitespace", "bounded"], "bounded")):  # fmt: skip
        cfg = parse_serve_args([str(tiny_model), *argv], environ={})
        assert cfg.engine.structured_outputs_whitespace == want
    msgs = [{"role": "user", "content": "x"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": FLAT}}
    no_ws = {"disable_any_whitespace": True}
    bodies = [
        {"messages": msgs, "response_format": {"type": "json_object"}, "structured_outputs": no_ws},
        {"messages": msgs, "structured_outputs": {"json": FLAT, **no_ws}},
        {"messages": msgs, "tools": [tool], "tool_choice": "required", "structured_outputs": no_ws},
        {"messages": msgs, "response_format": {"type": "json_schema", "json_schema": {
            "name": "a", "schema": FLAT}}, "structured_outputs": no_ws},
    ]  # fmt: skip
    for body in bodies:
        so = (
            ChatCompletionRequest.model_validate({"model": "m", **body})
            .sampling_params()
            .structured
        )
        assert so is not None and so.kind == "json_schema" and so.disable_any_whitespace, body
    plain = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": msgs, "guided_json": FLAT}
    ).sampling_params()
    assert plain.structured is not None and plain.structured.disable_any_whitespace is None
    spaced = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": msgs, "response_format": {"type": "json_object"},
         "structured_outputs": {"disable_any_whitespace": False}}
    ).sampling_params()  # fmt: skip
    assert spaced.structured is not None and spaced.structured.disable_any_whitespace is False
    regex = CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "structured_outputs": {"regex": "a+", **no_ws}}
    ).sampling_params()
    assert regex.structured == StructuredOutput(regex="a+")  # no JSON whitespace to disable
    for extra in ({"whitespace_pattern": " "}, {"disable_additional_properties": True}):
        body = {"model": "m", "prompt": "x", "structured_outputs": {"json": FLAT, **extra}}
        with pytest.raises(InvalidRequestError, match=next(iter(extra))) as e:
            CompletionRequest.model_validate(body).sampling_params()
        assert e.value.param == "structured_outputs"


def test_whitespace_over_http(tiny_model: Path) -> None:
    """The finding, through the server: a json_schema chat request for {"ok": boolean} with
    max_tokens 40 whose model favours whitespace comes back as compact, valid JSON by default
    and with structured_outputs.disable_any_whitespace true; with it false (pretty printing
    asked for) it writes whitespace and still closes within the bounded grammar's budget."""
    import httpx

    from loraplex.config import EngineConfig, ServerConfig
    from loraplex.engine.structured import MAX_JSON_WHITESPACE
    from loraplex.server.app import create_app
    from loraplex.testing.server import serve_in_thread

    config = ServerConfig(
        EngineConfig(model=str(tiny_model), enable_lora=False, num_threads=1),
        served_model_name=["tiny"],
        log_level="warning",
    )
    app = create_app(config)
    tok = app.state.loraplex.engine.tokenizer
    bias = {str(t): 100 for t in whitespace_ids(tok)}
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Answer in JSON."}],
        "max_tokens": 40,
        "temperature": 0,
        "logit_bias": bias,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": OK_ONLY}},
    }
    spaced_budget = token_budget(OK_ONLY, MAX_JSON_WHITESPACE)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as h:
        for whitespace in (None, True, False):
            extra = {} if whitespace is None else {
                "structured_outputs": {"disable_any_whitespace": whitespace},
                "max_tokens": spaced_budget,
            }  # fmt: skip
            r = h.post("/v1/chat/completions", json={**body, **extra})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            text = choice["message"]["content"]
            assert choice["finish_reason"] == "stop", choice
            jsonschema.validate(json.loads(text), OK_ONLY)
            if whitespace is False:
                assert "\n" in text or "  " in text  # bounded, not compact: it wrote whitespace
                assert r.json()["usage"]["completion_tokens"] <= spaced_budget
            else:
                assert text == json.dumps(json.loads(text))
                assert r.json()["usage"]["completion_tokens"] <= token_budget(OK_ONLY, 1)
