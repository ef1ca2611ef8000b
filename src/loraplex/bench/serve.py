"""Load generator for any OpenAI-compatible server (loraplex, vLLM, a router), as a library.

    workload (sim generators or a trace) -> schedule of BenchRequests
        -> run_load(url, requests, concurrency=... | open loop at the requests' times)
        -> BenchResult (one RequestRecord per request) -> summarize(result) -> report / JSON

Every request streams (SSE) so the client sees the time to the first token; output lengths are
forced with ``ignore_eos`` (vLLM accepts it too) and counted from the final usage chunk
(``stream_options.include_usage``) when the server sends one. Warm/cold comes from loraplex's
``x-loraplex-adapter-state`` response header, the replica from a served-by header when a router
sets one; adapter ranks from ``GET /v1/adapters`` when the server exposes it.

No torch here: the router's benchmarks reuse this module.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import aclosing
from dataclasses import asdict, dataclass, field
from typing import Any

from loraplex.bench.common import SSEDecodeError, percentile, sse_json
from loraplex.sim.workloads import Request as TraceRequest

__all__ = [
    "SERVED_BY_HEADERS",
    "BenchError",
    "BenchRequest",
    "BenchResult",
    "LengthDist",
    "RequestRecord",
    "arun_load",
    "build_requests",
    "fetch_adapter_ranks",
    "fetch_models",
    "map_adapters",
    "percentile",
    "plot_ttft_cdf",
    "render_summary",
    "result_json",
    "run_load",
    "summarize",
]

SERVED_BY_HEADERS = ("x-loraplex-replica", "x-served-by", "x-loraplex-served-by")
"""Response headers naming the replica that served a request (first one present wins)."""

STATE_HEADER = "x-loraplex-adapter-state"

_WORDS = (
    "the of and to in is that it was for on are as with his they at be this have from or one had "
    "by word but not what all were we when your can said there use an each which she do how "
    "their if will up other about out many then them these so some her would make like him into "
    "time has look two more write go see number no way could people my than first water been call"
).split()


class BenchError(ValueError):
    """Bad benchmark input (spec, lengths, names, server answers); the message says which."""


# -- schedule --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LengthDist:
    """A token-count distribution: ``64`` (fixed) or ``64:256`` (uniform, inclusive)."""

    lo: int
    hi: int

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        a, sep, b = str(text).partition(":")
        try:
            lo = int(a)
            hi = int(b) if sep else lo
        except ValueError:
            raise BenchError(
                f"bad length {text!r} (expected N or LO:HI, e.g. 64 or 32:256)"
            ) from None
        if lo < 1 or hi < lo:
            raise BenchError(f"bad length {text!r}: need 1 <= LO <= HI")
        return cls(lo, hi)

    def sample(self, rng: random.Random) -> int:
        return self.lo if self.lo == self.hi else rng.randint(self.lo, self.hi)

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}:{self.hi}"


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: the model name, its prompt, forced output length, and its send time
    (seconds after the start; ignored in closed loop). ``workload_adapter`` is the id the
    workload gave it (before mapping onto served names)."""

    model: str
    prompt: str | list[int]
    max_tokens: int
    time: float = 0.0
    workload_adapter: str = ""

    @property
    def prompt_tokens(self) -> int | None:
        return len(self.prompt) if isinstance(self.prompt, list) else None


def map_adapters(trace: Sequence[TraceRequest], names: Sequence[str]) -> dict[str, str]:
    """Workload adapter id -> served model name: the i-th most requested id (ties by id) onto
    ``names[i]``; with more ids than names they wrap around (``names[i % len(names)]``)."""
    if not names:
        raise BenchError("no model names to send requests to")
    counts = Counter(r.adapter for r in trace)
    order = sorted(counts, key=lambda a: (-counts[a], a))
    return {a: names[i % len(names)] for i, a in enumerate(order)}


def _prompt(rng: random.Random, n: int, kind: str, token_range: tuple[int, int]) -> str | list[int]:
    if kind == "tokens":
        return [rng.randrange(*token_range) for _ in range(n)]
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _gaps(rng: random.Random, n: int, rate: float, arrivals: str, cv: float) -> list[float]:
    """``n`` arrival times at mean ``rate``: Poisson, or gamma gaps with coefficient ``cv``."""
    t, out = 0.0, []
    shape = 1.0 / (cv * cv)
    for _ in range(n):
        if arrivals == "poisson":
            t += rng.expovariate(rate)
        else:
            t += rng.gammavariate(shape, 1.0 / (rate * shape))
        out.append(t)
    return out


def build_requests(
    trace: Sequence[TraceRequest],
    names: Sequence[str],
    *,
    prompt_len: LengthDist = LengthDist(64, 64),
    output_len: LengthDist = LengthDist(32, 32),
    rate: float | None = None,
    arrivals: str = "poisson",
    cv: float = 2.0,
    seed: int = 0,
    prompt_kind: str = "tokens",
    token_range: tuple[int, int] = (100, 300),
) -> list[BenchRequest]:
    """The schedule: one BenchRequest per trace entry, adapters mapped with ``map_adapters``.

    Send times: ``arrivals`` ``poisson``/``gamma`` draw fresh gaps at ``rate`` (req/s);
    ``trace`` keeps the trace's own times (shifted to start at 0), rescaled to ``rate`` if given.
    Prompts are ``prompt_kind`` ``tokens`` (random ids in ``token_range``: exact lengths, any
    tokenizer) or ``text`` (random common words, about one token each; for chat).
    """
    if arrivals not in ("poisson", "gamma", "trace"):
        raise BenchError(f"arrivals must be poisson, gamma or trace, got {arrivals!r}")
    if rate is not None and not (rate > 0 and math.isfinite(rate)):
        raise BenchError(f"rate must be a finite number > 0, got {rate}")
    if arrivals != "trace" and rate is None:
        raise BenchError(f"{arrivals} arrivals need a rate")
    if cv <= 0:
        raise BenchError(f"cv must be > 0, got {cv}")
    if prompt_kind not in ("tokens", "text"):
        raise BenchError(f"prompt kind must be tokens or text, got {prompt_kind!r}")
    if not 0 <= token_range[0] < token_range[1]:
        raise BenchError(f"bad token id range {token_range} (need 0 <= LO < HI)")
    mapping = map_adapters(trace, names)
    rng = random.Random(seed)
    n = len(trace)
    if arrivals == "trace":
        t0 = trace[0].time if trace else 0.0
        times = [r.time - t0 for r in trace]
        span = times[-1] if times else 0.0
        if rate is not None and span > 0:
            scale = (n - 1) / rate / span if n > 1 else 1.0
            times = [t * scale for t in times]
    else:
        times = _gaps(random.Random(seed + 1), n, rate or 1.0, arrivals, cv)
    return [
        BenchRequest(
            model=mapping[r.adapter],
            prompt=_prompt(rng, prompt_len.sample(rng), prompt_kind, token_range),
            max_tokens=output_len.sample(rng),
            time=t,
            workload_adapter=r.adapter,
        )
        for r, t in zip(trace, times, strict=True)
    ]


# -- records ---------------------------------------------------------------------------------------
@dataclass
class RequestRecord:
    """One request as the client saw it. Times in seconds; ``sent`` is since the run started."""

    index: int
    model: str
    sent: float
    max_tokens: int
    status: int = 0  # HTTP status; 0 = no response
    ttft: float | None = None  # to the first chunk carrying output
    tpot: float | None = None  # (e2e - ttft) / (output tokens - 1)
    e2e: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    state: str = ""  # warm | cold | "" (the server did not say)
    served_by: str = ""  # replica header, when a router sets one
    adapter_header: str = ""  # x-loraplex-adapter: which weights served it
    rank: int | None = None  # the adapter's rank, from /v1/adapters
    error_kind: str = ""  # "" = success; http_404, http_503, connect, timeout, stream, ...
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error_kind


@dataclass
class BenchResult:
    """All records of one run plus what the run was (for the summary and JSON)."""

    records: list[RequestRecord]
    duration: float  # first send to last completion, seconds
    mode: str  # "concurrency=N" or "rate=R req/s" / "trace times"
    url: str
    endpoint: str
    ranks: dict[str, int] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


# -- server info -----------------------------------------------------------------------------------
def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def fetch_models(url: str, api_key: str | None = None, timeout: float = 30.0) -> list[dict]:
    """``GET /v1/models`` -> its ``data`` list; BenchError with the reason if it fails."""
    import httpx

    try:
        r = httpx.get(f"{url.rstrip('/')}/v1/models", headers=_auth(api_key), timeout=timeout)
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach {url}: {e}") from None
    if r.status_code != 200:
        raise BenchError(f"GET /v1/models answered {r.status_code}: {r.text[:200]}")
    try:
        data = r.json()["data"]
        assert isinstance(data, list)
    except Exception:
        raise BenchError("GET /v1/models did not return an OpenAI model list") from None
    return data


def fetch_adapter_ranks(
    url: str, api_key: str | None = None, timeout: float = 30.0
) -> dict[str, int]:
    """Adapter name -> rank from loraplex's ``GET /v1/adapters``; {} when the server has no such
    route (vLLM) or has not loaded the adapter yet (rank unknown)."""
    import httpx

    try:
        r = httpx.get(f"{url.rstrip('/')}/v1/adapters", headers=_auth(api_key), timeout=timeout)
        rows = r.json().get("data", []) if r.status_code == 200 else []
    except (httpx.HTTPError, ValueError, AttributeError):
        return {}
    out = {}
    for row in rows if isinstance(rows, list) else []:
        if isinstance(row, dict) and isinstance(row.get("rank"), int) and row.get("name"):
            out[str(row["name"])] = int(row["rank"])
    return out


# -- the client ------------------------------------------------------------------------------------
def _body(req: BenchRequest, endpoint: str, extra: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": req.model,
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        text = req.prompt if isinstance(req.prompt, str) else " ".join(map(str, req.prompt))
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = req.prompt
    body.update(extra)
    return body


def _chunk_output(obj: dict[str, Any]) -> tuple[bool, int]:
    """(carries output, content pieces) for one SSE chunk of either endpoint."""
    has, pieces = False, 0
    for c in obj.get("choices") or []:
        delta = c.get("delta")
        text = (delta.get("content") or "") if isinstance(delta, dict) else (c.get("text") or "")
        lp = c.get("logprobs")
        if text or (isinstance(lp, dict) and (lp.get("tokens") or lp.get("content"))):
            has = True
            pieces += 1
    return has, pieces


async def _send(
    client: Any,
    idx: int,
    req: BenchRequest,
    endpoint: str,
    extra: dict[str, Any],
    served_by_headers: Sequence[str],
    t_start: float,
) -> RequestRecord:
    import httpx

    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    t0 = time.perf_counter()
    rec = RequestRecord(
        idx, req.model, t0 - t_start, req.max_tokens, prompt_tokens=req.prompt_tokens
    )
    pieces = 0
    usage_tokens: int | None = None
    try:
        async with client.stream("POST", path, json=_body(req, endpoint, extra)) as r:
            rec.status = r.status_code
            rec.state = r.headers.get(STATE_HEADER, "")
            rec.adapter_header = r.headers.get("x-loraplex-adapter", "")
            rec.served_by = next((r.headers[h] for h in served_by_headers if h in r.headers), "")
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                rec.error_kind = f"http_{r.status_code}"
                rec.error = _error_message(text)
                return rec
            async with aclosing(sse_json(r.aiter_lines())) as events:
                async for obj in events:
                    if not isinstance(obj, dict):
                        continue
                    if "error" in obj:
                        rec.error_kind, rec.error = "stream", _error_message(json.dumps(obj))
                        break
                    has, n = _chunk_output(obj)
                    if has and rec.ttft is None:
                        rec.ttft = time.perf_counter() - t0
                    pieces += n
                    usage = obj.get("usage")
                    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                        usage_tokens = usage["completion_tokens"]
                        if isinstance(usage.get("prompt_tokens"), int):
                            rec.prompt_tokens = usage["prompt_tokens"]
    except SSEDecodeError as e:
        rec.error_kind, rec.error = "protocol", str(e)
    except httpx.TimeoutException as e:
        rec.error_kind, rec.error = "timeout", str(e) or type(e).__name__
    except httpx.ConnectError as e:
        rec.error_kind, rec.error = "connect", str(e) or type(e).__name__
    except httpx.HTTPError as e:  # the connection broke mid-stream, ...
        rec.error_kind, rec.error = "transport", f"{type(e).__name__}: {e}"
    rec.e2e = time.perf_counter() - t0
    rec.output_tokens = usage_tokens if usage_tokens is not None else pieces
    if rec.ok and rec.ttft is None:
        rec.error_kind, rec.error = "no_output", "the stream ended without any output"
    if rec.ok and rec.ttft is not None and rec.output_tokens > 1:
        rec.tpot = (rec.e2e - rec.ttft) / (rec.output_tokens - 1)
    return rec


def _error_message(text: str) -> str:
    try:
        err = json.loads(text).get("error", {})
        msg = err.get("message") if isinstance(err, dict) else err
        return str(msg)[:300] if msg else text[:300]
    except (ValueError, AttributeError):
        return text[:300]


async def arun_load(
    url: str,
    requests: Sequence[BenchRequest],
    *,
    concurrency: int | None = None,
    api_key: str | None = None,
    endpoint: str = "completions",
    duration: float | None = None,
    timeout: float = 600.0,
    extra_body: dict[str, Any] | None = None,
    served_by_headers: Sequence[str] = SERVED_BY_HEADERS,
    on_record: Callable[[RequestRecord], None] | None = None,
) -> BenchResult:
    """Send ``requests`` and record each one. Closed loop with ``concurrency`` workers (each
    sends its next request when the last one finished), else open loop at the requests' own
    ``time`` offsets. ``duration`` (s): send nothing after that. Never raises for a failed
    request: it becomes a record with an ``error_kind``."""
    import httpx

    if endpoint not in ("completions", "chat"):
        raise BenchError(f"endpoint must be completions or chat, got {endpoint!r}")
    if concurrency is not None and concurrency < 1:
        raise BenchError(f"concurrency must be >= 1, got {concurrency}")
    extra = dict(extra_body or {})
    records: list[RequestRecord] = []
    width = concurrency or max(1, len(requests))
    limits = httpx.Limits(max_connections=min(width, 1000) + 4, max_keepalive_connections=64)
    client_timeout = httpx.Timeout(timeout, connect=min(timeout, 30.0))
    async with httpx.AsyncClient(
        base_url=url.rstrip("/"), headers=_auth(api_key), timeout=client_timeout, limits=limits
    ) as client:
        t_start = time.perf_counter()

        async def one(i: int, req: BenchRequest) -> None:
            rec = await _send(client, i, req, endpoint, extra, served_by_headers, t_start)
            records.append(rec)
            if on_record is not None:
                on_record(rec)

        def expired() -> bool:
            return duration is not None and time.perf_counter() - t_start >= duration

        if concurrency is not None:
            it = iter(enumerate(requests))

            async def worker() -> None:
                for i, req in it:
                    if expired():
                        return
                    await one(i, req)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            tasks = []
            for i, req in enumerate(requests):
                if duration is not None and req.time >= duration:
                    break
                delay = req.time - (time.perf_counter() - t_start)
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.ensure_future(one(i, req)))
            await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t_start
    records.sort(key=lambda r: r.index)
    if records:
        elapsed = max((r.sent + (r.e2e or 0.0)) for r in records) - min(r.sent for r in records)
    mode = f"concurrency={concurrency}" if concurrency is not None else "open loop"
    return BenchResult(records, elapsed, mode, url, endpoint)


def run_load(
    url: str,
    requests: Sequence[BenchRequest],
    *,
    concurrency: int | None = None,
    api_key: str | None = None,
    endpoint: str = "completions",
    duration: float | None = None,
    timeout: float = 600.0,
    extra_body: dict[str, Any] | None = None,
    served_by_headers: Sequence[str] = SERVED_BY_HEADERS,
    progress: bool = False,
    fetch_ranks: bool = True,
) -> BenchResult:
    """Synchronous ``arun_load`` plus ranks from ``/v1/adapters`` (asked before and after the
    run: loraplex knows an adapter's rank once it loaded it) and an optional tqdm bar on stderr.
    """
    bar = None
    if progress:
        import sys

        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="requests", unit="req", file=sys.stderr)
    ranks = fetch_adapter_ranks(url, api_key) if fetch_ranks else {}
    try:
        result = asyncio.run(
            arun_load(
                url,
                requests,
                concurrency=concurrency,
                api_key=api_key,
                endpoint=endpoint,
                duration=duration,
                timeout=timeout,
                extra_body=extra_body,
                served_by_headers=served_by_headers,
                on_record=(lambda _r: bar.update(1)) if bar is not None else None,
            )
        )
    finally:
        if bar is not None:
            bar.close()
    if fetch_ranks:
        ranks.update(fetch_adapter_ranks(url, api_key))
    result.ranks = ranks
    for rec in result.records:
        rec.rank = ranks.get(rec.model)
    return result


# -- summary ---------------------------------------------------------------------------------------
def _dist(xs: Sequence[float]) -> dict[str, float | None]:
    return {
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
        "mean": statistics.fmean(xs) if xs else None,
    }


def _group(recs: Sequence[RequestRecord], duration: float) -> dict[str, Any]:
    ok = [r for r in recs if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(recs),
        "completed": len(ok),
        "errors": len(recs) - len(ok),
        "output_tokens": out_tokens,
        "requests_per_s": len(ok) / duration if duration > 0 else None,
        "output_tokens_per_s": out_tokens / duration if duration > 0 else None,
        "ttft_s": _dist([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": _dist([r.tpot for r in ok if r.tpot is not None]),
    }


def summarize(result: BenchResult) -> dict[str, Any]:
    """Throughput, TTFT/TPOT p50/p90/p99 overall, by warm/cold state, by adapter rank and by
    replica, error counts by kind, and requests whose output length differs from the asked one
    (a server ignoring ``ignore_eos``). Rates in groups use the whole run's duration."""
    recs, dur = result.records, result.duration
    by_state: dict[str, list[RequestRecord]] = {}
    by_rank: dict[str, list[RequestRecord]] = {}
    by_replica: dict[str, list[RequestRecord]] = {}
    for r in recs:
        by_state.setdefault(r.state or "unknown", []).append(r)
        by_rank.setdefault(str(r.rank) if r.rank is not None else "unknown", []).append(r)
        if r.served_by:
            by_replica.setdefault(r.served_by, []).append(r)
    errors = Counter(r.error_kind for r in recs if not r.ok)
    samples: dict[str, str] = {}
    for r in recs:
        if not r.ok:
            samples.setdefault(r.error_kind, r.error)
    return {
        "url": result.url,
        "endpoint": result.endpoint,
        "mode": result.mode,
        "duration_s": dur,
        **_group(recs, dur),
        "by_state": {k: _group(v, dur) for k, v in sorted(by_state.items())},
        "by_rank": {
            k: _group(v, dur)
            for k, v in sorted(
                by_rank.items(), key=lambda kv: (not kv[0].isdigit(), len(kv[0]), kv[0])
            )
        },
        "by_replica": {k: _group(v, dur) for k, v in sorted(by_replica.items())},
        "error_kinds": dict(errors),
        "error_samples": samples,
        "short_outputs": sum(1 for r in recs if r.ok and r.output_tokens != r.max_tokens),
        "distinct_models": len({r.model for r in recs}),
        "meta": result.meta,
    }


def result_json(result: BenchResult) -> dict[str, Any]:
    """Summary plus every record (what ``--json`` prints)."""
    return {"summary": summarize(result), "records": [asdict(r) for r in result.records]}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def render_summary(s: dict[str, Any]) -> str:
    """The end-of-run table."""
    lines = [
        f"{s['url']}  /v1/{'chat/completions' if s['endpoint'] == 'chat' else 'completions'}"
        f"  {s['mode']}  {s['distinct_models']} models",
        f"{s['completed']}/{s['requests']} requests ok in {s['duration_s']:.2f} s: "
        f"{s['requests_per_s'] or 0:.2f} req/s, {s['output_tokens_per_s'] or 0:.1f} output tok/s "
        f"({s['output_tokens']} tokens)",
        "",
        f"{'group':<14}{'n':>6}{'err':>5}{'tok/s':>9}"
        f"{'TTFT p50':>10}{'p90':>9}{'p99':>9}{'TPOT p50':>10}{'p90':>8}{'p99':>8}   (ms)",
    ]

    def row(name: str, g: dict[str, Any]) -> str:
        t, p = g["ttft_s"], g["tpot_s"]
        return (
            f"{name:<14}{g['requests']:>6}{g['errors']:>5}{g['output_tokens_per_s'] or 0:>9.1f}"
            f"{_ms(t['p50']):>10}{_ms(t['p90']):>9}{_ms(t['p99']):>9}"
            f"{_ms(p['p50']):>10}{_ms(p['p90']):>8}{_ms(p['p99']):>8}"
        )

    lines.append(row("all", s))
    for k, g in s["by_state"].items():
        lines.append(row(k, g))
    if any(k != "unknown" for k in s["by_rank"]):
        for k, g in s["by_rank"].items():
            lines.append(row(f"rank {k}", g))
    for k, g in s["by_replica"].items():
        lines.append(row(f"@{k}"[:14], g))
    if s["error_kinds"]:
        lines.append("")
        lines.append(
            "errors: " + ", ".join(f"{k} {n}" for k, n in sorted(s["error_kinds"].items()))
        )
        for k, msg in sorted(s["error_samples"].items()):
            lines.append(f"  {k}: {msg[:160]}")
    if s["short_outputs"]:
        lines.append(
            f"note: {s['short_outputs']} completed requests got a different number of output "
            "tokens than asked (does the server honour ignore_eos?)"
        )
    return "\n".join(lines)


def plot_ttft_cdf(result: BenchResult, path: str, title: str = "") -> None:
    """TTFT CDFs (all, warm, cold) to a PNG with matplotlib's Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    groups = {"all": [r for r in result.records if r.ok and r.ttft is not None]}
    for state in ("warm", "cold"):
        groups[state] = [r for r in groups["all"] if r.state == state]
    for name, recs in groups.items():
        xs = sorted(r.ttft * 1000 for r in recs if r.ttft is not None)
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=f"{name} (n={len(xs)})")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.01)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title or f"TTFT CDF, {result.mode}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
