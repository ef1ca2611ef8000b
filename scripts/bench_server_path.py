"""What the server path costs: offline ``LLM.generate`` vs ``loraplex serve`` + ``loraplex bench
serve`` on the same prompts, adapters and engine settings, side by side in one run.

    python scripts/bench_server_path.py [--model tiny|smollm2|bench|DIR] [--requests 128]
        [--concurrency 64] [--prompt-len 64] [--output-len 32] [--repeats 2] [--dtype float32]
        [--profile-server FILE.txt]

Not run by CI. The prompts are ``loraplex bench serve``'s own (token ids from its seeded
schedule, ``uniform:n=16`` over 16 distinct rank-8 q/v adapters a00..a15, ``ignore_eos``, a
fixed output length), rebuilt here with the same functions so both paths run the very same
requests. Offline, every prompt goes to one ``LLM.generate`` call (each with its adapter's
``LoRARequest``); served, ``loraplex bench serve --concurrency N`` streams them at a
``loraplex serve`` subprocess started with the same model, dtype, slots, ``max_num_seqs`` and
threads. Rounds alternate (offline, served, offline, served, ...) after one untimed warm-up of
each; each side keeps its best round. Printed per round: output tok/s, the load average, and
the CPU seconds of the server process and of the client process (the client shares the
machine's cores, which the offline run does not pay for).

``--profile-server FILE`` runs the server under ``py-spy record --format raw`` (all threads,
GIL-holding samples only with ``--gil``) for the timed served rounds, so the engine thread's
share of time spent in the HTTP side shows up next to the step.

Models: ``tiny`` (the tests' random 2-layer Llama with a tokenizer: Python overhead decides its
step, so the server's share is at its largest), ``smollm2`` (the demo model, converted by
``loraplex demo`` under $LORAPLEX_CACHE_DIR), ``bench`` (the 8-layer 512-wide benchmark model;
no tokenizer, so the server runs with ``--skip-tokenizer-init``), or a model directory.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src"
RANK = 8
N_ADAPTERS = 16


# -- assets ----------------------------------------------------------------------------------------
def model_dir(kind: str, work: Path) -> tuple[Path, bool]:
    """(model directory, has a tokenizer)."""
    if kind == "tiny":
        from loraplex.testing import make_random_model

        d = work / "tiny-model"
        if not (d / "config.json").is_file():
            make_random_model(d, hidden_size=64, num_layers=2, seed=0)
        return d, True
    if kind == "smollm2":
        from loraplex.tools.demo import prepare_demo_model

        cache = os.environ.get("LORAPLEX_CACHE_DIR")
        return prepare_demo_model(Path(cache) if cache else None, progress=True), True
    if kind == "bench":
        from loraplex.tools.bench import throughput as tp

        root = Path(os.path.expanduser("~/.cache/loraplex/bench-h512"))
        m, _ = tp.build_assets(root)
        return m, False
    d = Path(kind)
    return d, (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file()


def make_adapters(model: Path, root: Path) -> list[Path]:
    """16 rank-8 q/v adapters: the first 16 of ``compare_peers``' seeded set."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from compare_peers import make_adapters as peers_adapters

    return peers_adapters(model, root, N_ADAPTERS)


def bench_argv(url: str, args: Any, save: Path) -> list[str]:
    """``loraplex bench serve``'s command line for this run (the served side's client)."""
    argv = [
        "serve", "--url", url, "--workload", f"uniform:n={N_ADAPTERS}",
        "--concurrency", str(args.concurrency), "--num-requests", str(args.requests),
        "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len),
        "--seed", str(args.seed), "--prompt-kind", "tokens", "--token-range", args.token_range,
        "--no-progress", "--save", str(save), "--timeout", "900",
    ]  # fmt: skip
    for i in range(N_ADAPTERS):
        argv += ["--model", f"a{i:02d}"]
    return argv


def same_requests(args: Any) -> list[Any]:
    """The requests ``bench_argv`` makes ``loraplex bench serve`` send, rebuilt with its own
    functions (closed loop: the trace's order)."""
    from loraplex.tools.bench.serve import LengthDist, build_requests
    from loraplex.tools.sim.workloads import WORKLOAD_KINDS, parse_workload_spec

    spec = f"uniform:n={N_ADAPTERS}"
    kind, params = parse_workload_spec(spec)
    params["requests"] = args.requests
    params.setdefault("seed", args.seed)
    trace = WORKLOAD_KINDS[kind](spec=spec, **params).requests
    lo, _, hi = args.token_range.partition(":")
    return build_requests(
        trace,
        [f"a{i:02d}" for i in range(N_ADAPTERS)],
        prompt_len=LengthDist.parse(str(args.prompt_len)),
        output_len=LengthDist.parse(str(args.output_len)),
        arrivals="trace",
        seed=args.seed,
        prompt_kind="tokens",
        token_range=(int(lo), int(hi)),
    )


# -- the two sides ---------------------------------------------------------------------------------
def engine_options(args: Any, has_tok: bool) -> dict[str, Any]:
    return {
        "dtype": args.dtype,
        "enable_lora": True,
        "max_loras": N_ADAPTERS,
        "max_cpu_loras": N_ADAPTERS,
        "max_lora_rank": RANK,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": 512,
        "kv_cache_memory_bytes": 1 << 30,
        "num_threads": args.threads,
        "skip_tokenizer_init": not has_tok,
    }


def server_cmd(model: Path, adapters: list[Path], port: int, args: Any, has_tok: bool) -> list[str]:
    cmd = [
        sys.executable, "-m", "loraplex.cli", "serve", str(model), "--served-model-name", "base",
        "--enable-lora", "--max-loras", str(N_ADAPTERS), "--max-cpu-loras", str(N_ADAPTERS),
        "--max-lora-rank", str(RANK), "--dtype", args.dtype,
        "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "512",
        "--kv-cache-memory", "1GiB", "--num-threads", str(args.threads),
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
        "--lora-modules", *[f"a{i:02d}={p}" for i, p in enumerate(adapters)],
    ]  # fmt: skip
    if not has_tok:
        cmd.append("--skip-tokenizer-init")
    return cmd


def run_offline(llm: Any, reqs: list[Any], adapters: list[Path]) -> tuple[float, float]:
    """(output tok/s, CPU seconds) of one ``LLM.generate`` over every request."""
    from loraplex.requests import LoRARequest, SamplingParams

    names = {f"a{i:02d}": (i, p) for i, p in enumerate(adapters)}
    loras = [LoRARequest(r.model, names[r.model][0] + 1, str(names[r.model][1])) for r in reqs]
    params = [
        SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in reqs
    ]
    c0, t0 = time.process_time(), time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params, loras)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    n = sum(len(o.token_ids) for r in outs for o in r.outputs)
    assert n == sum(r.max_tokens for r in reqs), (n, "output tokens: ignore_eos not honoured?")
    return n / wall, cpu


def run_served(url: str, args: Any, save: Path) -> tuple[dict[str, Any], float]:
    """(``loraplex bench serve``'s summary, its CPU seconds), the client in its own process."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    cmd = [sys.executable, "-m", "loraplex.cli", "bench", *bench_argv(url, args, save)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    _, status, ru = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"loraplex bench serve exited {proc.returncode}")
    s = json.loads(save.read_text())["summary"]
    if s["completed"] != args.requests:
        raise RuntimeError(f"bench serve: {s['completed']} of {args.requests} completed")
    return s, ru.ru_utime + ru.ru_stime


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a running process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny | smollm2 | bench | a model directory")
    ap.add_argument("--work-dir", default="/tmp/loraplex-server-path")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--prompt-len", default="64")
    ap.add_argument("--output-len", default="32")
    ap.add_argument("--token-range", default="100:300")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2, help="timed rounds per side (best kept)")
    ap.add_argument(
        "--server-src",
        help="serve from this src dir (e.g. a snapshot of older code; default: ours)",
    )
    ap.add_argument("--profile-server", metavar="FILE", help="py-spy raw profile of the server")
    ap.add_argument("--gil", action="store_true", help="py-spy: only samples holding the GIL")
    args = ap.parse_args(argv)
    # a SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the server subprocess is stopped
    signal.signal(signal.SIGTERM, _interrupt)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)

    import torch

    from loraplex.entrypoints.llm import LLM
    from loraplex.testing.server import free_port
    from loraplex.testing.sync import wait_healthy

    torch.set_num_threads(args.threads)
    model, has_tok = model_dir(args.model, work)
    adapters = make_adapters(model, work / f"adapters-{model.name}")
    reqs = same_requests(args)
    print(f"model {model} ({args.dtype}), {N_ADAPTERS} rank-{RANK} q/v adapters, "
          f"{len(reqs)} requests ({args.prompt_len} in / {args.output_len} out, ignore_eos), "
          f"concurrency {args.concurrency}, max_num_seqs {args.max_num_seqs}, "
          f"{args.threads} threads", flush=True)  # fmt: skip

    llm = LLM(str(model), **engine_options(args, has_tok))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (work / "server.log").open("w")
    src = Path(args.server_src).resolve() if args.server_src else SRC
    env = {**os.environ, "PYTHONPATH": str(src), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(server_cmd(model, adapters, port, args, has_tok), env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    spy: subprocess.Popen | None = None
    rows: list[tuple[str, float, str, str]] = []
    best = {"offline": 0.0, "served": 0.0}
    try:
        wait_healthy(proc, url, timeout=600)
        run_offline(llm, reqs, adapters)  # warm-up: adapters loaded, code paths warm
        run_served(url, args, work / "warmup.json")
        if args.profile_server:
            spy_cmd = [str(Path(sys.executable).with_name("py-spy")), "record", "--format", "raw", "--threads", "--rate", "200",
                       "-o", args.profile_server, "--pid", str(proc.pid)]  # fmt: skip
            if args.gil:
                spy_cmd.append("--gil")
            spy = subprocess.Popen(spy_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for rep in range(args.repeats):
            la = load()
            tps, cpu = run_offline(llm, reqs, adapters)
            rows.append(("offline LLM.generate", tps, f"{cpu:.1f}", la))
            best["offline"] = max(best["offline"], tps)
            la = load()
            c0 = proc_cpu(proc.pid)
            s, client_cpu = run_served(url, args, work / f"served-{rep}.json")
            server_cpu = proc_cpu(proc.pid) - c0
            tps = s["output_tokens_per_s"]
            rows.append(("served (bench serve)", tps, f"{server_cpu:.1f} + client {client_cpu:.1f}",
                         la))  # fmt: skip
            best["served"] = max(best["served"], tps)
            print(f"round {rep + 1}: offline {rows[-2][1]:.1f} tok/s, served {tps:.1f} tok/s "
                  f"(TTFT p50 {s['ttft_s']['p50'] * 1000:.0f} ms, TPOT p50 "
                  f"{s['tpot_s']['p50'] * 1000:.1f} ms)", flush=True)  # fmt: skip
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(60)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        log.close()
    print(f"\n{'round':<24}{'output tok/s':>14}  {'CPU s':<22}{'load avg':>9}")
    for name, tps, cpu, la in rows:
        print(f"{name:<24}{tps:>14.1f}  {cpu:<22}{la:>9}")
    ratio = best["served"] / best["offline"]
    print(f"\nbest: offline {best['offline']:.1f} tok/s, served {best['served']:.1f} tok/s, "
          f"served / offline = {ratio:.3f} (target >= 0.9)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(SRC))
    sys.exit(main())
