"""The benchmark's report: the results dict as text tables (TTFT by warm/cold and L2/L3 source,
tier hits, load stages, L2 vs raw reads)."""

from __future__ import annotations

from typing import Any


def _ms(x: float) -> str:
    return "-" if x != x else f"{x * 1e3:.1f}"  # NaN -> "-"


def format_table(res: dict[str, Any]) -> str:
    c = res["config"]
    mib = 2**20
    lines = [
        f"model {c['shape']}, float32, {c['threads'] or 'default'} threads; "
        f"{c['adapters']} adapters (ranks {'/'.join(map(str, c['ranks']))}, all 7 projections, "
        f"{c['store_bytes'] / mib:.0f} MiB in the local store)",
        f"tiers: L0 {c['max_loras']} slots | L1 {c['host_budget_bytes'] / mib:.0f} MiB "
        f"(~{c['host_adapters']:g} adapters) | L2 {c['disk_budget_bytes'] / mib:.0f} MiB "
        f"(~{c['disk_adapters']:g} adapters) | L3 local dir; policy {c['policy']}",
        f"stream: Zipf s={c['zipf_s']:g}, seed {c['seed']}, {c['requests']} requests, closed loop "
        f"x{c['concurrency']}, {c['max_tokens']} tokens each; start-up (all adapters registered "
        f"and loaded once) {res['startup_s']:.1f} s, run {res['wall_s']:.1f} s, "
        f"{res['n_errors']} errors",
        "",
        f"{'TTFT (ms)':<14}{'requests':>9}{'p50':>9}{'p99':>9}{'mean':>9}{'headers p50':>13}",
    ]
    for k, s in res["ttft_s"].items():
        h = res["headers_s"][k]["p50"]
        lines.append(
            f"{k:<14}{s['n']:>9}{_ms(s['p50']):>9}{_ms(s['p99']):>9}{_ms(s['mean']):>9}{_ms(h):>13}"
        )
    lines.append("(headers: sent once the adapter's host copy is ready, before scheduling)")
    for err in res["errors"]:
        lines.append(f"error: {err}")
    if res["cold_unattributed"]:
        lines.append(f"(cold requests with no L2/L3 load seen: {res['cold_unattributed']})")
    lines += ["", f"{'tier':<8}{'lookups':>9}{'hits':>7}{'hit ratio':>11}{'evictions':>11}"]
    names = {"device": "L0 slot", "host": "L1 host", "disk": "L2 disk"}
    for tier, d in res["tiers"].items():
        looked = d["hits"] + d["misses"]
        hr = "-" if looked == 0 else f"{d['hit_ratio']:.3f}"
        lines.append(
            f"{names.get(tier, tier):<8}{looked:>9}{d['hits']:>7}{hr:>11}{d['evictions']:>11}"
        )
    st = res["stats"]
    lines.append(
        f"L3 fetches {st['remote_loads']}, L2 reads {st['disk_hits']}, cold requests "
        f"{st['cold_requests']}, capacity waits {st['capacity_waits']}, "
        f"slot waits {st['slot_waits']}"
    )
    lines += [
        "",
        f"{'load stage (ms)':<17}{'n':>6}{'p50':>9}{'p99':>9}{'mean':>9}{'total':>10}",
    ]
    for stage, s in res["stages_s"].items():
        if s["n"]:
            lines.append(
                f"{stage:<17}{s['n']:>6}{_ms(s['p50']):>9}{_ms(s['p99']):>9}"
                f"{_ms(s['mean']):>9}{_ms(s['total']):>10}"
            )
    lines.append("(resolve: a request's whole wait for a host copy, load or shared load)")
    lv = res["l2_vs_raw"]
    if lv:
        w = lv["warm_median_s"]
        lines += [
            "",
            f"L2 load vs raw read of the same bytes: {lv['adapters']} disk entries, "
            f"{lv['bytes'] / mib:.1f} MiB, warm page cache, median of {lv['repeats']}",
            f"{'rank':<6}{'MiB':>7}{'raw':>9}{'read+parse':>12}{'L2 verified':>13}"
            f"{'+build':>9}{'+build 1t':>11}{'L2/raw':>8}   (ms)",
        ]
        rows = [(r, row) for r, row in lv["by_rank_warm_median_s"].items()]
        rows.append(("all", {**w, "bytes": lv["bytes"]}))
        for r, row in rows:
            lines.append(
                f"{r:<6}{row['bytes'] / mib:>7.1f}{_ms(row['raw']):>9}"
                f"{_ms(row['read_parse']):>12}{_ms(row['l2']):>13}{_ms(row['host']):>9}"
                f"{_ms(row['host_1t']):>11}{row['l2'] / row['raw']:>8.2f}"
            )
        target = lv["target_ratio_l2_raw"]
        met = "met" if lv["ratio_l2_raw"] <= target else "NOT met"
        lines += [
            f"L2 verified / raw = {lv['ratio_l2_raw']:.2f}x (best-of: "
            f"{lv['ratio_l2_raw_best']:.2f}x, median per round: {lv['ratio_l2_raw_rounds']:.2f}x; "
            f"target <= {target:g}x: {met}); host load "
            f"(+build_adapter) / raw = {lv['ratio_host_raw']:.2f}x with {lv['torch_threads']} "
            f"torch threads, {lv['ratio_host_1t_raw']:.2f}x with 1",
            f"raw read {lv['raw_MBps']:.0f} MB/s (page cache); on the same bytes in memory sha256 "
            f"{lv['sha256_MBps']:.0f} MB/s (first, full verification); blake3 "
            f"{lv['blake3_MBps']:.0f} MB/s 1 thread (later L2 reads), "
            f"{lv['blake3_auto_MBps']:.0f} MB/s max_threads=AUTO",
            f"floor of a verified read (read then hash / perfectly overlapped): sha256 "
            f"{lv['floor_ratio_serial']:.2f}x / {lv['floor_ratio_overlapped']:.2f}x raw, "
            f"blake3 {lv['blake3_floor_ratio_serial']:.2f}x / "
            f"{lv['blake3_floor_ratio_overlapped']:.2f}x raw",
        ]
        if "cold_median_s" in lv:
            cm = lv["cold_median_s"]
            lines.append(
                f"cold page cache (posix_fadvise DONTNEED per file, median of "
                f"{lv['cold_repeats']}): raw {_ms(cm['raw'])} ms ({lv['cold_raw_MBps']:.0f} MB/s), "
                f"L2 verified {_ms(cm['l2'])} ms -> {lv['cold_ratio_l2_raw']:.2f}x, +build "
                f"{lv['cold_ratio_host_raw']:.2f}x"
            )
    return "\n".join(lines)
