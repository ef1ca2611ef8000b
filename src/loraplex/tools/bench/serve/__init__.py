"""Load generator for any OpenAI-compatible server (loraplex, vLLM, a router), as a library.

    workload (sim generators or a trace) -> schedule of BenchRequests
        -> run_load(url, requests, concurrency=... | open loop at the requests' times)
        -> BenchResult (one RequestRecord per request) -> summarize(result) -> report / JSON

Every request streams (SSE) so the client sees the time to the first token; output lengths are
forced with ``ignore_eos`` (vLLM accepts it too) and counted from the final usage chunk
(``stream_options.include_usage``) when the server sends one. Warm/cold comes from loraplex's
``x-loraplex-adapter-state`` response header, the replica from a served-by header when a router
sets one; adapter ranks from ``GET /v1/adapters`` when the server exposes it.

The pieces: ``schedule`` (what to send and when), ``client`` (sending it, one record per
request) and ``report`` (summary, table, plot). This package re-exports their public names: it is
the library API that ``loraplex bench serve`` and the scripts use.

No torch here: the router's benchmarks reuse this package.
"""

from __future__ import annotations

from loraplex.tools.bench.common import percentile
from loraplex.tools.bench.serve.client import (
    SERVED_BY_HEADERS,
    BenchResult,
    RequestRecord,
    arun_load,
    fetch_adapter_ranks,
    fetch_models,
    run_load,
)
from loraplex.tools.bench.serve.mixed import TenantStream, arun_mixed, jain_index, run_mixed
from loraplex.tools.bench.serve.report import plot_ttft_cdf, render_summary, result_json, summarize
from loraplex.tools.bench.serve.schedule import (
    BenchError,
    BenchRequest,
    LengthDist,
    build_requests,
    map_adapters,
)

__all__ = [
    "SERVED_BY_HEADERS",
    "BenchError",
    "BenchRequest",
    "BenchResult",
    "LengthDist",
    "RequestRecord",
    "TenantStream",
    "arun_load",
    "arun_mixed",
    "build_requests",
    "fetch_adapter_ranks",
    "fetch_models",
    "jain_index",
    "map_adapters",
    "percentile",
    "plot_ttft_cdf",
    "render_summary",
    "result_json",
    "run_load",
    "run_mixed",
    "summarize",
]
