"""``loraplex bench SUBCOMMAND``: benchmarks against running servers (no torch).

    loraplex bench serve --url http://127.0.0.1:8000 --adapters-from-server \\
        --workload zipf:s=1,n=64 --concurrency 8 --num-requests 200 --output-len 32 --plot ttft.png

``serve`` is an OpenAI-API load generator for any compatible server (loraplex, vLLM, a router);
the library behind it is ``loraplex.tools.bench.serve``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any

from loraplex.config import ENV_API_KEYS, env_value
from loraplex.tools.bench.serve import (
    BenchError,
    LengthDist,
    TenantStream,
    build_requests,
    fetch_models,
    plot_ttft_cdf,
    render_summary,
    result_json,
    run_load,
    run_mixed,
)
from loraplex.tools.sim.workloads import (
    WORKLOAD_KINDS,
    WorkloadSpecError,
    parse_workload_spec,
    read_trace,
)

__all__ = ["build_parser", "main"]


def _length(text: str) -> LengthDist:
    try:
        return LengthDist.parse(text)
    except BenchError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (v > 0 and math.isfinite(v)):
            raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
        return v

    return parse


def _range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        r = (int(lo), int(hi))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI token ids, got {text!r}") from None
    if not sep or not 0 <= r[0] < r[1]:
        raise argparse.ArgumentTypeError(f"expected LO:HI with 0 <= LO < HI, got {text!r}")
    return r


def _add_serve(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="load generator against an OpenAI-compatible server",
        description="Stream a seeded workload at an OpenAI-compatible server and report "
        "throughput, TTFT/TPOT percentiles (by warm/cold adapter and rank when the server says) "
        "and errors.",
        allow_abbrev=False,
    )
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--api-key",
        default=env_value(ENV_API_KEYS[0]) or os.environ.get("OPENAI_API_KEY"),
        help="bearer key (default: $LORAPLEX_API_KEY or $OPENAI_API_KEY)",
    )
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument(
        "--model", action="append", metavar="NAME", help="model/adapter name (repeatable)"
    )
    who.add_argument(
        "--adapters-from-server",
        action="store_true",
        help="every adapter the server lists in /v1/models (entries with a parent)",
    )
    who.add_argument(
        "--tenant",
        action="append",
        metavar="SPEC",
        help="a multi-tenant mix, one flag per tenant: TENANT:models=NAME[+NAME|PATTERN],"
        "rate=R|concurrency=N[,prompt=N,output=N,priority=P,class=LABEL,start=S] (needs "
        "--duration; reports TTFT per tenant and class, token shares and Jain's index)",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--workload",
        default="uniform:n=16",
        metavar="SPEC",
        help=f"simulator workload ({', '.join(WORKLOAD_KINDS)}), e.g. zipf:s=1,n=64; its i-th "
        "most requested adapter goes to the i-th model name (wrapping around); default "
        "uniform:n=16",
    )
    src.add_argument("--trace", metavar="FILE.jsonl", help="a JSON-lines trace (loraplex sim's)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=_positive(float), help="open loop: mean requests/s")
    load.add_argument(
        "--concurrency", type=_positive(int), help="closed loop: this many requests in flight"
    )
    p.add_argument(
        "--arrivals",
        choices=["poisson", "gamma", "trace"],
        default="poisson",
        help="open-loop send times: poisson / gamma gaps at --rate, or the workload's own times "
        "(rescaled to --rate if given; without --rate as they are)",
    )
    p.add_argument("--cv", type=_positive(float), default=2.0, help="gamma gaps' cv (default 2)")
    p.add_argument("--prompt-len", type=_length, default=LengthDist(64, 64), metavar="N|LO:HI")
    p.add_argument("--output-len", type=_length, default=LengthDist(32, 32), metavar="N|LO:HI")
    p.add_argument(
        "--num-requests",
        type=_positive(int),
        help="requests to send (default 200, or what --duration needs)",
    )
    p.add_argument("--duration", type=_positive(float), help="stop sending after this many s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument(
        "--prompt-kind",
        choices=["tokens", "text"],
        help="tokens: random token ids in --token-range (exact lengths; completions only); "
        "text: random common words (default for chat)",
    )
    p.add_argument("--token-range", type=_range, default=(100, 300), metavar="LO:HI")
    p.add_argument("--timeout", type=_positive(float), default=600.0, help="per request, s")
    p.add_argument("--json", action="store_true", help="print the summary and records as JSON")
    p.add_argument("--save", metavar="FILE.json", help="also write the JSON to this file")
    p.add_argument("--plot", metavar="FILE.png", help="TTFT CDF, warm vs cold (matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex bench", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="bench", required=True, metavar="{serve}")
    _add_serve(sub)
    return parser


def _names(args: argparse.Namespace) -> list[str]:
    """The model names to load, checked against /v1/models when the server lists them."""
    if args.adapters_from_server:
        models = fetch_models(args.url, args.api_key)
        names = [str(m["id"]) for m in models if isinstance(m, dict) and m.get("parent")]
        if not names:
            raise BenchError(f"{args.url}/v1/models lists no adapters (no entry has a parent)")
        return names
    names = list(dict.fromkeys(args.model))
    try:
        listed = {str(m.get("id")) for m in fetch_models(args.url, args.api_key)}
    except BenchError as e:
        raise BenchError(f"{e} (needed to check the --model names)") from None
    unknown = [n for n in names if n not in listed]
    if unknown:
        raise BenchError(
            f"the server does not serve {', '.join(unknown)}; it lists {', '.join(sorted(listed))}"
        )
    return names


def _trace(args: argparse.Namespace) -> list:
    n = args.num_requests
    if n is None:
        if args.duration is not None and args.rate is not None and args.arrivals != "trace":
            n = int(args.rate * args.duration * 1.25) + 16
        elif args.duration is not None:
            n = 20000
        else:
            n = 200
    if args.trace:
        trace = read_trace(args.trace)
        if not trace:
            raise BenchError(f"trace {args.trace} has no requests")
        return trace[:n]
    kind, params = parse_workload_spec(args.workload)
    params["requests"] = n
    params.setdefault("seed", args.seed)
    return WORKLOAD_KINDS[kind](spec=args.workload, **params).requests


def cmd_mixed(args: argparse.Namespace) -> int:
    """``bench serve --tenant ...``: every tenant's stream at once for ``--duration`` s."""
    if args.duration is None:
        raise BenchError("--tenant needs --duration (how long every tenant sends)")
    if args.rate is not None or args.concurrency is not None:
        raise BenchError("with --tenant, give rate= or concurrency= in each tenant's spec")
    if args.endpoint != "completions":
        raise BenchError("--tenant sends token prompts: use --endpoint completions")
    streams = [TenantStream.parse(t) for t in args.tenant]
    if len({s.tenant for s in streams}) != len(streams):
        raise BenchError("a tenant is named twice")
    served = [str(m.get("id")) for m in fetch_models(args.url, args.api_key)]
    streams = [s.resolve(served) for s in streams]
    result = run_mixed(
        args.url,
        streams,
        duration=args.duration,
        api_key=args.api_key,
        timeout=args.timeout,
        seed=args.seed,
        token_range=args.token_range,
    )
    result.meta |= {
        "tenants": args.tenant,
        "duration": args.duration,
        "seed": args.seed,
        "num_requests": len(result.records),
    }
    doc = result_json(result)
    if args.save:
        with open(args.save, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
    if args.plot:
        plot_ttft_cdf(result, args.plot, title="TTFT, tenant mix")
    print(json.dumps(doc, indent=1) if args.json else render_summary(doc["summary"]))
    return 0 if doc["summary"]["completed"] else 1


def cmd_serve(args: argparse.Namespace) -> int:
    if args.tenant:
        return cmd_mixed(args)
    if args.prompt_kind == "tokens" and args.endpoint == "chat":
        raise BenchError("--prompt-kind tokens needs --endpoint completions (chat takes text)")
    if args.concurrency is not None and args.arrivals != "poisson":
        raise BenchError("--arrivals applies to the open loop (--rate), not --concurrency")
    if args.concurrency is None and args.rate is None and args.arrivals != "trace":
        raise BenchError("give --rate (open loop), --concurrency (closed loop) or --arrivals trace")
    kind = args.prompt_kind or ("text" if args.endpoint == "chat" else "tokens")
    names = _names(args)
    trace = _trace(args)
    arrivals = "trace" if args.concurrency is not None else args.arrivals
    requests = build_requests(
        trace,
        names,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        rate=args.rate,
        arrivals=arrivals,
        cv=args.cv,
        seed=args.seed,
        prompt_kind=kind,
        token_range=args.token_range,
    )
    n_ids = len({r.adapter for r in trace})
    if n_ids > len(names):
        print(
            f"loraplex bench: note: the workload has {n_ids} adapters, mapped onto "
            f"{len(names)} model names (wrapping around)",
            file=sys.stderr,
        )
    result = run_load(
        args.url,
        requests,
        concurrency=args.concurrency,
        api_key=args.api_key,
        endpoint=args.endpoint,
        duration=args.duration,
        timeout=args.timeout,
        progress=not args.no_progress,
    )
    if args.concurrency is None:
        result.mode = f"{arrivals} arrivals" + (f" at {args.rate:g} req/s" if args.rate else "")
    result.meta = {
        "workload": args.trace or args.workload,
        "models": names,
        "prompt_len": str(args.prompt_len),
        "output_len": str(args.output_len),
        "prompt_kind": kind,
        "seed": args.seed,
        "num_requests": len(requests),
    }
    doc = result_json(result)
    if args.save:
        with open(args.save, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
    if args.plot:
        plot_ttft_cdf(result, args.plot, title=f"TTFT, {doc['summary']['meta']['workload']}")
    print(json.dumps(doc, indent=1) if args.json else render_summary(doc["summary"]))
    return 0 if doc["summary"]["completed"] else 1


def main(argv: list[str] | None = None) -> int:
    """``loraplex bench ...``: 0 on success, 1 if no request succeeded, 2 on bad input."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code) if isinstance(e.code, int) else 2
    try:
        return int(args.func(args))
    except (BenchError, WorkloadSpecError, OSError) as e:
        print(f"loraplex bench {args.bench}: error: {e}", file=sys.stderr)
        return 2
