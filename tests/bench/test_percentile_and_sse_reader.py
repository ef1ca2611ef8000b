"""The benchmarks' shared percentile and SSE reader (loraplex.tools.bench.common)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Iterator

import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from loraplex.testing.server import serve_in_thread
from loraplex.tools.bench.common import SSEDecodeError, percentile, sse_json
from loraplex.tools.bench.serve import BenchRequest, run_load, summarize


def test_percentile_is_nearest_rank() -> None:
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert [percentile(xs, q) for q in (0, 20, 21, 50, 99, 100)] == [1.0, 1.0, 2.0, 3.0, 5.0, 5.0]
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    hundred = [float(i) for i in range(1, 101)]
    assert (percentile(hundred, 50), percentile(hundred, 90), percentile(hundred, 99)) == (
        50.0, 90.0, 99.0,
    )  # fmt: skip
    assert math.isnan(percentile([math.nan], 50))  # type: ignore[arg-type]


async def _lines(*lines: str) -> AsyncIterator[str]:
    for line in lines:
        yield line


def _collect(*lines: str) -> list[object]:
    async def run() -> list[object]:
        return [obj async for obj in sse_json(_lines(*lines))]

    return asyncio.run(run())


def test_sse_json_reads_data_lines_until_done() -> None:
    got = _collect(
        ": keep-alive comment", 'data: {"a": 1}', "", "event: x", 'data:{"b": [2]}',
        "data: 3", "data: [DONE]", 'data: {"after": "done"}',
    )  # fmt: skip
    assert got == [{"a": 1}, {"b": [2]}, 3]
    assert _collect('data: {"a": 1}') == [{"a": 1}]  # a stream that ends without [DONE]
    with pytest.raises(SSEDecodeError, match="bad SSE data") as e:
        _collect('data: {"a": 1}', "data: {not json")
    assert e.value.data == "{not json"


def test_bad_sse_data_is_a_protocol_error_of_that_request() -> None:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> object:
        def events() -> Iterator[bytes]:
            yield b'data: {"choices": [{"text": "a"}]}\n\n'
            yield b"data: {truncated\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    reqs = [BenchRequest("m", [1, 2], 2) for _ in range(3)]
    with serve_in_thread(app) as url:
        res = run_load(url, reqs, concurrency=1, fetch_ranks=False)
    assert summarize(res)["error_kinds"] == {"protocol": 3}
    assert all("bad SSE data" in r.error and r.ttft is not None for r in res.records)
