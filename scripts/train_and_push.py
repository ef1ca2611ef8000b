"""A PEFT training loop that pushes its adapter to a running loraplex server after every step and
generates from the revision it just pushed, with no file written between the two.

    python scripts/train_and_push.py                     # a tiny random Llama, its own server
    python scripts/train_and_push.py --url http://127.0.0.1:8000 --model /models/base \\
        --admin-api-key "$LORAPLEX_ADMIN_API_KEY" --api-key "$KEY"     # a server you run

Per step::

    loss = causal-LM loss of the PEFT model (LoRA r=8 on every projection) on random tokens
    loss.backward(); SGD step
    push_adapter(url, name, peft_model, revision=f"step-{i}")  (loraplex.client: the adapter's
        state dict as safetensors bytes in memory, its config, their sha256)
    POST /v1/completions {model: name, greedy} on the server, and the same greedy decode with
        the trainer's own PEFT model: the tokens must be equal, and the response's
        x-loraplex-adapter header must name the revision just pushed (never an older one)

Without ``--url`` it builds a tiny random Llama (``loraplex.testing.make_random_model``: a
transformers config, random weights, a small tokenizer) in a temp dir and starts
``loraplex serve`` on loopback with it, so the whole run takes seconds on a CPU. Exits 1 if a
step's tokens differ. Needs peft (the ``dev`` extra).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import torch

from loraplex.client import push_adapter

PROMPT_IDS = [5, 17, 42, 99, 7, 64, 3, 120]  # token ids every vocabulary of the tiny model has
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@contextlib.contextmanager
def local_server(model_dir: Path, admin_key: str) -> Iterator[str]:
    """``loraplex serve model_dir`` on a free loopback port until the block ends."""
    from loraplex.testing.server import free_port
    from loraplex.testing.sync import wait_healthy

    port = free_port()
    cmd = [
        sys.executable, "-m", "loraplex.cli", "serve", str(model_dir), "--port", str(port),
        "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "4", "--num-threads", "1",
        "--admin-api-key", admin_key, "--log-level", "warning",
    ]  # fmt: skip
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@torch.no_grad()
def greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt``, one full forward per token (the reference)."""
    ids = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1]  # [vocab]
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def train_and_push(
    url: str,
    model_dir: Path,
    *,
    name: str,
    steps: int,
    admin_key: str | None,
    api_key: str | None,
    max_tokens: int = 8,
    lr: float = 0.5,
    seed: int = 0,
) -> bool:
    """Run ``steps`` training steps, pushing and generating after each; True if every step's
    served tokens equal the trainer's own."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0,
                        task_type="CAUSAL_LM")  # fmt: skip
    model = get_peft_model(base, config)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=lr)
    vocab = base.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    auth = {"Authorization": f"Bearer {api_key or admin_key}"} if (api_key or admin_key) else {}
    ok = True
    with httpx.Client(timeout=120.0) as http:
        for step in range(1, steps + 1):
            model.train()
            tokens = torch.randint(0, vocab, (4, 32), generator=gen)  # [batch, seq]
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            model.eval()

            t0 = time.perf_counter()
            answer = push_adapter(url, name, model, api_key=admin_key, revision=f"step-{step}",
                                  client=http)  # fmt: skip
            push_ms = (time.perf_counter() - t0) * 1e3
            resp = http.post(f"{url}/v1/completions", headers=auth, json={
                "model": name, "prompt": PROMPT_IDS, "max_tokens": max_tokens,
                "temperature": 0, "return_token_ids": True,
            })  # fmt: skip
            resp.raise_for_status()
            served = resp.json()["choices"][0]["token_ids"]
            want = greedy(model, PROMPT_IDS, len(served))
            # x-loraplex-adapter: NAME;revision=REV;sha256=DIGEST16 (the revision that served it)
            fields = dict(
                kv.partition("=")[::2]
                for kv in resp.headers.get("x-loraplex-adapter", "").split(";")
            )
            used = fields.get("revision")
            step_ok = served == want and used == answer["revision"]
            ok &= step_ok
            print(
                f"step {step}: loss {loss.item():.4f}  pushed {answer['revision']} "
                f"(sha256 {answer['sha256'][:12]}, {push_ms:.0f} ms)  served {served} "
                f"{'== trainer' if served == want else f'!= trainer {want}'}  "
                f"(served by revision {used})",
                flush=True,
            )
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server or router (default: start one on loopback)")
    p.add_argument("--model", type=Path, help="its base model's directory (with --url)")
    p.add_argument("--admin-api-key", default=os.environ.get("LORAPLEX_ADMIN_API_KEY"))
    p.add_argument("--api-key", help="inference key for the completions (default: the admin key)")
    p.add_argument("--name", default="trainee", help="the adapter name pushed (default: trainee)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=8)
    args = p.parse_args(argv)
    if args.url:
        if args.model is None:
            p.error("--url needs --model (the trainer loads the same base model)")
        ok = train_and_push(args.url, args.model, name=args.name, steps=args.steps,
                            admin_key=args.admin_api_key, api_key=args.api_key,
                            max_tokens=args.max_tokens)  # fmt: skip
        return 0 if ok else 1
    from loraplex.testing import make_random_model

    admin = args.admin_api_key or "sk-train-and-push-admin"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_random_model(Path(tmp) / "tiny-llama", num_layers=2, seed=0)
        with local_server(model_dir, admin) as url:
            ok = train_and_push(url, model_dir, name=args.name, steps=args.steps,
                                admin_key=admin, api_key=args.api_key,
                                max_tokens=args.max_tokens)  # fmt: skip
    print("every step served the revision it pushed" if ok else "MISMATCH", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
