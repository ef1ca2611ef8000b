"""Live-server adapter cache benchmark: more adapters than device slots and host memory.

    python -m loraplex.tools.bench.cache_live [--requests 400] [--adapters 48] [--concurrency 4]
                                        [--seed 0] [--json]

Builds (once, under ``--cache-dir``) a random Llama (hidden 512, 8 layers, like the throughput
bench) and N PEFT adapters (ranks 8/16/64 in turn, all seven projections) in a local object-store
directory. Serves them in-process (``create_app`` + ``serve_in_thread``) with ``--max-loras``
device slots, a host byte budget of about ``--host-adapters`` adapters, and a disk tier (a temp
directory) of about ``--disk-adapters`` adapters, so loads go L3 store -> L2 disk -> L1 host ->
L0 slot. Then:

1. drives a seeded Zipf(s) request stream over the adapters (closed loop, ``--concurrency``
   streams, token-id prompts, ``--max-tokens`` forced tokens) and records per request the
   client-side TTFT (time to the first content chunk), the ``x-loraplex-adapter-state`` header,
   and, for cold requests, whether the load was an L2 disk hit or an L3 fetch;
2. collects the cache's load stage timings (``load_observers``) and per-tier hit counters;
3. times a verified L2 read (``DiskTier.load_verified``: after the entry's first full
   verification, read + BLAKE3 of each file + tensor views) and the full host load (that plus
   ``build_adapter``) against reading the same files' raw bytes, warm page cache (median of
   ``--repeats``) and cold (pages dropped per file with ``posix_fadvise``), next to the target
   (L2 <= 2x raw), with ``sha256`` and BLAKE3 throughput on the same bytes as the floors.

The package: ``assets`` (model, adapters, request stream), ``drive`` (the client and the load
hooks), ``l2_vs_raw`` (step 3), ``experiment`` (one run, the results dict) and ``table`` (the
report); :func:`main` is the command line.
"""

from __future__ import annotations

import argparse
import json
import os

from loraplex.tools.bench.cache_live.assets import SHAPES
from loraplex.tools.bench.cache_live.experiment import run
from loraplex.tools.bench.cache_live.table import format_table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--cache-dir", default=os.path.expanduser("~/.cache/loraplex/bench-cache"),
        help="where the model and the adapter store are built once",
    )  # fmt: skip
    ap.add_argument("--shape", choices=sorted(SHAPES), default="h512")
    ap.add_argument("--adapters", type=int, default=48)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--zipf-s", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-loras", type=int, default=4)
    ap.add_argument("--host-adapters", type=float, default=8, help="L1 budget in mean adapters")
    ap.add_argument("--disk-adapters", type=float, default=24, help="L2 budget in mean adapters")
    ap.add_argument("--policy", default="hybrid")
    ap.add_argument(
        "--load-timeout", type=float, default=300.0,
        help="seconds a request may wait for room in host memory (the server's "
        "--adapter-load-timeout); long, so a slow machine queues instead of answering 503",
    )  # fmt: skip
    ap.add_argument("--threads", type=int, default=None, help="engine intra-op threads")
    ap.add_argument("--sample", type=int, default=6, help="disk entries timed for L2 vs raw")
    ap.add_argument("--repeats", type=int, default=7, help="warm-cache rounds (median kept)")
    ap.add_argument("--cold-repeats", type=int, default=3, help="cold-cache rounds (0: skip)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--records", action="store_true", help="include per-request records (JSON)")
    args = ap.parse_args(argv)
    res = run(args)
    print(json.dumps(res, indent=2) if args.json else format_table(res))
    return 0
