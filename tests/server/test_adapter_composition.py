"""Several adapters per request, each with a scale, over HTTP (issue 49, the server's side).

Before: ``merged_adapters`` was an unknown field, ignored with a log line, so a request composing
``alpha`` with the nonexistent ``nope`` answered 200 with alpha's output alone. Now the body's
``lora_scale``, ``merged_adapters`` (LoRAX) and ``lora_requests`` (vLLM RFC #51940's list) are
resolved component by component exactly as ``model`` is (the tenant's adapters only, the active
revision or the canary, the served base model), every refusal is a 400 naming the component,
and a valid request reaches the engine as the right :class:`AdapterComposition`.

One live server on a registry with two tenants (``acme`` owns ``a_only``, ``bravo`` owns
``b_only``, ``shared`` is everyone's), plus ``foreign``, an adapter registered for another base
model, and a canary revision of ``shared`` taking all its traffic.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from loraplex.registry import Principal, base_model_info
from loraplex.server.admission import RequestLog, UsageRecord, admit
from loraplex.server.composition import ServedComposition, resolve_served
from loraplex.server.openai_routes import _engine_request
from loraplex.server.protocol import ChatCompletionRequest, CompletionRequest
from loraplex.server.responses import adapter_header
from loraplex.server.state import ServedAdapter
from loraplex.testing import (
    ALL_PROJ,
    load_merged_reference,
    make_random_adapter,
    make_random_model,
    reference_greedy,
)
from loraplex.types import MAX_COMPOSED_ADAPTERS, AdapterComposition
from tests.server.registry_server import BASE, Live, live_server, tenant_adapters


@dataclass
class World:
    live: Live
    acme: str  # acme's inference key
    canary_sha: str  # shared's canary revision (all of shared's traffic)
    served: dict[str, Path]


@pytest.fixture(scope="module")
def world(
    tiny_model: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("compose")
    root = tmp / "root"
    served = tenant_adapters(adapters, root)
    with live_server(f"sqlite:///{tmp / 'r.db'}", tiny_model, served) as live:
        reg = live.registry
        # an adapter trained for another base model (same shapes, other weights)
        other = make_random_model(tmp / "other-base", num_layers=3, seed=7)
        foreign = make_random_adapter(other, root / "foreign", r=4, target_modules=ALL_PROJ)
        m = reg.register(foreign, "foreign", base=base_model_info(other, name="other"),
                         actor="test")  # fmt: skip
        reg.activate("foreign", m.revision, actor="test")
        # a second revision of shared, as a canary with all the traffic
        v2 = Path(shutil.copytree(adapters["qv_r32_regex"], root / "shared_v2"))
        base = base_model_info(tiny_model, name=BASE)
        c = reg.register(v2, "shared", base=base, actor="test")
        reg.canary("shared", c.revision, 1.0, actor="test")
        live.caught_up()
        yield World(live, live.keys["acme"], c.sha256, served)


def _post(w: World, body: dict[str, Any], route: str = "/v1/completions") -> httpx.Response:
    base = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
    if route.endswith("chat/completions"):
        base = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    return httpx.post(
        f"{w.live.url}{route}",
        json={**base, **body},
        headers={"Authorization": f"Bearer {w.acme}"},
        timeout=60,
    )


def _error(r: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] and err["message"], err
    return err


def _merged(ids: list[str], weights: list[float] | None = None, **kw: Any) -> dict[str, Any]:
    m: dict[str, Any] = {"ids": ids, "merge_strategy": "linear", **kw}
    if weights is not None:
        m["weights"] = weights
    return {"merged_adapters": m}


# -- refusals ----------------------------------------------------------------------------------
def test_unknown_component_is_a_400_not_a_silent_200(world: World) -> None:
    """The issue's own request: ``model`` alpha, ``nope`` among the ids."""
    err = _error(_post(world, {"model": "a_only", **_merged(["a_only", "nope"], [1, 1])}))
    assert err["param"] == "merged_adapters.ids[1]"
    assert err["code"] == "adapter_not_found"
    assert err["message"] == "merged_adapters.ids[1]: The adapter `nope` does not exist."


def test_another_tenants_component_reads_as_unknown(world: World) -> None:
    """``b_only`` exists (bravo's): acme's key gets the very message of a name that does not."""
    theirs = _error(_post(world, {"model": BASE, **_merged(["a_only", "b_only"])}))
    nothing = _error(_post(world, {"model": BASE, **_merged(["a_only", "zz_none"])}))
    assert theirs["message"].replace("b_only", "X") == nothing["message"].replace("zz_none", "X")
    assert theirs["code"] == nothing["code"] == "adapter_not_found"
    lst = _error(_post(world, {"model": BASE, "lora_requests": [{"lora_name": "b_only"}]}))
    assert lst["message"] == "lora_requests[0]: The adapter `b_only` does not exist."


def test_too_many_components_refused_before_any_is_read(world: World) -> None:
    ids = [f"x{i}" for i in range(MAX_COMPOSED_ADAPTERS + 1)]
    err = _error(_post(world, {"model": BASE, **_merged(ids)}))
    assert err["param"] == "merged_adapters.ids"
    assert f"at most {MAX_COMPOSED_ADAPTERS} adapters" in err["message"]
    many = [{"lora_name": "a_only"}] * 10_000  # bounded before 10k items are validated
    err = _error(_post(world, {"model": BASE, "lora_requests": many}))
    assert err["param"] == "lora_requests" and "(got 10000)" in err["message"]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (_merged(["a_only", "a_only"]), "merged_adapters.ids[1]", "named twice"),
        (_merged(["a_only", "shared"], [1.0]), "merged_adapters.weights", "1 values for 2 ids"),
        (_merged(["a_only"], [1e3]), "merged_adapters.ids[0]", "finite number in [-100, 100]"),
        ({"lora_requests": [{"name": "a_only", "scale": -101}]}, "lora_requests[0]", "[-100, 100]"),
        (_merged(["a_only"], density=1.5), "merged_adapters.density", "[0, 1]"),
        (
            _merged(["a_only"], majority_sign_method="most"),
            "merged_adapters.majority_sign_method",
            "total, frequency",
        ),
        (
            {**_merged(["a_only"]), "lora_requests": [{"lora_name": "shared"}]},
            "lora_requests",
            "not both",
        ),
        ({**_merged(["a_only"]), "lora_scale": 0.5}, "lora_scale", "its own scale"),
        ({"merged_adapters": {"ids": []}}, "merged_adapters", "names no adapter"),
        (_merged([BASE, "a_only"]), "merged_adapters.ids[0]", "is the base model"),
    ],
)
def test_bad_compositions_are_400s_naming_the_field(
    world: World, body: dict[str, Any], param: str, words: str
) -> None:
    err = _error(_post(world, {"model": BASE, **body}))
    assert err["param"] == param, err
    assert words in err["message"], err


def test_non_finite_scales_are_refused(world: World) -> None:
    """JSON as Python reads it carries NaN and Infinity literals: both are 400s."""
    for literal in ("NaN", "Infinity", "-Infinity", "1e999"):
        raw = (
            '{"model": "a_only", "prompt": "Hi", "max_tokens": 1, '
            f'"merged_adapters": {{"ids": ["a_only"], "weights": [{literal}]}}}}'
        )
        r = httpx.post(f"{world.live.url}/v1/completions", content=raw, timeout=60,
                       headers={"Authorization": f"Bearer {world.acme}",
                                "Content-Type": "application/json"})  # fmt: skip
        err = _error(r)
        assert err["param"] == "merged_adapters.ids[0]" and "finite" in err["message"], literal
    err = _error(_post(world, {"model": "a_only", "lora_scale": 250.0}))
    assert err["param"] == "lora_scale"


def test_component_for_another_base_model(world: World) -> None:
    err = _error(_post(world, {"model": BASE, **_merged(["a_only", "foreign"])}))
    assert err["param"] == "merged_adapters.ids[1]"
    assert err["code"] == "adapter_incompatible_base"
    assert "'other'" in err["message"] and "foreign" in err["message"]


@pytest.mark.parametrize("strategy", ["ties", "dare_linear", "dare_ties", "cat", "slerp"])
def test_weight_merges_point_to_the_registry_operation(world: World, strategy: str) -> None:
    body = {"model": BASE, **_merged(["a_only", "shared"], density=0.5)}
    body["merged_adapters"]["merge_strategy"] = strategy
    for route in ("/v1/completions", "/v1/chat/completions"):
        err = _error(_post(world, body, route))
        assert err["param"] == "merged_adapters.merge_strategy"
        msg = err["message"]
        assert "POST /v1/admin/adapters/merge" in msg and "loraplex registry merge" in msg, msg
        assert strategy in msg
        assert ("strategies: linear" in msg) == (strategy == "slerp"), msg


def test_model_and_composition_must_agree(world: World) -> None:
    """``model`` is the base model or one of the composed adapters; another adapter (whether
    it exists or not: the answer must not tell) is a 400, never silently dropped."""
    for model in ("b_only", "zz_none", "shared"):
        err = _error(_post(world, {"model": model, **_merged(["a_only"])}))
        assert err["param"] == "model"
        assert f"`model` is '{model}', which is neither the base model" in err["message"]
    err = _error(_post(world, {"model": BASE, "lora_scale": 0.5}))
    assert err["param"] == "lora_scale" and "names the base model" in err["message"]


# -- resolution: what the engine is asked for ---------------------------------------------------
def _resolve(w: World, body: dict[str, Any], chat: bool = False) -> Any:
    state = w.live.state
    principal = state.catalog.authenticate(w.acme)
    assert isinstance(principal, Principal)
    if chat:
        req: Any = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "Hi"}], **body}
        )
    else:
        req = CompletionRequest.model_validate({"prompt": "Hi", **body})
    lora = resolve_served(state, req, principal)
    gen = _engine_request("cmpl", req, principal, req.sampling_params(), lora, 0.0)
    return lora, gen


def test_composition_reaches_the_engine_with_resolved_revisions_and_canary(world: World) -> None:
    reg = world.live.registry
    active = {n: reg.release(n).active_revision for n in ("a_only", "shared")}
    a_sha = reg.get("a_only", active["a_only"]).sha256
    for chat in (False, True):
        lora, gen = _resolve(world, {"model": "a_only", **_merged(["a_only", "shared"],
                                                                   [1, -0.5])}, chat)  # fmt: skip
        assert isinstance(lora, ServedComposition)
        comp = gen.adapter
        assert isinstance(comp, AdapterComposition)
        assert [(c.spec.name, c.scale) for c in comp.components] == [
            ("a_only", 1.0),
            ("shared", -0.5),
        ]
        assert comp.components[0].spec.sha256 == a_sha  # acme's active revision
        assert comp.components[1].spec.sha256 == world.canary_sha  # the canary: all traffic
        assert [p.route for p in lora.parts] == ["active", "canary"]
        assert comp.name == lora.name == "a_only*1+shared*-0.5"
        assert gen.cache_salt is not None and "acme" in gen.cache_salt  # the tenant's salt

    _, gen = _resolve(world, {"model": BASE, "lora_requests": [
        {"lora_name": "shared", "lora_scale": 0}, {"name": "a_only", "scale": 2}]})  # fmt: skip
    assert isinstance(gen.adapter, AdapterComposition)
    assert gen.adapter.name == "shared*0+a_only*2"


def test_the_body_lorax_s_client_sends_is_served(world: World) -> None:
    """LoRAX's ``MergedAdapters`` serializes every field: no strategy (its default, linear), no
    sign method, a density (required there, unused by linear)."""
    lorax = {"ids": ["shared", "a_only"], "weights": [0.7, 0.3], "merge_strategy": None,
             "density": 0.0, "majority_sign_method": None}  # fmt: skip
    _, gen = _resolve(world, {"model": BASE, "merged_adapters": lorax})
    assert gen.adapter.name == "shared*0.7+a_only*0.3"


def test_a_scale_is_a_composition_of_one_and_scale_one_is_the_adapter(world: World) -> None:
    lora, gen = _resolve(world, {"model": "a_only", "lora_scale": 0.25})
    assert isinstance(gen.adapter, AdapterComposition) and gen.adapter.name == "a_only*0.25"
    assert len(lora.parts) == 1
    for body in (
        {"model": "a_only", "lora_scale": 1.0},
        {"model": "a_only"},
        {"model": "a_only", **_merged(["a_only"])},
        {"model": BASE, "lora_requests": [{"lora_name": "a_only"}]},
    ):
        lora, gen = _resolve(world, body)
        assert isinstance(lora, ServedAdapter), body
        assert gen.adapter == lora.spec and gen.adapter.name == "a_only"
    lora, gen = _resolve(world, {"model": BASE, "lora_scale": 1.0})
    assert lora is None and gen.adapter is None


def test_two_names_of_the_same_weights_are_refused(world: World) -> None:
    """Two names, one digest: the composition would count its delta twice under one slot."""
    reg, live = world.live.registry, world.live
    base = base_model_info(Path(live.state.config.engine.model), name=BASE)
    twin = Path(shutil.copytree(world.served["a_only"], world.served["a_only"].parent / "twin"))
    m = reg.register(twin, "a_twin", base=base, tenant="acme", actor="test")
    reg.activate("a_twin", m.revision, actor="test")
    live.caught_up()
    err = _error(_post(world, {"model": BASE, **_merged(["a_only", "a_twin"])}))
    assert err["param"] == "merged_adapters.ids[1]" and "same weights" in err["message"]


def test_a_composite_call_holds_a_slot_of_every_component(world: World, adapters: dict) -> None:
    """Each component's ``max_concurrent_requests`` counts a composite call: while one composing
    ``lim1`` and ``lim2`` (limit 1 each) is admitted, a call for ``lim2`` alone must wait."""
    reg, live, state = world.live.registry, world.live, world.live.state
    base = base_model_info(Path(state.config.engine.model), name=BASE)
    root = world.served["a_only"].parent
    for name, src in (("lim1", "alllinear_r12"), ("lim2", "patterns")):
        d = Path(shutil.copytree(adapters[src], root / name))
        m = reg.register(d, name, base=base, tenant="acme", max_concurrent_requests=1,
                         actor="test")  # fmt: skip
        reg.activate(name, m.revision, actor="test")
    live.caught_up()
    principal = state.catalog.authenticate(world.acme)

    async def run() -> None:
        both, _ = _resolve(world, {"model": BASE, **_merged(["lim1", "lim2"], [1, 0.5])})
        held = admit(state, 1, principal, lora=both)
        try:
            assert held.slots is not None and held.slots.held
            assert [k for k, _ in held.slots.claims] == ["name:lim1", "name:lim2"]
            alone = await asyncio.to_thread(state.resolve_model, "lim2", principal)
            waiting = admit(state, 1, principal, lora=alone)
            assert waiting.slots is not None and not waiting.slots.held  # queued behind it
            held.close()  # the composite call ends: the single call gets lim2's slot
            await waiting.slots.wait()
            assert waiting.slots.held
            waiting.close()
        finally:
            held.close()

    asyncio.run(run())
    assert state.adapter_limits.in_flight("name:lim2") == 0


# -- what names a composition: header, logs, metrics -------------------------------------------
def test_header_logs_and_metrics_name_the_composition(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    lora, _ = _resolve(world, {"model": BASE, **_merged(["a_only", "shared"], [1, 0.5])})
    a, s = lora.parts
    prepared = [
        SimpleNamespace(request_id="cmpl-x-0", prompt_token_ids=[1, 2], adapter_warm=True,
                        alora_invoked=None, request=SimpleNamespace(prompt="Hi", seqs=[]))
    ]  # fmt: skip
    h = adapter_header(prepared, lora)  # type: ignore[arg-type]
    assert h["x-loraplex-adapter"] == (
        f"a_only;revision={a.spec.ref.revision};sha256={a.spec.sha256[:16]};scale=1, "
        f"shared;revision={s.spec.ref.revision};sha256={s.spec.sha256[:16]};scale=0.5"
    )
    assert h["x-loraplex-adapter-route"] == "active, canary"
    usage = UsageRecord(BASE, world.live.state.catalog.authenticate(world.acme), lora)
    with caplog.at_level(logging.INFO):
        usage.log(prepared, {})  # type: ignore[arg-type]
        RequestLog().log(usage, prepared, {}, 0.5)  # type: ignore[arg-type]
    line = next(r for r in caplog.records if r.name == "loraplex.usage")
    record = json.loads(line.getMessage())
    assert record["adapter"] == "a_only*1+shared*0.5"
    assert [(c["adapter"], c["sha256"], c["route"], c["scale"]) for c in record["components"]] == [
        ("a_only", a.spec.sha256, "active", 1.0),
        ("shared", s.spec.sha256, "canary", 0.5),
    ]
    access = next(r for r in caplog.records if r.name == "loraplex.requests").getMessage()
    assert (
        f" adapter=a_only@{a.spec.ref.revision}*1+shared@{s.spec.ref.revision}*0.5 "
        f"({a.spec.sha256[:12]},{s.spec.sha256[:12]})"
    ) in access

    metrics = world.live.state.metrics
    for i in range(100):  # more distinct compositions than labels: the rest are 'other'
        metrics.count_composition(f"a_only*{i}+shared*1")
    text = metrics.render().decode()
    series = [ln for ln in text.splitlines() if ln.startswith("loraplex_composed_requests_total")]
    assert len(series) <= 65 and any('composition="other"' in ln for ln in series), series
    assert 'loraplex_composed_requests_total{composition="a_only*0+shared*1"} 1.0' in series


# -- end to end --------------------------------------------------------------------------------
def test_one_component_at_scale_one_is_served_as_the_adapter(
    world: World, tiny_model: Path
) -> None:
    """``merged_adapters`` of one id at weight 1 is the adapter itself (no composition): served
    today, with the adapter's greedy tokens and its plain header."""
    prompt = [5, 17, 42, 99, 7, 3]
    want, _ = reference_greedy(load_merged_reference(tiny_model, world.served["a_only"]), prompt, 6)
    body = {"model": "a_only", "prompt": prompt, "max_tokens": 6, "return_token_ids": True,
            **_merged(["a_only"], [1])}  # fmt: skip
    r = _post(world, body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want
    assert r.headers["x-loraplex-adapter"].startswith("a_only;revision=")
    assert "scale=" not in r.headers["x-loraplex-adapter"]


def test_composed_request_equals_the_sum_of_the_scaled_adapters(
    world: World, tiny_model: Path, tmp_path: Path
) -> None:
    """HTTP with ``merged_adapters`` (``a_only`` at 1, ``shared``'s canary at -0.5) answers the
    greedy tokens of the base with both deltas merged into its weights, the second scaled
    (its B matrices times -0.5). float32 throughout."""
    from peft import PeftModel
    from safetensors.torch import load_file, save_file

    scaled = Path(shutil.copytree(world.served["shared"].parent / "shared_v2", tmp_path / "s"))
    weights = scaled / "adapter_model.safetensors"
    tensors = load_file(weights)
    save_file({k: v * -0.5 if "lora_B" in k else v for k, v in tensors.items()}, weights)
    ref = load_merged_reference(tiny_model, world.served["a_only"])
    ref = PeftModel.from_pretrained(ref, str(scaled)).merge_and_unload().eval()
    prompt = [5, 17, 42, 99, 7, 3]
    want, _ = reference_greedy(ref, prompt, 6)

    body = {"model": BASE, "prompt": prompt, "max_tokens": 6, "return_token_ids": True,
            **_merged(["a_only", "shared"], [1.0, -0.5])}  # fmt: skip
    r = _post(world, body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want
    assert "scale=-0.5" in r.headers["x-loraplex-adapter"]
