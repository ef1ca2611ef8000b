"""Summary of scripts/bench_slo.sh's rounds: per round and policy, gold TTFT p99 alone and with
batch (and their ratio, the issue's <= 1.25x target), batch requests / completed / output
tokens, and the two-tenant flood's Jain index (>= 0.95 under fair)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(out: Path) -> None:
    head = ("round", "policy", "gold p99 alone ms", "gold p99 +batch ms", "ratio",
            "batch done/sent", "batch tokens", "batch TPOT p50 ms", "flood Jain")  # fmt: skip
    print(" | ".join(head))
    for rnd in sorted(out.glob("round*/"), key=lambda p: int(p.name[5:])):
        for policy in ("fcfs", "fair"):
            try:
                alone, mixed = (
                    json.loads((rnd / f"{policy}-{w}.json").read_text())["summary"]
                    for w in ("gold-alone", "gold-batch")
                )
                fp = rnd / f"{policy}-flood.json"
                flood = json.loads(fp.read_text())["summary"] if fp.exists() else None
            except FileNotFoundError:
                continue
            a = alone["by_tenant"]["gold"]["ttft_s"]["p99"] * 1e3
            m = mixed["by_tenant"]["gold"]["ttft_s"]["p99"] * 1e3
            b = mixed["by_tenant"]["batch"]
            row = (rnd.name[5:], policy, f"{a:.0f}", f"{m:.0f}", f"{m / a:.2f}",
                   f"{b['completed']}/{b['requests']}", str(b["output_tokens"]),
                   f"{b['tpot_s']['p50'] * 1e3:.1f}", f"{flood['jain_index']:.3f}" if flood else "-")  # fmt: skip
            print(" | ".join(row))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/bench_slo"))
