"""What a load-generator run amounts to: the summary (throughput, TTFT/TPOT percentiles overall
and by warm/cold state, adapter rank and replica, errors), its JSON, the end-of-run table and a
TTFT CDF plot."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from loraplex.tools.bench.common import percentile
from loraplex.tools.bench.serve.client import BenchResult, RequestRecord
from loraplex.tools.bench.serve.mixed import jain_index


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
    by_tenant: dict[str, list[RequestRecord]] = {}
    by_class: dict[str, list[RequestRecord]] = {}
    for r in recs:
        if r.tenant:
            by_tenant.setdefault(r.tenant, []).append(r)
            by_class.setdefault(r.slo_class or r.tenant, []).append(r)
    # token shares over the send window (every tenant still sending): requests that completed
    # within it; the drain after it favours whoever had the most in flight
    window = result.meta.get("window_s")
    tokens = {
        t: sum(
            r.output_tokens
            for r in v
            if r.ok and (window is None or r.sent + (r.e2e or 0.0) <= window)
        )
        for t, v in sorted(by_tenant.items())
    }
    total = sum(tokens.values())
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
        "by_tenant": {k: _group(v, dur) for k, v in sorted(by_tenant.items())},
        "by_class": {k: _group(v, dur) for k, v in sorted(by_class.items())},
        "token_shares": {t: n / total for t, n in tokens.items()} if total else {},
        "jain_index": jain_index(list(tokens.values())) if len(tokens) > 1 else None,
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
    for k, g in s.get("by_tenant", {}).items():
        lines.append(row(f"tenant {k}"[:14], g))
    if set(s.get("by_class", {})) != set(s.get("by_tenant", {})):
        for k, g in s["by_class"].items():
            lines.append(row(f"class {k}"[:14], g))
    if s.get("token_shares"):
        shares = ", ".join(f"{t} {x:.3f}" for t, x in s["token_shares"].items())
        jain = s.get("jain_index")
        within = "" if s["meta"].get("window_s") is None else (
            f" (requests done within the {s['meta']['window_s']:g} s send window)"
        )  # fmt: skip
        lines.append(f"output token shares{within}: {shares}"
                     + (f"; Jain's index {jain:.3f}" if jain else ""))  # fmt: skip
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
