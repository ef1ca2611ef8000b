"""vLLM compatibility of the HTTP API, with the official ``openai`` client on a live server.

One server per module (tiny model, two adapters, ``--enable-auto-tool-choice
--tool-call-parser hermes``). Each vLLM field is checked against what it means: sampling fields
against the offline ``LLM`` API run with the same SamplingParams, structured outputs against
their schema (``jsonschema``), tool calls parsed, echo + logprobs (lm-eval's loglikelihood
request) against transformers + PEFT merged, streams for their one-chunk-per-token shape,
logprob entries for distinct names and true bytes.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch
from transformers import AutoTokenizer

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.config import LoRAModule, ServerConfig
from loraplex.engine.client import EngineClient
from loraplex.server.app import ServerState, create_app
from loraplex.testing import load_merged_reference, sync
from loraplex.testing.server import serve_in_thread

BASE = "tiny"
ADAPTERS = ("all_r8", "mlp_r16")
PROMPT = "The capital of France is"


@dataclass
class Server:
    url: str
    state: ServerState
    names: dict[str, Path]

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=60)

    def lora(self, name: str | None) -> LoRARequest | None:
        return None if name is None else LoRARequest(name, str(self.names[name]))


@pytest.fixture(scope="module")
def server(tiny_model: Path, adapters: dict[str, Path]) -> Iterator[Server]:
    from loraplex.config import EngineConfig

    names = {n: adapters[n] for n in ADAPTERS}
    config = ServerConfig(
        EngineConfig(model=str(tiny_model), enable_lora=True, max_loras=2, num_threads=1),
        served_model_name=[BASE],
        lora_modules=[LoRAModule(n, str(p)) for n, p in names.items()],
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
        log_level="warning",
    )
    app = create_app(config)
    with serve_in_thread(app) as url:
        yield Server(url, app.state.loraplex, names)


@pytest.fixture(scope="module")
def offline(tiny_model: Path) -> LLM:
    return LLM(str(tiny_model), max_loras=2, num_threads=1)


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model))


def wait_idle(server: Server) -> None:
    sync.wait_idle(server.state.engine, server.state.aengine)


def sse(h: httpx.Client, path: str, body: dict[str, Any]) -> tuple[bytes, list[dict[str, Any]]]:
    """The raw bytes of a stream and its JSON events (``[DONE]`` checked and dropped)."""
    with h.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        raw = r.read()
    events = [line[6:] for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return raw, [json.loads(e) for e in events[:-1]]


def token_name(tok: Any, tid: int) -> str:
    """What a logprob entry must call a token: its text where it is whole UTF-8 on its own,
    else its own vocabulary piece (so byte tokens never share a name)."""
    text = tok.decode([tid])
    return tok.convert_ids_to_tokens(tid) if "\ufffd" in text else text


def token_bytes(tok: Any, tid: int) -> bytes:
    """The bytes of one byte-level BPE token, from GPT-2's byte map as transformers has it."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    decoder = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(decoder[c] for c in tok.convert_ids_to_tokens(tid))


# -- sampling fields: the server runs what the offline API runs with the same params ---------
@pytest.mark.parametrize(
    ("fields", "params"),
    [
        ({"presence_penalty": 1.5}, {"presence_penalty": 1.5}),
        ({"frequency_penalty": 1.2}, {"frequency_penalty": 1.2}),
        ({"repetition_penalty": 1.3}, {"repetition_penalty": 1.3}),
        ({"min_p": 0.2, "temperature": 0.9, "seed": 7}, {"min_p": 0.2, "temperature": 0.9,
                                                          "seed": 7}),
        ({"n": 1, "best_of": 3, "temperature": 1.0, "seed": 3},
         {"n": 1, "best_of": 3, "temperature": 1.0, "seed": 3}),
    ],
)  # fmt: skip
def test_sampling_fields_match_offline(
    server: Server, offline: LLM, fields: dict[str, Any], params: dict[str, Any]
) -> None:
    base = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    for model in (None, "all_r8"):
        (ref,) = offline.generate(
            PROMPT, SamplingParams(**{**base, **params}), lora_request=server.lora(model)
        )
        r = server.client().completions.create(
            model=model or BASE,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True, **fields},
        )
        assert [c.text for c in r.choices] == [o.text for o in ref.outputs]
    wait_idle(server)


def test_logit_bias_forces_a_token(server: Server, tokenizer: Any) -> None:
    tid = tokenizer(" Paris").input_ids[-1]
    r = server.client().completions.create(
        model="mlp_r16",
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        logit_bias={str(tid): 100},
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].logprobs is not None
    assert r.choices[0].logprobs.tokens == [token_name(tokenizer, tid)] * 5
    wait_idle(server)


def test_generation_defaults_fill_omitted_fields(server: Server) -> None:
    """The model's generation_config defaults apply to the fields a request leaves out."""
    from loraplex.server.protocol import ChatCompletionRequest, CompletionRequest

    defaults = {"temperature": 0.0, "top_p": 0.5, "top_k": 7, "repetition_penalty": 1.1,
                "max_tokens": 9}  # fmt: skip
    c = CompletionRequest(model=BASE, prompt="x", top_p=0.9)
    p = c.sampling_params(defaults)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.0, 0.9, 7, 1.1)
    assert p.max_tokens == 9  # max_tokens omitted: the model's default (not 16)
    p = CompletionRequest(model=BASE, prompt="x", max_tokens=3).sampling_params(defaults)
    assert p.max_tokens == 3
    chat = ChatCompletionRequest.model_validate(
        {"model": BASE, "messages": [{"role": "user", "content": "x"}], "temperature": 0.4}
    )
    p = chat.sampling_params(defaults)
    assert (p.temperature, p.top_k, p.max_tokens) == (0.4, 7, 9)
    assert isinstance(server.state.client, EngineClient)
    assert isinstance(server.state.client.generation_defaults, dict)


# -- structured outputs -----------------------------------------------------------------------
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}


# Random weights under a JSON grammar that allows any whitespace may write whitespace for a
# long time; these (model, temperature, seed) end well within max_tokens (checked: "stop").
JSON_OBJECT_RUNS = {None: (0.7, 21), "all_r8": (0.0, None)}


@pytest.mark.parametrize("model", [None, "all_r8"])
def test_response_format_json_schema_and_object(server: Server, model: str | None) -> None:
    client = server.client()
    messages: list[Any] = [{"role": "user", "content": "Answer in JSON."}]
    r = client.chat.completions.create(
        model=model or BASE,
        messages=messages,
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), SCHEMA)
    temperature, seed = JSON_OBJECT_RUNS[model]
    r = client.chat.completions.create(
        model=model or BASE,
        messages=messages,
        max_tokens=200,
        temperature=temperature,
        seed=seed,
        response_format={"type": "json_object"},
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    wait_idle(server)


def test_guided_fields_and_structured_outputs(server: Server) -> None:
    client = server.client()
    choices = ["Paris", "Rome", "Madrid"]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        r = client.completions.create(
            model="mlp_r16", prompt=PROMPT, max_tokens=20, temperature=0.8, seed=1,
            n=3, extra_body=extra,
        )  # fmt: skip
        assert [c.text in choices for c in r.choices] == [True] * 3
    pattern = r"[a-c]{2}-[0-9]{3}"
    for extra in ({"guided_regex": pattern}, {"structured_outputs": {"regex": pattern}}):
        r = client.completions.create(
            model=BASE, prompt=PROMPT, max_tokens=20, temperature=0, extra_body=extra
        )
        assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text
    for extra in ({"guided_json": SCHEMA}, {"guided_json": json.dumps(SCHEMA)},
                  {"structured_outputs": {"json": SCHEMA}}):  # fmt: skip
        r = client.completions.create(
            model="mlp_r16", prompt=PROMPT, max_tokens=200, temperature=0, extra_body=extra
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    wait_idle(server)


def test_constrained_and_free_requests_share_a_batch(server: Server, offline: LLM) -> None:
    """A guided request running beside unconstrained ones leaves their output unchanged."""
    import concurrent.futures as cf

    client = server.client()
    (ref,) = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                              lora_request=server.lora("mlp_r16"))  # fmt: skip

    def free() -> str:
        r = client.completions.create(model="mlp_r16", prompt=PROMPT, max_tokens=16,
                                      temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        return r.choices[0].text

    def guided() -> str:
        r = client.completions.create(model="all_r8", prompt=PROMPT, max_tokens=10,
                                      temperature=0, extra_body={"guided_choice": ["yes", "no"]})  # fmt: skip
        return r.choices[0].text

    with cf.ThreadPoolExecutor(4) as pool:
        frees = [pool.submit(free) for _ in range(2)]
        guides = [pool.submit(guided) for _ in range(2)]
        assert [f.result() for f in frees] == [ref.outputs[0].text] * 2
        assert {g.result() for g in guides} <= {"yes", "no"}
    wait_idle(server)


# -- tools ------------------------------------------------------------------------------------
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}, "celsius": {"type": "boolean"}},
            "required": ["city", "celsius"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_named_and_required_tool_choice_are_enforced(server: Server) -> None:
    client = server.client()
    r = client.chat.completions.create(
        model="all_r8", messages=ASK, tools=[WEATHER, TIME], max_tokens=120, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    (call,) = r.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    # the array of calls has no length bound: this run (chosen under the bounded grammar) asks
    # for whitespace, which is where the random model closes it
    r = client.chat.completions.create(
        model=BASE, messages=ASK, tools=[WEATHER, TIME], max_tokens=400, temperature=0,
        tool_choice="required",
        extra_body={"structured_outputs": {"disable_any_whitespace": False}},
    )  # fmt: skip
    calls = r.choices[0].message.tool_calls or []
    assert calls and r.choices[0].finish_reason == "tool_calls"
    by_name = {"get_weather": WEATHER, "get_time": TIME}
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments),
                            by_name[c.function.name]["function"]["parameters"])  # fmt: skip

    # streamed: the named call's arguments arrive token by token and add up to valid JSON
    stream = client.chat.completions.create(
        model="all_r8", messages=ASK, tools=[WEATHER], max_tokens=120, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True,
    )  # fmt: skip
    parts = [tc for ch in stream if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert parts[0].function is not None and parts[0].function.name == "get_weather"
    args = "".join(p.function.arguments or "" for p in parts if p.function is not None)
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])
    wait_idle(server)


def test_auto_tool_choice_parses_hermes_calls(server: Server) -> None:
    """tool_choice auto with the hermes parser: the (regex-forced) <tool_call> block becomes a
    tool call, streamed or not; text before it is content."""
    client = server.client()
    forced = (
        r'Sure\. <tool_call>\{"name": "get_weather", "arguments": '
        r'\{"city": "(Paris|Rome)", "celsius": (true|false)\}\}</tool_call>'
    )
    kw: dict[str, Any] = dict(model="mlp_r16", messages=ASK, tools=[WEATHER, TIME],
                              max_tokens=200, temperature=0, extra_body={"guided_regex": forced})  # fmt: skip
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Sure. "
    (call,) = msg.tool_calls or []
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    chunks = list(client.chat.completions.create(**kw, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Sure. "
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert len(calls) == 1 and calls[0].function is not None
    assert calls[0].function.name == "get_weather"
    assert calls[0].function.arguments == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # without a tool call in the text, the text is content
    plain = client.chat.completions.create(
        model=BASE, messages=ASK, tools=[WEATHER], max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert plain.choices[0].message.tool_calls in (None, [])
    assert plain.choices[0].finish_reason == "length"
    wait_idle(server)


def test_tool_parsers() -> None:
    from loraplex.config import TOOL_CALL_PARSERS
    from loraplex.server.tools import PARSERS, HermesToolParser, Llama3JsonToolParser

    assert tuple(PARSERS) == TOOL_CALL_PARSERS  # the flag's choices are the parsers

    h = HermesToolParser()
    ex = h.extract('Hi <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\n'
                   '<tool_call>{"name": "g", "arguments": {}}</tool_call>')  # fmt: skip
    assert ex.content == "Hi " and [(c.name, json.loads(c.arguments)) for c in ex.calls] == [
        ("f", {"x": 1}), ("g", {})
    ]  # fmt: skip
    assert h.extract("<tool_call>{not json}</tool_call>").calls == []
    assert h.content_end("Hello <tool_") == len("Hello ")
    assert h.content_end("Hello <tool_call>{") == len("Hello ")
    assert h.content_end("Hello") == 5
    ll = Llama3JsonToolParser()
    ex = ll.extract('{"name": "f", "parameters": {"a": "b"}}; {"name": "g", "parameters": {}}')
    assert ex.content is None and [c.name for c in ex.calls] == ["f", "g"]
    assert json.loads(ex.calls[0].arguments) == {"a": "b"}
    ex = ll.extract('<|python_tag|>{"name": "f", "parameters": {}}')
    assert [c.name for c in ex.calls] == ["f"]
    assert ll.extract("The answer is 4").calls == []
    assert ll.content_end("  {") == 0 and ll.content_end("Plain") == 5


# -- echo + logprobs: lm-eval's loglikelihood requests ----------------------------------------
@pytest.mark.parametrize("model", [None, "all_r8"])
@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_equal_transformers(
    server: Server, tiny_model: Path, tokenizer: Any, model: str | None, max_tokens: int
) -> None:
    """What ``lm-eval --model local-completions`` sends (token-id prompts, echo, logprobs=1,
    max_tokens 0 or 1): each prompt token's logprob equals transformers + PEFT merged."""
    contexts = ["The capital of France is Paris.", "Hello world! How are you"]
    ids = [tokenizer(c).input_ids for c in contexts]
    adapter = server.names[model] if model else None
    ref_model = load_merged_reference(tiny_model, adapter)
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={
            "model": model or BASE,
            "prompt": ids,
            "echo": True,
            "logprobs": 1,
            "max_tokens": max_tokens,
            "temperature": 0,
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    for prompt_ids, choice in zip(ids, r.json()["choices"], strict=True):
        lp = choice["logprobs"]
        n = len(prompt_ids) + max_tokens
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        with torch.no_grad():
            logits = ref_model(torch.tensor([prompt_ids])).logits[0].float()
        want = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(prompt_ids[1:])[:, None])
        got = lp["token_logprobs"][1 : len(prompt_ids)]
        assert got == pytest.approx(want[:, 0].tolist(), abs=1e-4)
        for tid, top, v in zip(prompt_ids[1:], lp["top_logprobs"][1:], got, strict=False):
            assert top[token_name(tokenizer, tid)] == pytest.approx(v)
            assert 1 <= len(top) <= 2  # the token itself and the most likely one
        text = choice["text"]
        assert text.startswith(tokenizer.decode(prompt_ids))
        if max_tokens == 0:
            assert text == tokenizer.decode(prompt_ids)
    wait_idle(server)


def test_prompt_logprobs_field(server: Server, tiny_model: Path, tokenizer: Any) -> None:
    ids = tokenizer(PROMPT).input_ids
    with server.http() as h:
        r = h.post("/v1/completions", json={"model": BASE, "prompt": PROMPT, "max_tokens": 2,
                                            "prompt_logprobs": 3})  # fmt: skip
        assert r.status_code == 200, r.text
        plp = r.json()["choices"][0]["prompt_logprobs"]
        chat = h.post("/v1/chat/completions", json={
            "model": BASE, "messages": ASK, "max_tokens": 2, "prompt_logprobs": 0})  # fmt: skip
        assert chat.status_code == 200 and len(chat.json()["prompt_logprobs"]) > 1
        streamed = h.post("/v1/completions", json={"model": BASE, "prompt": PROMPT,
                                                   "prompt_logprobs": 2, "stream": True})  # fmt: skip
        assert (
            streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
        )
    assert len(plp) == len(ids) and plp[0] is None
    ref = load_merged_reference(tiny_model, None)
    with torch.no_grad():
        logp = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), -1)
    for pos in range(1, len(ids)):
        entry = plp[pos]
        assert entry[str(ids[pos])]["logprob"] == pytest.approx(
            float(logp[pos - 1, ids[pos]]), abs=1e-4
        )
        best = torch.topk(logp[pos - 1], 3).indices.tolist()
        ranked = {int(k): v["rank"] for k, v in entry.items() if v["rank"] is not None}
        assert ranked == {t: i + 1 for i, t in enumerate(best)}
    wait_idle(server)


# -- stream shape -----------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_one_chunk_per_token_ascii_sse(server: Server, tokenizer: Any, path: str) -> None:
    """Every generated token is its own chunk (even while a character is incomplete), the
    chunks add up to the non-streamed text, SSE lines are ASCII, and continuous usage counts
    tokens as they come."""
    n = 24
    body: dict[str, Any] = {"model": "all_r8", "max_tokens": n, "temperature": 0,
                            "ignore_eos": True}  # fmt: skip
    if path == "/v1/completions":
        body["prompt"] = "Unicode \u2028 line \u0085 sep é"
        body["echo"] = True
        text_of = lambda c: c["text"]  # noqa: E731
    else:
        body["messages"] = [{"role": "user", "content": "Unicode \u2028 line \u0085 sep é"}]
        text_of = lambda c: c["delta"].get("content") or ""  # noqa: E731
    with server.http() as h:
        full = h.post(path, json=body).json()
        raw, events = sse(h, path, {**body, "stream_options": {"include_usage": True,
                                                               "continuous_usage_stats": True}})  # fmt: skip
    assert all(b < 0x80 for b in raw)  # ASCII-safe: U+2028 / U+0085 never raw on a line
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == n
    if path == "/v1/completions":
        token_chunks = chunks
        want = full["choices"][0]["text"]
    else:
        token_chunks = chunks[1:]  # the first chunk opens the assistant message
        want = full["choices"][0]["message"]["content"]
    assert len(token_chunks) == n
    # a token ending inside a character still has its chunk (empty text), as in vLLM
    assert any(text_of(c["choices"][0]) == "" for c in token_chunks)
    assert "".join(text_of(c["choices"][0]) for c in chunks) == want
    assert [c["usage"]["completion_tokens"] for c in token_chunks] == list(range(1, n + 1))
    assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"
    wait_idle(server)


# -- logprob entries keyed by token, with true bytes -----------------------------------------
def test_logprob_entries_are_distinct_and_carry_token_bytes(
    server: Server, offline: LLM, tokenizer: Any
) -> None:
    """Random weights on a byte-level vocabulary sample many bytes that are not whole
    characters: each keeps its own entry and its own bytes."""
    client = server.client()
    r = client.chat.completions.create(
        model=BASE, messages=ASK, max_tokens=40, temperature=1.0, seed=5, logprobs=True,
        top_logprobs=20, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = r.choices[0].logprobs.content if r.choices[0].logprobs else None
    assert content is not None and len(content) == 40
    partial = 0
    for entry in content:
        names = [t.token for t in entry.top_logprobs]
        assert len(set(names)) == len(names) == 20
        assert b"".join(bytes(t.bytes or []) for t in entry.top_logprobs)  # every entry has bytes
        partial += "\ufffd" in bytes(entry.bytes or []).decode("utf-8", errors="replace")
    assert partial > 0  # the case this test is about did occur
    whole = b"".join(bytes(e.bytes or []) for e in content)
    assert whole.decode("utf-8", errors="replace") == r.choices[0].message.content
    wait_idle(server)


def test_completion_logprob_tokens_name_each_token(
    server: Server, offline: LLM, tokenizer: Any
) -> None:
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=11, ignore_eos=True, logprobs=5)
    (ref,) = offline.generate(PROMPT, params)
    r = server.client().completions.create(
        model=BASE, prompt=PROMPT, max_tokens=30, temperature=1.0, seed=11, logprobs=5,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    ids = ref.outputs[0].token_ids
    assert lp.tokens == [token_name(tokenizer, t) for t in ids]
    for tid, top in zip(ids, lp.top_logprobs, strict=True):
        assert token_name(tokenizer, tid) in top and 5 <= len(top) <= 6
    with server.http() as h:
        as_ids = h.post("/v1/completions", json={
            "model": BASE, "prompt": PROMPT, "max_tokens": 30, "temperature": 1.0, "seed": 11,
            "logprobs": 0, "ignore_eos": True, "return_tokens_as_token_ids": True,
            "return_token_ids": True}).json()["choices"][0]  # fmt: skip
    assert as_ids["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
    assert as_ids["token_ids"] == ids
    assert as_ids["prompt_token_ids"] == tokenizer(PROMPT).input_ids
    with server.http() as h:
        chat = h.post("/v1/chat/completions", json={
            "model": BASE, "messages": ASK, "max_tokens": 5, "ignore_eos": True,
            "return_token_ids": True}).json()  # fmt: skip
        prompt = h.post("/tokenize", json={"messages": ASK}).json()["tokens"]
        _, events = sse(h, "/v1/chat/completions", {
            "model": BASE, "messages": ASK, "max_tokens": 5, "ignore_eos": True, "temperature": 0,
            "return_token_ids": True})  # fmt: skip
    assert chat["prompt_token_ids"] == prompt
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"] == 5
    assert events[0]["prompt_token_ids"] == prompt
    assert [len(e["choices"][0]["token_ids"]) for e in events[1:]] == [1] * 5
    # bytes of byte-level tokens come from the GPT-2 byte map
    vocab = server.state.client.vocab
    for t in ids:
        assert vocab.token_bytes(t) == token_bytes(tokenizer, t)
    wait_idle(server)


# -- chat options -----------------------------------------------------------------------------
def test_chat_template_options(server: Server, tokenizer: Any) -> None:
    """continue_final_message, add_generation_prompt, chat_template and chat_template_kwargs
    reach the template (checked through /tokenize), and a continued message gets an answer."""
    convo: list[Any] = [{"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "The capital of"}]  # fmt: skip
    with server.http() as h:
        t = h.post("/tokenize", json={"model": BASE, "messages": convo,
                                      "continue_final_message": True}).json()  # fmt: skip
        want = tokenizer.apply_chat_template(convo, continue_final_message=True, tokenize=False)
        assert t["tokens"] == tokenizer(want, add_special_tokens=False).input_ids
        assert want.endswith("The capital of")
        t2 = h.post("/tokenize", json={"model": BASE, "messages": convo[:1],
                                       "add_generation_prompt": False}).json()  # fmt: skip
        want2 = tokenizer.apply_chat_template(
            convo[:1], add_generation_prompt=False, tokenize=False
        )
        assert t2["tokens"] == tokenizer(want2, add_special_tokens=False).input_ids
        template = "{{ greeting }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
        t3 = h.post("/tokenize", json={"messages": convo[:1], "chat_template": template,
                                       "chat_template_kwargs": {"greeting": "Yo"}}).json()  # fmt: skip
        assert t3["tokens"] == tokenizer("Yo[Hi]", add_special_tokens=False).input_ids
        bad = h.post("/tokenize", json={"messages": convo, "chat_template_kwargs": {"tokenize": 1}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
        r = h.post("/v1/chat/completions", json={
            "model": "all_r8", "messages": convo, "continue_final_message": True,
            "max_tokens": 4, "temperature": 0, "ignore_eos": True, "echo": True})  # fmt: skip
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        assert msg["role"] == "assistant" and msg["content"].startswith("The capital of")
        assert len(msg["content"]) > len("The capital of")
        assert r.json()["usage"]["completion_tokens"] == 4
    wait_idle(server)


def test_server_chat_template_and_prompt_options(tiny_model: Path, tokenizer: Any) -> None:
    """--chat-template replaces the tokenizer's (a request's own chat_template wins);
    completions' add_special_tokens and truncate_prompt_tokens shape the prompt."""
    from fastapi.testclient import TestClient

    from loraplex.config import EngineConfig

    config = ServerConfig(
        EngineConfig(model=str(tiny_model), num_threads=1),
        served_model_name=[BASE],
        chat_template="{% for m in messages %}<{{ m['content'] }}>{% endfor %}",
    )
    with TestClient(create_app(config)) as h:
        t = h.post("/tokenize", json={"messages": ASK}).json()
        assert (
            t["tokens"] == tokenizer(f"<{ASK[0]['content']}>", add_special_tokens=False).input_ids
        )
        own = h.post(
            "/tokenize", json={"messages": ASK, "chat_template": "{{ messages[0]['role'] }}"}
        )
        assert own.json()["tokens"] == tokenizer("user", add_special_tokens=False).input_ids
        r = h.post("/v1/chat/completions", json={"model": BASE, "messages": ASK, "max_tokens": 2,
                                                 "ignore_eos": True})  # fmt: skip
        assert r.json()["usage"]["prompt_tokens"] == len(t["tokens"])
        ids = tokenizer(PROMPT).input_ids
        for extra, want in [
            ({"add_special_tokens": False}, tokenizer(PROMPT, add_special_tokens=False).input_ids),
            ({"truncate_prompt_tokens": 3}, ids[-3:]),
        ]:
            r = h.post("/v1/completions", json={"model": BASE, "prompt": PROMPT, "max_tokens": 1,
                                                "echo": True, "return_token_ids": True, **extra})  # fmt: skip
            choice = r.json()["choices"][0]
            assert choice["prompt_token_ids"] == want
            assert r.json()["usage"]["prompt_tokens"] == len(want)
        assert choice["text"].startswith(tokenizer.decode(ids[-3:]))


# -- tokenize / detokenize / ping / HEAD --------------------------------------------------------
def test_tokenize_detokenize_ping_head(server: Server, tokenizer: Any) -> None:
    with server.http() as h:
        r = h.post("/tokenize", json={"model": BASE, "prompt": PROMPT, "return_token_strs": True})
        body = r.json()
        ids = tokenizer(PROMPT).input_ids
        assert body["tokens"] == ids and body["count"] == len(ids)
        assert body["max_model_len"] == server.state.client.max_model_len
        assert body["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
        plain = h.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
        assert plain["tokens"] == tokenizer(PROMPT, add_special_tokens=False).input_ids
        d = h.post("/detokenize", json={"model": "all_r8", "tokens": ids}).json()
        assert d == {"prompt": tokenizer.decode(ids)}
        assert h.post("/detokenize", json={"tokens": [10**6]}).status_code == 400
        assert h.post("/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404
        assert h.post("/tokenize", json={"prompt": "x", "messages": ASK}).status_code == 400
        for path in ("/ping", "/health"):
            assert h.get(path).status_code == 200
        assert h.post("/ping").status_code == 200
        for path in ("/health", "/ping", "/metrics", "/version", "/v1/models", "/v1/adapters"):
            r = h.head(path)
            assert r.status_code == 200, (path, r.status_code)
            assert r.content == b""


# -- no silent ignores ------------------------------------------------------------------------
REFUSED = [
    ("use_beam_search", True),
    ("length_penalty", 0.5),
    ("spaces_between_special_tokens", False),
    ("allowed_token_ids", [1, 2]),
    ("bad_words", ["x"]),
    ("logits_processors", ["a.b"]),
    ("priority", 1),
    ("kv_transfer_params", {"a": 1}),
    ("vllm_xargs", {"a": 1}),
    ("guided_decoding_backend", "outlines"),
    ("guided_whitespace_pattern", " "),
]


def test_unsupported_values_are_400_naming_the_field(server: Server) -> None:
    c, ch = "/v1/completions", "/v1/chat/completions"
    with server.http() as h:
        for name, value in REFUSED:
            for path, base in ((c, {"prompt": "x"}), (ch, {"messages": ASK})):
                r = h.post(path, json={"model": BASE, **base, name: value})
                assert r.status_code == 400, (name, r.text)
                assert r.json()["error"]["param"] == name, (name, r.json())
        cases = [
            (c, {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
            (ch, {"messages": ASK, "response_format": {"type": "json_object"},
                  "guided_json": SCHEMA}, "guided_json"),
            (ch, {"messages": ASK, "tools": [WEATHER], "tool_choice": "required",
                  "guided_regex": "a"}, "guided_regex"),
            (ch, {"messages": ASK, "tool_choice": "auto"}, "tool_choice"),
            (ch, {"messages": ASK, "tools": [WEATHER],
                  "tool_choice": {"type": "function", "function": {"name": "nope"}}},
             "tool_choice"),
            (ch, {"messages": ASK, "reasoning_effort": "low"}, "reasoning_effort"),
            (ch, {"messages": ASK, "continue_final_message": True,
                  "add_generation_prompt": True}, "continue_final_message"),
            (c, {"prompt": "x", "prompt_embeds": "AAAA"}, "prompt_embeds"),
            (c, {"prompt": "x", "guided_json": "{not json"}, "guided_json"),
            (c, {"prompt": "x", "guided_choice": []}, "guided_choice"),
            (c, {"prompt": "x", "response_format": {"type": "json_schema"}}, "response_format"),
            (c, {"prompt": "x", "best_of": 2, "stream": True}, "best_of"),
            (c, {"prompt": "x", "guided_regex": "(unclosed"}, "guided_regex"),
            (ch, {"messages": ASK, "structured_outputs": {"grammar": "root ::= ("}},
             "structured_outputs"),
        ]  # fmt: skip
        for path, extra, param in cases:
            r = h.post(path, json={"model": BASE, **extra})
            assert r.status_code == 400, (extra, r.text)
            assert r.json()["error"]["param"] == param, (extra, r.json())
    assert server.state.aengine.num_step_errors == 0
    wait_idle(server)


def test_unknown_fields_are_logged_once(server: Server, caplog: pytest.LogCaptureFixture) -> None:
    body = {"model": BASE, "prompt": "x", "max_tokens": 1, "frobnicate": 1,
            "stream_options": None, "metadata": {"a": "b"}}  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="loraplex.server.app"), server.http() as h:
        for _ in range(3):
            assert h.post("/v1/completions", json=body).status_code == 200
        ok = h.post("/v1/chat/completions", json={
            "model": BASE, "max_tokens": 1, "frobnicate": 2,
            "messages": [{"role": "user", "content": "x", "colour": "red"}]})  # fmt: skip
        assert ok.status_code == 200
    lines = [r.getMessage() for r in caplog.records if "not part of the API" in r.getMessage()]
    assert len([x for x in lines if x.startswith("/v1/completions")]) == 1
    (cmpl,) = [x for x in lines if x.startswith("/v1/completions")]
    assert "'frobnicate'" in cmpl and "'metadata'" in cmpl
    (chat,) = [x for x in lines if x.startswith("/v1/chat/completions")]
    assert "'frobnicate'" in chat and "'messages[].colour'" in chat
    wait_idle(server)


def test_token_vocab_of_a_sentencepiece_style_tokenizer() -> None:
    """Byte-fallback pieces (<0xE2>) are single bytes and keep their own names; the metaspace
    stands for a space; added tokens are their text."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from loraplex.engine.vocab import TokenVocab

    vocab = {"<unk>": 0, "<s>": 1, "\u2581the": 2, "the": 3, "<0xE2>": 4, "<0x82>": 5,
             "<0xAC>": 6, "\u2581": 7}  # fmt: skip
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split("\u2581", "merged_with_next")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="<unk>")
    v = TokenVocab(fast)
    assert not v.byte_level and v.metaspace
    assert v.token_bytes(2) == b" the" and v.text(2) == " the"
    assert v.token_bytes(3) == b"the"
    assert [v.token_bytes(t) for t in (4, 5, 6)] == [b"\xe2", b"\x82", b"\xac"]
    assert [v.text(t) for t in (4, 5, 6)] == ["<0xE2>", "<0x82>", "<0xAC>"]  # distinct names
    assert b"".join(v.token_bytes(t) for t in (4, 5, 6)).decode() == "\u20ac"
    assert v.token_bytes(1) == b"<s>" and v.piece(2) == "\u2581the"
