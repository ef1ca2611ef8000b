"""Speculative decoding seen from outside: vLLM's ``vllm:spec_decode_*`` counters (names, labels,
positions) and loraplex's per-adapter acceptance on ``/metrics``, with bounded labels; the
dashboard's data (method, acceptance, accepted tokens per draft, per-adapter rows) and page; and
nothing of it on a server that does not speculate.

The steps are fed through the step observers the engine loop calls (with the loop idle: no
request runs, so the counts are exactly the ones fed)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loraplex.config import EngineConfig, LoRAModule, ServerConfig
from loraplex.engine.client import StepStats
from loraplex.engine.spec.stats import BASE_LABEL, SpecStepStats
from loraplex.registry import Principal
from loraplex.server.app import ServerState, create_app
from loraplex.server.dashboard import TOP_SPEC_ADAPTERS, DashboardSampler
from loraplex.server.metrics import MAX_ADAPTER_LABELS
from loraplex.testing.server import serve_in_thread
from tests.browser import chromium_page
from tests.server.test_concurrency import sse_payloads, stream_text
from tests.server.test_vllm_metrics import samples, value

ADMIN = "sk-admin-spec"
ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}
MODEL = "base-model"
K = 3  # num_speculative_tokens
SPEC = f'{{"method": "ngram", "num_speculative_tokens": {K}}}'
Server = tuple[str, httpx.Client, ServerState]

# two steps: 5 drafts, 13 draft tokens, 6 accepted; sql (2, 6, 3), base (1, 3, 1), composed (2, 4, 2)
STEPS = (
    SpecStepStats(2, 6, 4, (2, 1, 1), (("sql", 1, 3, 3), (BASE_LABEL, 1, 3, 1))),
    SpecStepStats(3, 7, 2, (2, 0, 0), (("sql", 1, 3, 0), ("composed", 2, 4, 2))),
)


def serve(tiny_model: Path, adapter: Path, speculative: str | None) -> Iterator[Server]:
    app = create_app(
        ServerConfig(
            EngineConfig(
                model=str(tiny_model), num_threads=1, max_loras=1, speculative_config=speculative
            ),
            served_model_name=[MODEL],
            lora_modules=[LoRAModule("sql", str(adapter))],
            admin_api_key=ADMIN,
            log_level="warning",
        )
    )
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as c:
        yield url, c, app.state.loraplex


@pytest.fixture
def server(tiny_model: Path, adapters: dict[str, Path]) -> Iterator[Server]:
    """A speculating server (ngram, 3 tokens): fresh counters for each test."""
    yield from serve(tiny_model, adapters["all_r8"], SPEC)


@pytest.fixture
def plain(tiny_model: Path, adapters: dict[str, Path]) -> Iterator[Server]:
    """The same server without speculative decoding."""
    yield from serve(tiny_model, adapters["all_r8"], None)


def feed(state: ServerState, *steps: SpecStepStats | None) -> None:
    """Run the engine loop's step observers on steps that verified ``steps`` (None: a step
    with no draft)."""
    for spec in steps:
        drafts = spec.num_drafts if spec else 0
        tokens = spec.num_draft_tokens if spec else 0
        stats = StepStats(num_seqs=max(drafts, 1), num_tokens=max(drafts, 1) + tokens, spec=spec)
        for fn in state.client.aengine.step_observers:
            fn(stats)


def scrape(c: httpx.Client) -> dict[str, list[tuple[dict[str, str], float]]]:
    r = c.get("/metrics", headers=ADMIN_H)
    assert r.status_code == 200, r.text
    return samples(r.text)


def per_adapter(got: dict, field: str) -> dict[str, float]:
    """adapter label -> value of ``loraplex_adapter_spec_decode_num_<field>_total``."""
    name = f"loraplex_adapter_spec_decode_num_{field}_total"
    return {lab["adapter"]: v for lab, v in got.get(name, [])}


def test_vllm_counters_with_their_labels_and_positions(server: Server) -> None:
    _, c, state = server
    assert state.client.speculative is not None and state.client.speculative.method == "ngram"
    got = scrape(c)
    # registered from start-up at 0, as vLLM's: every position of a draft included
    for name in ("drafts", "draft_tokens", "accepted_tokens"):
        rows = got[f"vllm:spec_decode_num_{name}_total"]
        assert rows == [({"model_name": MODEL, "engine": "0"}, 0.0)], name
    pos = got["vllm:spec_decode_num_accepted_tokens_per_pos_total"]
    assert sorted(lab["position"] for lab, _ in pos) == ["0", "1", "2"]
    assert all(lab["model_name"] == MODEL and lab["engine"] == "0" and v == 0 for lab, v in pos)
    info = got["loraplex_spec_decode_info"]
    assert info == [({"method": "ngram", "num_speculative_tokens": str(K)}, 1.0)]

    feed(state, STEPS[0], None, STEPS[1])  # a step without drafts counts nothing
    got = scrape(c)
    assert value(got, "vllm:spec_decode_num_drafts_total") == 5
    assert value(got, "vllm:spec_decode_num_draft_tokens_total") == 13
    assert value(got, "vllm:spec_decode_num_accepted_tokens_total") == 6
    by_pos = {
        int(lab["position"]): v
        for lab, v in got["vllm:spec_decode_num_accepted_tokens_per_pos_total"]
    }
    assert by_pos == {0: 4, 1: 1, 2: 1}
    # vLLM's identities: the positions sum to the accepted tokens, and never grow along a draft
    assert sum(by_pos.values()) == 6 and 5 >= by_pos[0] >= by_pos[1] >= by_pos[2]
    assert per_adapter(got, "drafts") == {"sql": 2, "base": 1, "composed": 2}
    assert per_adapter(got, "draft_tokens") == {"sql": 6, "base": 3, "composed": 4}
    assert per_adapter(got, "accepted_tokens") == {"sql": 3, "base": 1, "composed": 2}
    # the per-adapter series add up to vLLM's
    assert sum(per_adapter(got, "draft_tokens").values()) == 13


def test_adapter_labels_are_bounded_and_every_series_monotonic(server: Server) -> None:
    """The first MAX_ADAPTER_LABELS distinct labels get their own series, later ones go to
    ``other`` (and stay there); no series ever decreases."""
    _, c, state = server
    n = MAX_ADAPTER_LABELS + 5
    names = [f"adapter-{i:03d}" for i in range(n)]
    feed(state, *(SpecStepStats(1, 2, 1, (1,), ((name, 1, 2, 1),)) for name in names))
    before = scrape(c)
    drafts = per_adapter(before, "drafts")
    assert len(drafts) == MAX_ADAPTER_LABELS + 1
    assert set(drafts) == {*names[:MAX_ADAPTER_LABELS], "other"}
    assert drafts["other"] == 5
    # an early label keeps its series, a late one stays under "other", a new one too
    feed(state, SpecStepStats(3, 6, 3, (2, 1), (
        (names[0], 1, 2, 1), (names[-1], 1, 2, 1), ("brand-new", 1, 2, 1),
    )))  # fmt: skip
    after = scrape(c)
    drafts = per_adapter(after, "drafts")
    assert len(drafts) == MAX_ADAPTER_LABELS + 1
    assert drafts[names[0]] == 2 and drafts["other"] == 7
    assert value(after, "vllm:spec_decode_num_drafts_total") == n + 3
    for name, rows in before.items():
        if "spec_decode" not in name:
            continue
        now = {tuple(sorted(lab.items())): v for lab, v in after[name]}
        for lab, v in rows:
            assert now[tuple(sorted(lab.items()))] >= v, (name, lab)


def test_a_bad_step_counts_nothing(server: Server) -> None:
    """A negative count or more positions than a draft may hold is refused whole (the loop
    logs an observer that raises): counters stay monotonic, series bounded."""
    _, c, state = server
    spec = state.metrics.spec
    assert spec is not None
    feed(state, STEPS[0])
    for bad in (
        SpecStepStats(1, 1, -1, (0,), (("sql", 1, 1, -1),)),
        SpecStepStats(1, 2, 1, (1,), (("sql", -1, 2, 1),)),
        SpecStepStats(1, 40, 1, (1,) + (0,) * 39),
    ):
        with pytest.raises(ValueError):
            spec.observe(bad)
    got = scrape(c)
    assert value(got, "vllm:spec_decode_num_accepted_tokens_total") == 4
    assert per_adapter(got, "drafts") == {"sql": 1, "base": 1}
    assert len(got["vllm:spec_decode_num_accepted_tokens_per_pos_total"]) == K


def test_nothing_speculative_without_speculation(plain: Server) -> None:
    _, c, state = plain
    assert state.client.speculative is None and state.metrics.spec is None
    feed(state, STEPS[0])  # the engine never sends one; if it did, nothing would show
    text = c.get("/metrics", headers=ADMIN_H).text
    assert "spec_decode" not in text
    assert "vllm:generation_tokens_total" in text  # the rest is there
    body = c.get("/v1/dashboard/stats", headers=ADMIN_H).json()
    assert body["speculative"] is None
    sampler = DashboardSampler(state)
    sampler.sample()
    sampler.sample()
    assert sampler.samples[-1]["spec"] is None


def test_dashboard_data_route(server: Server) -> None:
    _, c, state = server
    body = c.get("/v1/dashboard/stats", headers=ADMIN_H).json()
    assert body["speculative"] == {
        "method": "ngram",
        "num_speculative_tokens": K,
        "totals": {
            "drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "acceptance_rate": None,
            "accepted_per_draft": None, "mean_acceptance_length": None,
            "per_position": [None, None, None],
        },
        "by_adapter": [],
    }  # fmt: skip
    sampler = DashboardSampler(state)  # its own: ticked by hand around the steps
    sampler.sample()
    feed(state, *STEPS)
    sampler.sample()
    assert sampler.samples[-1]["spec"] == pytest.approx(
        {"acceptance rate": 6 / 13, "accepted per draft": 6 / 5}
    )
    sp = c.get("/v1/dashboard/stats", headers=ADMIN_H).json()["speculative"]
    t = sp["totals"]
    assert (t["drafts"], t["draft_tokens"], t["accepted_tokens"]) == (5, 13, 6)
    assert t["acceptance_rate"] == pytest.approx(6 / 13)
    assert t["accepted_per_draft"] == pytest.approx(6 / 5)
    assert t["mean_acceptance_length"] == pytest.approx(1 + 6 / 5)  # vLLM's: the bonus token
    assert t["per_position"] == pytest.approx([4 / 5, 1 / 5, 1 / 5])
    # most drafts first (ties by label)
    assert sp["by_adapter"] == [
        {"adapter": "composed", "drafts": 2, "draft_tokens": 4, "accepted_tokens": 2,
         "acceptance_rate": pytest.approx(2 / 4)},
        {"adapter": "sql", "drafts": 2, "draft_tokens": 6, "accepted_tokens": 3,
         "acceptance_rate": pytest.approx(3 / 6)},
        {"adapter": "base", "drafts": 1, "draft_tokens": 3, "accepted_tokens": 1,
         "acceptance_rate": pytest.approx(1 / 3)},
    ]  # fmt: skip
    # the table is bounded: the adapters with the most drafts
    many = [(f"a{i:02d}", i + 10, i + 10, 0) for i in range(TOP_SPEC_ADAPTERS + 4)]
    drafts = sum(r[1] for r in many)
    feed(state, SpecStepStats(drafts, drafts, 0, (0,), tuple(many)))
    rows = c.get("/v1/dashboard/stats", headers=ADMIN_H).json()["speculative"]["by_adapter"]
    assert len(rows) == TOP_SPEC_ADAPTERS
    assert [r["adapter"] for r in rows[:2]] == [many[-1][0], many[-2][0]]
    # a tenant's key: the method, none of the server-wide counts
    tenant = sampler.stats(Principal("k1", "acme"))["speculative"]
    assert tenant == {"method": "ngram", "num_speculative_tokens": K, "totals": None,
                      "by_adapter": None}  # fmt: skip


def test_dashboard_page_shows_speculation(server: Server) -> None:
    url, _, state = server
    feed(state, *STEPS)
    with chromium_page() as page:
        page.goto(f"{url}/dashboard")
        page.evaluate(f"sessionStorage.setItem('loraplex.dashboard.key', {ADMIN!r})")
        page.reload()
        page.wait_for_selector("#spec-adapters tbody tr[data-adapter=composed]")
        assert "ngram" in (page.text_content("#spec .card[data-spec=method]") or "")
        assert "46.2%" in (page.text_content("#spec .card[data-spec=acceptance]") or "")
        assert "1.20" in (page.text_content("#spec .card[data-spec=per-draft]") or "")
        rows = page.eval_on_selector_all(
            "#spec-adapters tbody tr",
            "rows => rows.map(r => [...r.cells].map(c => c.textContent))",
        )
        assert rows[1] == ["sql", "2", "6", "3", "50.0%"]
        assert [r[0] for r in rows] == ["composed", "sql", "base"]
        page.wait_for_selector("#chart-spec svg")  # the acceptance chart, operators only


def test_a_served_request_speculates_and_is_counted(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    """End to end over HTTP: a speculating server (ngram, fixed k) answers a base and an
    adapter completion with the text of a server without speculation, and its /metrics count
    the drafts it verified, in total and for the adapter."""
    spec = (
        '{"method": "ngram", "num_speculative_tokens": 3, "adaptive": false, '
        '"prompt_lookup_min": 1, "prompt_lookup_max": 3}'
    )
    body = {"prompt": "one two three one two three one two", "max_tokens": 24, "temperature": 0}
    texts = []
    for config in (spec, None):
        for _url, c, _ in serve(tiny_model, adapters["all_r8"], config):
            got = [
                c.post("/v1/completions", json={**body, "model": m}, headers=ADMIN_H).json()
                for m in (MODEL, "sql")
            ]
            texts.append([g["choices"][0]["text"] for g in got])
            # streamed: several tokens may arrive in one chunk; the text and the per-token
            # logprobs add up to the whole answer's
            stream = {**body, "model": "sql", "stream": True, "logprobs": 1}
            with c.stream("POST", "/v1/completions", json=stream, headers=ADMIN_H) as r:
                payloads = sse_payloads(list(r.iter_lines()))
            texts[-1].append(stream_text(payloads))
            tokens = [t for p in payloads for ch in p["choices"] if ch.get("logprobs")
                      for t in ch["logprobs"]["tokens"]]  # fmt: skip
            assert len(tokens) == got[1]["usage"]["completion_tokens"]
            text = c.get("/metrics", headers=ADMIN_H).text
            if config is not None:
                got_samples = samples(text)
                drafted = value(got_samples, "vllm:spec_decode_num_draft_tokens_total")
                accepted = value(got_samples, "vllm:spec_decode_num_accepted_tokens_total")
                assert drafted > 0 and 0 <= accepted <= drafted
                per_adapter = value(
                    got_samples,
                    "loraplex_adapter_spec_decode_num_draft_tokens_total",
                    adapter="sql",
                )
                assert 0 < per_adapter <= drafted
            else:
                assert "spec_decode" not in text
    assert texts[0] == texts[1] and texts[0][2] == texts[0][1]
