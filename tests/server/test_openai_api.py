"""The OpenAI-compatible server against the official ``openai`` client, on a live loopback server.

One server per module: 8 adapters (the 7 shared ones plus one made under the allowed root),
4 device slots, 4 host slots (so some adapters start cold), an inference key and an admin key.
Greedy output through HTTP is compared with the offline ``LLM`` API on the same model.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.config import EngineConfig, LoRAModule, ServerConfig
from loraplex.server.app import ServerState, create_app
from loraplex.testing import ALL_PROJ, make_random_adapter, sync
from loraplex.testing.server import serve_in_thread

KEY = "sk-inference-test"
ADMIN = "sk-admin-test"
BASE = "tiny"
MAX_TOKENS = 10
PROMPTS = ["The capital of France is", "Hello world! How are", "SELECT name FROM"]
ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass
class Server:
    url: str
    state: ServerState
    root: Path  # the allowed root for admin loads
    names: dict[str, Path]  # served adapter name -> directory

    def http(self, key: str | None = KEY) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def _engine_config(model: Path, **kw: Any) -> EngineConfig:
    return EngineConfig(model=str(model), max_loras=4, num_threads=1, **kw)


@pytest.fixture(scope="module")
def server(
    tiny_model: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("allowed")
    extra = make_random_adapter(
        tiny_model, root / "extra_r8", r=8, lora_alpha=16, target_modules=ALL_PROJ, seed=11
    )
    names = {**adapters, "extra_r8": extra}
    config = ServerConfig(
        _engine_config(tiny_model, max_cpu_loras=4, max_num_seqs=16),
        served_model_name=[BASE],
        lora_modules=[LoRAModule(n, str(p)) for n, p in names.items()],
        api_keys=[KEY],
        admin_api_key=ADMIN,
        allowed_lora_roots=[str(root)],
        log_level="warning",
    )
    app = create_app(config)
    with serve_in_thread(app) as url:
        yield Server(url, app.state.loraplex, root, names)


@pytest.fixture(scope="module")
def offline(tiny_model: Path) -> LLM:
    return LLM(str(tiny_model), max_loras=4, num_threads=1)


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model))


def wait_idle(state: ServerState) -> None:
    """Wait until the engine holds no request, KV block or slot user (the loop is asynchronous)."""
    sync.wait_idle(state.engine, state.aengine)


def assert_openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == ERROR_KEYS, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    return err


def greedy(max_tokens: int = MAX_TOKENS, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def lora_of(server: Server, name: str | None) -> LoRARequest | None:
    return None if name is None else LoRARequest(name, str(server.names[name]))


# -- models ---------------------------------------------------------------------------------------
def test_models_list(server: Server) -> None:
    models = server.client().models.list().data
    ids = [m.id for m in models]
    assert ids[0] == BASE
    assert sorted(ids[1:]) == sorted(server.names)
    by_id = {m.id: m for m in models}
    assert getattr(by_id[BASE], "parent", "missing") is None
    for name in server.names:
        assert getattr(by_id[name], "parent", None) == BASE
        assert by_id[name].object == "model"


# -- greedy equality with the offline API ---------------------------------------------------------
@pytest.mark.parametrize("model", [None, "all_r8", "qv_r32_regex", "extra_r8"])
def test_completion_greedy_equals_offline(server: Server, offline: LLM, model: str | None) -> None:
    client = server.client()
    outs = offline.generate(PROMPTS, greedy(logprobs=0), lora_request=lora_of(server, model))
    tok = offline.get_tokenizer()
    for prompt, ref in zip(PROMPTS, outs, strict=True):
        r = client.completions.create(
            model=model or BASE, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0
        )
        ref_o = ref.outputs[0]
        (c,) = r.choices
        assert c.text == ref_o.text
        assert c.finish_reason == ref_o.finish_reason
        assert c.logprobs is not None
        # each token's own text; a byte token that is no whole character keeps its own piece
        # (decoding it alone gives U+FFFD, which would merge distinct tokens)
        assert c.logprobs.tokens == [
            tok.convert_ids_to_tokens(t) if "\ufffd" in tok.decode([t]) else tok.decode([t])
            for t in ref_o.token_ids
        ]
        assert ref_o.logprobs is not None
        assert c.logprobs.token_logprobs == pytest.approx(
            [lp.logprob for lp in ref_o.logprobs], abs=1e-4
        )
        assert r.usage is not None
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == len(ref_o.token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert r.model == (model or BASE)
    wait_idle(server.state)


def test_token_id_prompts_equal_offline(server: Server, offline: LLM, tokenizer: Any) -> None:
    """Prompts as token ids (one list, and a batch of lists) give the offline API's tokens."""
    ids = [tokenizer(p).input_ids for p in PROMPTS]
    lora = lora_of(server, "mlp_r16")
    refs = offline.generate(ids, greedy(ignore_eos=True), lora_request=lora)
    with server.http() as h:
        body = {"model": "mlp_r16", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        one = h.post("/v1/completions", json={**body, "prompt": ids[0]}).json()
        assert one["choices"][0]["text"] == refs[0].outputs[0].text
        batch = h.post("/v1/completions", json={**body, "prompt": ids}).json()
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    assert [c["text"] for c in batch["choices"]] == [o.outputs[0].text for o in refs]
    assert batch["usage"]["prompt_tokens"] == sum(len(i) for i in ids)
    assert batch["usage"]["completion_tokens"] == MAX_TOKENS * len(ids)


def test_chat_greedy_equals_offline(server: Server, offline: LLM) -> None:
    client = server.client()
    messages: list[Any] = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    for model in (None, "patterns"):
        (ref,) = offline.chat(messages, greedy(), lora_request=lora_of(server, model))
        r = client.chat.completions.create(
            model=model or BASE, messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == ref.outputs[0].text
        assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
        assert r.usage is not None
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
        # max_completion_tokens is honoured like max_tokens
        r2 = client.chat.completions.create(
            model=model or BASE,
            messages=messages,
            max_completion_tokens=3,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert r2.usage is not None and r2.usage.completion_tokens == 3


# -- streaming ------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", [None, "attn_r4_rslora"])
def test_completion_stream_equals_non_stream(
    server: Server, tokenizer: Any, model: str | None
) -> None:
    client = server.client()
    prompt = PROMPTS[1]
    kw: dict[str, Any] = dict(
        model=model or BASE, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
    )
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True))
    assert all(c.usage is None for c in chunks)  # no usage unless asked for
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason

    chunks = list(
        client.completions.create(
            **kw,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in body)
    text = "".join(c.choices[0].text for c in body)
    assert last.usage.prompt_tokens == len(tokenizer(prompt).input_ids)
    assert last.usage.completion_tokens == MAX_TOKENS
    assert last.usage.total_tokens == len(tokenizer(prompt).input_ids) + MAX_TOKENS
    assert body[-1].choices[0].finish_reason == "length"
    assert text.startswith(full.choices[0].text)  # same greedy path, run past any EOS
    wait_idle(server.state)


@pytest.mark.parametrize("model", [None, "alllinear_r12"])
def test_chat_stream_equals_non_stream(
    server: Server, offline: LLM, tokenizer: Any, model: str | None
) -> None:
    client = server.client()
    messages: list[Any] = [{"role": "user", "content": "Hello world! How are you today?"}]
    kw: dict[str, Any] = dict(
        model=model or BASE, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    full = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    *body, last = chunks
    assert body[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert text == full.choices[0].message.content
    assert body[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert last.choices == [] and last.usage is not None
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt_ids, list):
        prompt_ids = prompt_ids["input_ids"]
    assert last.usage.prompt_tokens == len(prompt_ids)
    assert full.usage is not None
    assert last.usage.completion_tokens == full.usage.completion_tokens
    (ref,) = offline.chat(messages, greedy(), lora_request=lora_of(server, model))
    assert last.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert text == ref.outputs[0].text


def test_stop_strings_stream_like_non_stream(server: Server, offline: LLM) -> None:
    """A stop string cut from the greedy output ends the text there, streamed or not (the
    stream holds back text that may start a stop string, and never takes back a delta)."""
    body = {
        "model": "patterns",
        "prompt": PROMPTS[2],
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
    }
    with server.http() as h:
        full = h.post("/v1/completions", json=body).json()["choices"][0]["text"]
        assert len(full) >= 8
        for stop in (full[3:6], full[6:7], [full[-2:], full[4:6]]):
            stops = [stop] if isinstance(stop, str) else stop
            cut = min(full.find(x) for x in stops)
            one = h.post("/v1/completions", json={**body, "stop": stop}).json()["choices"][0]
            assert one["text"] == full[:cut]
            assert one["finish_reason"] == "stop" and one["stop_reason"] in stops
            with h.stream(
                "POST", "/v1/completions", json={**body, "stop": stop, "stream": True}
            ) as r:
                data = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
            assert data[-1] == "[DONE]"
            chunks = [json.loads(d)["choices"][0] for d in data[:-1]]
            assert "".join(c["text"] for c in chunks) == one["text"]
            assert chunks[-1]["finish_reason"] == "stop"
            params = greedy(16, ignore_eos=True, stop=stop)
            lora = lora_of(server, "patterns")
            (ref,) = offline.generate(PROMPTS[2], params, lora_request=lora)
            assert ref.outputs[0].text == one["text"]
    wait_idle(server.state)


def test_multiple_prompts_and_n(server: Server) -> None:
    """A list of prompts with n=2 gives prompt-major choice indices; seeded sampling repeats."""
    with server.http() as h:
        body = {
            "model": "all_r8",
            "prompt": PROMPTS[:2],
            "n": 2,
            "max_tokens": 4,
            "temperature": 1.0,
            "seed": 7,
            "ignore_eos": True,
        }
        a = h.post("/v1/completions", json=body).json()
        b = h.post("/v1/completions", json=body).json()
    assert sorted(c["index"] for c in a["choices"]) == [0, 1, 2, 3]
    by_index = lambda r: [c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])]  # noqa: E731
    assert by_index(a) == by_index(b)
    assert a["usage"]["completion_tokens"] == 16
    wait_idle(server.state)


# -- auth -----------------------------------------------------------------------------------------
def test_missing_or_wrong_key_is_401(server: Server) -> None:
    for key in (None, "sk-wrong"):
        with server.http(key) as h:
            for method, path, body in [
                ("GET", "/v1/models", None),
                ("GET", "/v1/adapters", None),
                ("POST", "/v1/completions", {"model": BASE, "prompt": "hi"}),
                ("POST", "/v1/chat/completions", {"model": BASE, "messages": []}),
            ]:
                r = h.request(method, path, json=body)
                err = assert_openai_error(r, 401)
                assert err["code"] == "invalid_api_key"
                assert r.headers.get("www-authenticate") == "Bearer"
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_inference_key_cannot_call_admin_routes(server: Server) -> None:
    with server.http(KEY) as h:
        r = h.post(
            "/v1/load_lora_adapter",
            json={"lora_name": "x", "lora_path": str(server.names["extra_r8"])},
        )
        assert assert_openai_error(r, 403)["type"] == "permission_error"
        r = h.post("/v1/unload_lora_adapter", json={"lora_name": "all_r8"})
        assert_openai_error(r, 403)
    for key in (None, "sk-wrong"):
        with server.http(key) as h:
            r = h.post("/v1/unload_lora_adapter", json={"lora_name": "all_r8"})
            assert_openai_error(r, 401)
    assert "all_r8" in [m.id for m in server.client().models.list().data]


def test_admin_routes_are_404_without_admin_key(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    config = ServerConfig(
        _engine_config(tiny_model, max_num_seqs=4),
        served_model_name=[BASE],
        lora_modules=[LoRAModule("all_r8", str(adapters["all_r8"]))],
        allowed_lora_roots=[str(adapters["all_r8"].parent)],
        log_level="warning",
    )
    with serve_in_thread(create_app(config)) as url, httpx.Client(base_url=url) as h:
        for headers in ({}, {"Authorization": "Bearer anything"}):
            r = h.post(
                "/v1/load_lora_adapter",
                json={"lora_name": "x", "lora_path": str(adapters["mlp_r16"])},
                headers=headers,
            )
            assert assert_openai_error(r, 404)["code"] == "admin_api_disabled"
            r = h.post("/v1/unload_lora_adapter", json={"lora_name": "all_r8"}, headers=headers)
            assert_openai_error(r, 404)
        # no inference keys configured: open access
        assert [m["id"] for m in h.get("/v1/models").json()["data"]] == [BASE, "all_r8"]


# -- admin load / unload --------------------------------------------------------------------------
def _admin(server: Server, route: str, **body: Any) -> httpx.Response:
    with server.http(ADMIN) as h:
        return h.post(f"/v1/{route}", json=body)


def test_load_outside_allowed_roots_is_refused(
    server: Server, adapters: dict[str, Path], tmp_path: Path
) -> None:
    outside = adapters["mlp_r16"]
    link = server.root / "link_out"
    link.symlink_to(outside, target_is_directory=True)
    files_link = server.root / "files_out"
    files_link.mkdir()
    for f in outside.iterdir():
        (files_link / f.name).symlink_to(f)
    not_adapter = server.root / "empty_dir"
    not_adapter.mkdir()
    cases = [
        str(outside),  # plainly outside
        str(link),  # a symlink in the root pointing outside
        str(files_link),  # a directory in the root whose files link outside
        f"{server.root}/../{outside.name}",  # .. escaping the root
        "extra_r8",  # relative
        "./extra_r8",
        str(server.root / "missing"),  # inside, but nothing there: vLLM's 404
        str(not_adapter),  # inside, but not an adapter
    ]
    try:
        for path in cases:
            r = _admin(server, "load_lora_adapter", lora_name="sneaky", lora_path=path)
            err = assert_openai_error(r, 404 if path.endswith("/missing") else 400)
            assert err["param"] == "lora_path", (path, err)
    finally:
        link.unlink()
        shutil.rmtree(files_link)
    ids = [m.id for m in server.client().models.list().data]
    assert "sneaky" not in ids
    wait_idle(server.state)


def test_load_serve_and_unload(server: Server, offline: LLM, adapters: dict[str, Path]) -> None:
    path = server.root / "copied_mlp"
    shutil.copytree(adapters["mlp_r16"], path)
    r = _admin(server, "load_lora_adapter", lora_name="newbie", lora_path=str(path))
    assert r.status_code == 200, r.text
    client = server.client()
    models = {m.id: m for m in client.models.list().data}
    assert getattr(models["newbie"], "parent", None) == BASE
    out = client.completions.create(
        model="newbie", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0
    )
    (ref,) = offline.generate(PROMPTS[0], greedy(), lora_request=LoRARequest("n", str(path)))
    assert out.choices[0].text == ref.outputs[0].text
    # an existing name is refused unless load_inplace
    for name in ("newbie", "all_r8", BASE):
        r = _admin(server, "load_lora_adapter", lora_name=name, lora_path=str(path))
        assert assert_openai_error(r, 400)["param"] == "lora_name"

    # load_inplace re-points the name; the new weights serve at once (never old weights or
    # old prefix-cache KV): first another directory, then new files rewritten at the old path
    def served_text() -> str:
        r = client.completions.create(
            model="newbie", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0
        )
        return r.choices[0].text

    other = server.root / "copied_attn"
    shutil.copytree(adapters["attn_r4_rslora"], other)
    for new_path, source in ((other, "attn_r4_rslora"), (path, "qv_r32_regex")):
        if new_path == path:
            shutil.rmtree(path)
            shutil.copytree(adapters[source], path)
        r = _admin(
            server,
            "load_lora_adapter",
            lora_name="newbie",
            lora_path=str(new_path),
            load_inplace=True,
        )
        assert r.status_code == 200, r.text
        lora = LoRARequest(source, str(adapters[source]))
        (new_ref,) = offline.generate(PROMPTS[0], greedy(), lora_request=lora)
        assert new_ref.outputs[0].text != ref.outputs[0].text  # the test can tell them apart
        assert served_text() == new_ref.outputs[0].text
    # unload: gone from the list, requests 404, a second unload 404
    assert _admin(server, "unload_lora_adapter", lora_name="newbie").status_code == 200
    assert "newbie" not in [m.id for m in client.models.list().data]
    with server.http() as h:
        r = h.post("/v1/completions", json={"model": "newbie", "prompt": "hi", "max_tokens": 2})
        assert assert_openai_error(r, 404)["code"] == "model_not_found"
    for name in ("newbie", "never-was"):
        r = _admin(server, "unload_lora_adapter", lora_name=name)
        assert_openai_error(r, 404)
    wait_idle(server.state)


# -- errors ---------------------------------------------------------------------------------------
def test_unknown_model_is_404(server: Server) -> None:
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    with server.http() as h:
        for path, body in [
            ("/v1/completions", {"model": "nope", "prompt": "hi"}),
            (
                "/v1/chat/completions",
                {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
            ),
        ]:
            err = assert_openai_error(h.post(path, json=body), 404)
            assert err["code"] == "model_not_found" and err["param"] == "model"


def _bad_requests(max_len: int, vocab: int) -> list[tuple[str, dict[str, Any], str | None]]:
    """(path, body, expected param or None) — every one must be a 400."""
    c, ch = "/v1/completions", "/v1/chat/completions"
    msg = [{"role": "user", "content": "hi"}]
    base = {"model": BASE}
    return [
        (c, {**base, "prompt": "hi", "max_tokens": "many"}, "max_tokens"),
        (c, {**base, "prompt": 42}, "prompt"),
        (c, {**base, "prompt": "hi", "temperature": -0.5}, None),
        (c, {**base, "prompt": "hi", "temperature": "hot"}, "temperature"),
        (c, {**base, "prompt": "hi", "top_p": 0}, None),
        (c, {**base, "prompt": "hi", "top_k": -5}, None),
        (c, {**base, "prompt": "hi", "max_tokens": 0}, None),
        (c, {**base, "prompt": "hi", "max_tokens": -3}, None),
        (c, {**base, "prompt": "hi", "n": 1000}, None),
        (c, {**base, "prompt": "hi", "n": 0}, None),
        (c, {**base, "prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
        (c, {**base, "prompt": "hi", "frequency_penalty": -3}, "frequency_penalty"),
        (c, {**base, "prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
        (c, {**base, "prompt": "hi", "logit_bias": {"x": 10}}, "logit_bias"),
        (c, {**base, "prompt": "hi", "logit_bias": {str(vocab): 10}}, "logit_bias"),
        (c, {**base, "prompt": "hi", "min_p": 1.5}, "min_p"),
        (c, {**base, "prompt": "hi", "best_of": 1, "n": 2}, "best_of"),
        (c, {**base, "prompt": "hi", "logprobs": 50}, None),
        (c, {**base, "prompt": "hi", "max_tokens": max_len}, "max_tokens"),
        (c, {**base, "prompt": [1] * (max_len + 5), "max_tokens": 1}, None),
        (c, {**base, "prompt": ""}, None),
        (c, {**base, "prompt": []}, None),
        (c, {**base, "prompt": [[]]}, None),
        (c, {**base, "prompt": [vocab]}, None),
        (c, {**base, "prompt": [-1]}, None),
        (c, {**base, "prompt": [[1, 2], [vocab + 10]]}, None),
        (c, {**base, "prompt": "hi", "stop_token_ids": [vocab]}, None),
        (c, {**base, "prompt": "hi", "stop": ""}, None),
        (c, {**base, "prompt": "hi", "min_tokens": 5, "max_tokens": 2}, None),
        (c, {**base, "prompt": "hi", "stream_options": {"include_usage": True}}, None),
        (c, {**base, "prompt": "hi", "echo": True, "logprobs": 50}, "logprobs"),
        (c, {**base, "prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        (c, {**base, "prompt": "hi", "use_beam_search": True}, "use_beam_search"),
        (c, {**base, "prompt": "hi", "suffix": "x"}, None),
        (c, {"prompt": "hi"}, "model"),
        (ch, {**base, "messages": []}, "messages"),
        (ch, {**base, "messages": "hello"}, "messages"),
        (ch, {**base, "messages": [{"role": "wizard", "content": "x"}]}, None),
        (ch, {**base, "messages": [{"role": "user", "content": 5}]}, None),
        (
            ch,
            {**base, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            None,
        ),
        (
            ch,
            {**base, "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            None,
        ),
        (ch, {**base, "messages": msg, "max_completion_tokens": max_len * 2}, "max_tokens"),
        (ch, {**base, "messages": msg, "temperature": -1}, None),
        (ch, {**base, "messages": msg, "tools": [{"type": "function"}]}, None),
        (ch, {**base, "messages": msg, "response_format": {"type": "xml"}}, None),
        (
            ch,
            {**base, "messages": msg, "tools": [{"type": "function", "function": {"name": "f"}}]},
            "tool_choice",
        ),  # tool_choice defaults to auto, which this server was not started with
        (ch, {**base, "messages": msg, "top_logprobs": 2}, None),
        (ch, {**base, "messages": msg, "n": 65}, None),
        (ch, {**base, "messages": msg, "presence_penalty": 3}, "presence_penalty"),
    ]


def test_bad_requests_are_400_and_engine_keeps_serving(server: Server) -> None:
    eng = server.state.engine
    vocab = eng.model_config.vocab_size
    with server.http() as h:
        for path, body, param in _bad_requests(eng.max_model_len, vocab):
            for model in (BASE, "all_r8"):
                if "model" in body:
                    body = {**body, "model": model}
                r = h.post(path, json=body)
                err = assert_openai_error(r, 400)
                assert err["type"] == "invalid_request_error", (body, err)
                if param is not None:
                    assert err["param"] == param, (body, err)
        r = h.post(
            "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert_openai_error(r, 400)
        wait_idle(server.state)
        r = h.post(
            "/v1/completions",
            json={"model": "all_r8", "prompt": "hi", "max_tokens": 3, "ignore_eos": True},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert server.state.aengine.num_step_errors == 0
    wait_idle(server.state)


def test_extreme_sampling_values_never_fail_the_engine(server: Server) -> None:
    """Temperatures and top_p too small for float32 once crashed the engine step (NaN
    probabilities), aborting every request in flight. They mean greedy; a request running
    alongside must be unaffected."""
    base = {"model": "all_r8", "prompt": PROMPTS[0], "max_tokens": 4, "ignore_eos": True}

    async def main() -> tuple[list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(
            base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
        ) as h:
            bystander = asyncio.ensure_future(
                h.post("/v1/completions", json={**base, "model": "mlp_r16", "max_tokens": 40})
            )
            extremes = [
                {"temperature": 1e-300},
                {"temperature": 1e-45, "seed": 3},
                {"top_p": 1e-300},
                {"top_p": 5e-324, "temperature": 0.7},
                {"temperature": 0},
            ]
            rs = [await h.post("/v1/completions", json={**base, **x}) for x in extremes]
            return rs, await bystander

    responses, bystander = asyncio.run(main())
    assert [r.status_code for r in responses] == [200] * 5, [r.text for r in responses]
    greedy_text = responses[-1].json()["choices"][0]["text"]
    assert all(r.json()["choices"][0]["text"] == greedy_text for r in responses)
    assert bystander.status_code == 200
    assert bystander.json()["usage"]["completion_tokens"] == 40
    assert server.state.aengine.num_step_errors == 0
    wait_idle(server.state)


def test_lone_surrogates_and_bad_encodings_are_400(server: Server) -> None:
    """JSON can carry lone surrogates (``"\\ud800"``), which cannot be tokenized (once a 500)."""
    c, ch = "/v1/completions", "/v1/chat/completions"
    bad = "\\ud800"
    cases = [
        (c, f'{{"model": "{BASE}", "prompt": "{bad}"}}', "prompt"),
        (c, f'{{"model": "{BASE}", "prompt": ["ok", "x{bad}"]}}', "prompt"),
        (c, f'{{"model": "{bad}", "prompt": "hi"}}', "model"),
        (c, f'{{"model": "{BASE}", "prompt": "hi", "stop": ["{bad}"]}}', "stop"),
        (ch, f'{{"model": "{BASE}", "messages": [{{"role": "user", "content": "{bad}"}}]}}', None),
        (
            ch,
            f'{{"model": "all_r8", "messages": [{{"role": "user", '
            f'"content": [{{"type": "text", "text": "{bad}"}}]}}]}}',
            None,
        ),
        (
            ch,
            f'{{"model": "{BASE}", "messages": [{{"role": "user", "content": "x", '
            f'"name": "{bad}"}}]}}',
            "messages.0.name",
        ),
    ]
    with server.http() as h:
        headers = {"content-type": "application/json"}
        for path, raw, param in cases:
            err = assert_openai_error(h.post(path, content=raw.encode(), headers=headers), 400)
            assert err["type"] == "invalid_request_error"
            assert "surrogate" in err["message"], err
            if param is not None:
                assert err["param"] == param, err
        not_utf8 = b'{"model": "tiny", "prompt": "\xff\xfe"}'
        err = assert_openai_error(h.post(c, content=not_utf8, headers=headers), 400)
        assert err["type"] == "invalid_request_error"
    wait_idle(server.state)


# -- residency, metrics, health -------------------------------------------------------------------
def _adapter_rows(server: Server) -> dict[str, dict[str, Any]]:
    with server.http() as h:
        r = h.get("/v1/adapters")
    assert r.status_code == 200
    body = r.json()
    assert body["max_loras"] == 4
    return {row["name"]: row for row in body["data"] if row["registered"]}


def _metric_lines(server: Server) -> list[str]:
    with server.http() as h:  # the server has keys: /metrics needs one too
        r = h.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text.splitlines()


def _sample(lines: list[str], name: str, **labels: str) -> float | None:
    """The value of the sample ``name`` whose labels include ``labels`` (None if absent)."""
    for line in lines:
        if line.startswith("#") or not line.startswith(name):
            continue
        m = re.fullmatch(r"([^{ ]+)(?:\{(.*)\})? (\S+)", line)
        if m is None or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return None


def test_residency_view_and_metrics(server: Server) -> None:
    wait_idle(server.state)
    rows = _adapter_rows(server)
    assert set(rows) >= set(server.names)
    for row in rows.values():
        assert row["tier"] in ("device", "host", "disk")
        assert {"rank", "bytes", "hits", "loads", "in_flight", "sha256", "evictions"} <= set(row)
    # max_cpu_loras=4 of 8: some adapter is on disk only; asking for it is a cold request
    cold = next(n for n in server.names if rows[n]["tier"] == "disk")
    before = _sample(
        _metric_lines(server), "time_to_first_token_seconds_count", adapter_state="cold"
    )
    client = server.client()
    states = []
    for _ in range(2):  # the response says whether the adapter was warm on arrival
        raw = client.completions.with_raw_response.create(
            model=cold, prompt="hi", max_tokens=3, temperature=0
        )
        states.append(raw.headers.get("x-loraplex-adapter-state"))
        assert raw.headers.get("x-loraplex-adapter", "").startswith(f"{cold};")
    assert states == ["cold", "warm"]
    client.completions.create(model=BASE, prompt="hi", max_tokens=3, temperature=0)
    wait_idle(server.state)

    rows = _adapter_rows(server)
    row = rows[cold]
    assert row["tier"] == "device"
    peft = json.loads((server.names[cold] / "adapter_config.json").read_text())
    assert row["rank"] == max([peft["r"], *peft.get("rank_pattern", {}).values()])
    assert row["bytes"] > 0 and row["loads"] >= 1 and row["hits"] >= 1
    assert row["in_flight"] == 0 and row["slot"] is not None

    lines = _metric_lines(server)
    text = "\n".join(lines)
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running"):
        assert _sample(lines, name) == 0
    assert _sample(lines, "vllm:kv_cache_usage_perc") == 0
    info = next(x for x in lines if x.startswith("vllm:lora_requests_info{"))
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info))
    assert labels["max_lora"] == "4"
    assert cold in labels["running_lora_adapters"].split(",")  # resident while idle
    assert labels["waiting_lora_adapters"] == ""
    device = sorted(n for n, r in rows.items() if r["tier"] == "device")
    assert sorted(labels["running_lora_adapters"].split(",")) == device
    cold_after = _sample(lines, "time_to_first_token_seconds_count", adapter_state="cold")
    assert cold_after is not None and cold_after >= (before or 0) + 1
    assert (_sample(lines, "time_to_first_token_seconds_count", adapter_state="warm") or 0) >= 2
    assert 'time_to_first_token_seconds_bucket{adapter_state="warm",le="+Inf"}' in text
    assert 'time_to_first_token_seconds_bucket{adapter_state="cold",le="+Inf"}' in text
    assert (_sample(lines, "adapter_cache_hits_total", tier="host") or 0) >= 1
    assert _sample(lines, "adapter_cache_hits_total", tier="device") is not None
    assert (_sample(lines, "adapter_load_seconds_count", stage="disk_load") or 0) >= 1
    assert (_sample(lines, "adapter_load_seconds_count", stage="activation") or 0) >= 1
    assert (_sample(lines, "distinct_adapters_per_step_count") or 0) >= 1
    assert (_sample(lines, "cold_adapter_requests_total") or 0) >= 1
    assert _sample(lines, "adapter_resident_count", tier="device") == len(device)


def test_health_and_version(server: Server) -> None:
    import loraplex

    with server.http(None) as h:  # the server has keys: only /health is open
        assert h.get("/health").status_code == 200
        assert_openai_error(h.get("/version"), 401)
        assert_openai_error(h.get("/no/such/route"), 401)
    with server.http() as h:
        r = h.get("/version")
        assert r.status_code == 200 and r.json() == {"version": loraplex.__version__}
        assert_openai_error(h.get("/no/such/route"), 404)


def test_booleans_and_numeric_strings_are_not_integers() -> None:
    """Strict bodies: ``max_tokens: true`` or ``"8"`` and boolean token ids are 400s."""
    from pydantic import ValidationError

    from loraplex.server.protocol import CompletionRequest

    for bad in (
        {"model": "m", "prompt": "x", "max_tokens": True},
        {"model": "m", "prompt": "x", "max_tokens": "8"},
        {"model": "m", "prompt": [True, False]},
        {"model": "m", "prompt": "x", "n": "2"},
    ):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate(bad)
    ok = CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2]], "temperature": 1})
    assert ok.prompts() == [[1, 2]] and ok.temperature == 1.0


def test_admin_adapter_swapped_for_links_outside_is_refused(
    server: Server, adapters: dict[str, Path]
) -> None:
    """Loaded through the admin API, then its files replaced by links out of the allowed roots:
    requests are refused (403) instead of reading the linked files."""
    path = server.root / "swapped"
    shutil.copytree(adapters["mlp_r16"], path)
    r = _admin(server, "load_lora_adapter", lora_name="swapped", lora_path=str(path))
    assert r.status_code == 200, r.text
    try:
        for f in path.iterdir():
            f.unlink()
            f.symlink_to(adapters["all_r8"] / f.name)
        with server.http() as h:
            r = h.post("/v1/completions", json={"model": "swapped", "prompt": "x", "max_tokens": 2})
        assert assert_openai_error(r, 403)["code"] == "adapter_path_refused"
    finally:
        _admin(server, "unload_lora_adapter", lora_name="swapped")
        shutil.rmtree(path)
    wait_idle(server.state)
