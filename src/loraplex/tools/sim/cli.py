"""``loraplex sim``: replay a trace or a built-in workload through the cache policies, side by side.

Examples::

    loraplex sim --workload zipf:s=1,n=256,requests=20000,rate=50 --slots 8 --policy lru,hybrid
    loraplex sim --workload hotburst --slots 8 --host-bytes 1GiB --policy lru,hybrid --json
    loraplex sim --trace requests.jsonl --slots 16 --host-bytes 8GiB --disk-bytes 64GiB
    loraplex sim --workload diurnal --slots 12 --policy lru,hybrid,hybrid-forecast

Prints per policy: L0/L1/L2 hit ratios, the hot set's L0 hit ratio, L0 thrash ratio, loads per
tier, object-store fetches and modeled load seconds, plus Belady's offline optimum and the A0
online reference on the same trace. For a workload with office windows (``diurnal``) it also
prints the cold-start rate (L0 misses / requests) overall and in the first ``--opening-minutes``
after each tenant's window opens, per policy and for Belady. No torch needed.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from collections import Counter

from loraplex.cache.policy import POLICIES, belady_hit_ratio, belady_hits
from loraplex.config.argtypes import byte_size, nonneg_float, positive_int
from loraplex.tools.sim.plot import MISSING, plot_hit_ratio
from loraplex.tools.sim.simulate import SimConfig, SimResult, a0_hit_ratio, policy_factory, simulate
from loraplex.tools.sim.workloads import (
    Request,
    Workload,
    WorkloadSpecError,
    generate_workload,
    read_trace,
    write_trace,
)

__all__ = ["build_parser", "main"]


def build_parser(prog: str = "loraplex sim") -> argparse.ArgumentParser:
    """The ``sim`` argument parser (the main CLI may embed it as a subcommand)."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Replay a request trace through the adapter cache tiers and eviction "
        "policies (the server's own policy code), with Belady's optimum as the limit.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", metavar="FILE", help="JSON-lines trace to replay")
    src.add_argument(
        "--workload",
        metavar="SPEC",
        help="built-in workload, e.g. zipf:s=1,n=256,requests=20000,rate=50 | "
        "hotburst | tiered:5x12%%,5x6%%,5x2%%,n=256 | uniform:n=64 "
        "(see loraplex.tools.sim.workloads for every key)",
    )
    p.add_argument(
        "--policy",
        default="lru,hybrid",
        help=f"comma-separated policies to compare (from: {', '.join(POLICIES)}); "
        "default: lru,hybrid",
    )
    p.add_argument("--slots", type=positive_int, default=8, help="L0 device slots (default 8)")
    p.add_argument("--host-bytes", type=byte_size, help="L1 host-memory budget, e.g. 2GiB")
    p.add_argument(
        "--host-count", type=positive_int, help="L1 entry limit (vLLM's --max-cpu-loras)"
    )
    p.add_argument("--disk-bytes", type=byte_size, help="L2 local-disk budget, e.g. 64GiB")
    p.add_argument(
        "--service-time",
        type=nonneg_float,
        default=0.0,
        help="seconds each request keeps its adapter in flight (default 0)",
    )
    p.add_argument(
        "--min-residency",
        type=nonneg_float,
        default=0.0,
        help="seconds a new entry cannot be evicted",
    )
    p.add_argument(
        "--thrash-window",
        type=nonneg_float,
        default=60.0,
        help="a reload within this many seconds of an eviction counts as thrash (default 60)",
    )
    p.add_argument(
        "--patience",
        type=nonneg_float,
        default=1.0,
        help="seconds a cold request may wait for a busy low-value slot rather than evict a "
        "more valuable idle adapter (policies that support it, i.e. hybrid; default 1, 0 = off)",
    )
    p.add_argument(
        "--hot-tenants",
        help="comma-separated tenants whose adapters form the hot set (default: the workload's "
        "own hot set, else the slots-1 most requested adapters)",
    )
    p.add_argument(
        "--opening-minutes",
        type=nonneg_float,
        default=10.0,
        help="with office windows (diurnal): the minutes after each window opens whose "
        "cold-start rate is reported apart (default 10)",
    )
    p.add_argument(
        "--prefetch-interval",
        type=nonneg_float,
        default=300.0,
        help="seconds between the load-ahead rounds of a forecasting policy (hybrid-forecast; "
        "default 300)",
    )
    p.add_argument("--write-trace", metavar="FILE", help="also write the trace as JSON lines")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also plot the L0 hit ratio over time per policy, with Belady's line (matplotlib)",
    )
    return p


def _hot_set(args: argparse.Namespace, wl: Workload) -> tuple[frozenset[str], str]:
    if args.hot_tenants:
        tenants = {t.strip() for t in args.hot_tenants.split(",") if t.strip()}
        hot = frozenset(r.adapter for r in wl.requests if r.tenant in tenants)
        if not hot:
            raise WorkloadSpecError(f"no request in the trace has tenant in {sorted(tenants)}")
        return hot, f"adapters of tenants {','.join(sorted(tenants))} ({len(hot)})"
    if wl.hot_adapters:
        return wl.hot_adapters, f"the workload's hot set ({len(wl.hot_adapters)} adapters)"
    k = max(args.slots - 1, 1)
    top = Counter(r.adapter for r in wl.requests).most_common(k)
    return frozenset(a for a, _ in top), f"the {k} most requested adapters"


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _fmt_waits(r: SimResult) -> str:
    if not r.waits:
        return "0"
    out = f"{r.waits} (mean {r.mean_wait_s * 1000:.1f} ms)"
    return out + (f", {r.unserved} unserved" if r.unserved else "")


def _table(
    wl: Workload,
    cfg: SimConfig,
    hot_desc: str,
    results: list[SimResult],
    belady: float,
    a0: float,
) -> str:
    names = cfg.tier_names
    tiers = [f"L0 {cfg.slots} slots"]
    if cfg.has_l1:
        parts = []
        if cfg.host_bytes:
            parts.append(_fmt_bytes(cfg.host_bytes))
        if cfg.host_count:
            parts.append(f"{cfg.host_count} entries")
        tiers.append("L1 " + " / ".join(parts))
    if cfg.disk_bytes:
        tiers.append(f"L2 {_fmt_bytes(cfg.disk_bytes)}")
    tiers.append("L3 object store")
    lines = [
        f"workload: {wl.spec} — {len(wl.requests)} requests, {wl.n_adapters} adapters, "
        f"{wl.duration:.1f} s",
        f"tiers: {' | '.join(tiers)}; service time {cfg.service_time_s:g} s, "
        f"min residency {cfg.min_residency_s:g} s, patience {cfg.patience_s:g} s",
        f"hot set: {hot_desc}",
        "",
    ]
    loads = "loads " + "/".join(names)
    head = ["policy", "L0 hit", "L1 hit", "L2 hit", "hot hit", "L0 thrash", loads, "remote"]
    head += ["load s", "waits"]
    rows = [head]
    for r in results:
        l1, l2 = r.tier("L1"), r.tier("L2")
        rows.append(
            [
                r.policy,
                _fmt_ratio(r.l0_hit_ratio),
                _fmt_ratio(l1.hit_ratio if l1 else None),
                _fmt_ratio(l2.hit_ratio if l2 else None),
                _fmt_ratio(r.hot_hit_ratio),
                f"{r.tiers[0].thrash_ratio:.2f}",
                "/".join(str(t.loads) for t in r.tiers),
                str(r.remote_fetches),
                f"{r.load_seconds:.1f}",
                _fmt_waits(r),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        cells = [row[0].ljust(widths[0])]
        cells += [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
    refs = [
        ("belady", belady, "offline optimum (L0, same trace)"),
        ("a0", a0, f"online reference: the {cfg.slots - 1} most requested adapters fixed + "
         "1 cycling slot"),
    ]  # fmt: skip
    for name, value, note in refs:
        lines.append(f"{name.ljust(widths[0])}  {_fmt_ratio(value).rjust(widths[1])}  {note}")
    return "\n".join(lines)


def opening_cold_rates(
    outcomes: list[tuple[Request, bool]],
    windows: dict[str, list[tuple[float, float]]],
    minutes: float,
) -> tuple[float, float, int]:
    """(cold-start rate overall, cold-start rate in the first ``minutes`` after each window
    opening of the request's tenant, requests in those minutes); openings before trace time 0
    (windows already open when the trace starts) do not count."""
    span = minutes * 60.0
    opens = {t: sorted(lo for lo, _ in w if lo >= 0) for t, w in windows.items()}
    cold = n_open = cold_open = 0
    for req, hit in outcomes:
        cold += not hit
        starts = opens.get(req.tenant)
        if not starts:
            continue
        i = bisect.bisect_right(starts, req.time) - 1
        if i >= 0 and req.time < starts[i] + span:
            n_open += 1
            cold_open += not hit
    total = len(outcomes)
    return (cold / total if total else 0.0, cold_open / n_open if n_open else 0.0, n_open)


def _opening_table(rows: list[tuple[str, float, float, str]], minutes: float, n: int) -> str:
    head = ("policy", "cold-start rate", f"cold at opening (first {minutes:g} min)", "prefetches")
    cells = [head] + [(a, f"{b:.3f}", f"{c:.3f}", d) for a, b, c, d in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(4)]
    out = [f"window openings: {n} requests in the first {minutes:g} min after an opening"]
    for r in cells:
        out.append(
            "  ".join(
                [r[0].ljust(widths[0])]
                + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]
            )
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Run the simulator; 0 on success, 2 on bad input (the message goes to stderr)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse has printed the usage and the problem
        return int(e.code) if isinstance(e.code, int) else 2

    def fail(msg: str) -> int:
        print(f"loraplex sim: error: {msg}", file=sys.stderr)
        return 2

    names = [n.strip().lower() for n in args.policy.split(",") if n.strip()]
    if not names:
        return fail("--policy names no policy")
    try:
        cfg = SimConfig(
            slots=args.slots,
            host_bytes=args.host_bytes,
            host_count=args.host_count,
            disk_bytes=args.disk_bytes,
            service_time_s=args.service_time,
            min_residency_s=args.min_residency,
            thrash_window_s=args.thrash_window,
            patience_s=args.patience,
            prefetch_interval_s=args.prefetch_interval or 300.0,
        )
        for n in names:
            policy_factory(n, cfg.tier_names)  # unknown names fail before any work
        if args.trace:
            reqs = read_trace(args.trace)
            wl = Workload(spec=args.trace, requests=reqs)
        else:
            wl = generate_workload(args.workload)
        if not wl.requests:
            return fail("the trace has no requests")
        factories = [policy_factory(n, cfg.tier_names, epoch_s=wl.epoch_s) for n in names]
        hot, hot_desc = _hot_set(args, wl)
        if args.write_trace:
            try:
                write_trace(args.write_trace, wl.requests)
            except OSError as e:
                return fail(f"cannot write trace {args.write_trace}: {e.strerror or e}")
    except (ValueError, WorkloadSpecError) as e:
        return fail(str(e))

    if args.plot:
        try:
            import matplotlib  # noqa: F401  (checked before the run, not after)
        except ImportError:
            return fail(MISSING)
    timelines: dict[str, list[tuple[float, bool]]] = {}
    results = []
    openings: list[tuple[str, float, float, str]] = []
    n_open = 0
    for f in factories:
        timeline: list[tuple[float, bool]] = []
        outcomes: list[tuple[Request, bool]] | None = [] if wl.windows else None
        res = simulate(wl.requests, f, cfg, hot_adapters=hot, timeline=timeline, outcomes=outcomes)
        results.append(res)
        timelines[res.policy] = timeline
        if outcomes is not None and wl.windows:
            cold, at_open, n_open = opening_cold_rates(outcomes, wl.windows, args.opening_minutes)
            openings.append((res.policy, cold, at_open, str(res.prefetches)))
    keys = [r.adapter for r in wl.requests]
    belady = belady_hit_ratio(keys, cfg.slots)  # exact for a count capacity
    if wl.windows:
        opt = list(zip(wl.requests, belady_hits(keys, cfg.slots), strict=True))
        cold, at_open, n_open = opening_cold_rates(opt, wl.windows, args.opening_minutes)
        openings.append(("belady", cold, at_open, "-"))
    if args.plot:
        hits = belady_hits(keys, cfg.slots)
        line = [(r.time, bool(h)) for r, h in zip(wl.requests, hits, strict=True)]
        try:
            plot_hit_ratio(args.plot, timelines, line, title=f"L0 hit ratio, {wl.spec}")
        except OSError as e:
            return fail(f"cannot write plot {args.plot}: {e.strerror or e}")
    a0 = a0_hit_ratio(keys, cfg.slots)
    if args.json:
        out = {
            "workload": {
                "spec": wl.spec,
                "requests": len(wl.requests),
                "adapters": wl.n_adapters,
                "duration_s": wl.duration,
            },
            "config": {
                "slots": cfg.slots,
                "host_bytes": cfg.host_bytes,
                "host_count": cfg.host_count,
                "disk_bytes": cfg.disk_bytes,
                "service_time_s": cfg.service_time_s,
                "min_residency_s": cfg.min_residency_s,
                "thrash_window_s": cfg.thrash_window_s,
                "patience_s": cfg.patience_s,
            },
            "hot_set": hot_desc,
            "belady_l0_hit_ratio": belady,
            "a0_l0_hit_ratio": a0,
            "results": [r.to_dict() for r in results],
        }
        if openings:
            out["openings"] = {
                "minutes": args.opening_minutes,
                "requests": n_open,
                "cold_start_rate": {name: (c, o) for name, c, o, _ in openings},
            }
        print(json.dumps(out, indent=2))
    else:
        print(_table(wl, cfg, hot_desc, results, belady, a0))
        if openings:
            print()
            print(_opening_table(openings, args.opening_minutes, n_open))
    return 0
