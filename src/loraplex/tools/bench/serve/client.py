"""The load generator's client: sends a schedule to an OpenAI-compatible server over streaming
HTTP (closed loop or open loop) and records what each request saw (:class:`RequestRecord`)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from loraplex.tools.bench.common import SSEDecodeError, sse_json
from loraplex.tools.bench.serve.schedule import BenchError, BenchRequest

SERVED_BY_HEADERS = ("x-loraplex-replica", "x-served-by", "x-loraplex-served-by")
"""Response headers naming the replica that served a request (first one present wins)."""

STATE_HEADER = "x-loraplex-adapter-state"


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
    tenant: str = ""  # multi-tenant mixes (loraplex.tools.bench.serve.mixed): who sent it
    slo_class: str = ""  # and its class label

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
