"""Test helpers for the store and disk-tier tests: a real S3 endpoint and tiny adapter dirs.

- :func:`run_moto_server`: moto's S3 server on loopback (a separate process, real HTTP), stopped
  and reaped on exit.
- :func:`fake_aws_env`: throwaway credentials, isolated from any ~/.aws of the machine.
- :func:`write_adapter`: a minimal valid PEFT LoRA directory (q/v on a 2-layer, hidden-64 Llama)
  without transformers/peft, so the tests stay fast; returns its content digest.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from loraplex.checkpoint.modules import BaseModelSpec
from loraplex.lora.adapter import compute_adapter_digest

HIDDEN, LAYERS, HEADS, KV_HEADS, INTER = 64, 2, 4, 2, 128
TINY_SPEC = BaseModelSpec.from_hf_config(
    {
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "intermediate_size": INTER,
    }
)


def write_adapter(
    out: Path, *, seed: int = 0, r: int = 4, fmt: str = "safetensors"
) -> tuple[Path, str]:
    """A PEFT LoRA dir (q_proj, v_proj, every layer) with random non-zero A and B; (path, digest)."""
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": 2 * r,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "lora_dropout": 0.0,
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(LAYERS):
        for proj in ("q_proj", "v_proj"):
            d_in, d_out = TINY_SPEC.module_shapes[proj]
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, d_in, generator=gen)
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, r, generator=gen)
    (out / "adapter_config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        save_file(tensors, str(out / "adapter_model.safetensors"))
    else:
        torch.save(tensors, str(out / "adapter_model.bin"))
    return out, compute_adapter_digest(config, tensors)


def free_port() -> int:
    """A TCP port nothing listens on right now (closed again before returning)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _moto_command(port: int) -> list[str]:
    exe = Path(sys.executable).parent / "moto_server"
    if exe.exists():
        return [str(exe), "-H", "127.0.0.1", "-p", str(port)]
    if shutil.which("moto_server") is None:
        try:
            import moto.server  # noqa: F401
        except ImportError:
            pytest.skip("moto[server] is not installed")
    return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]


@contextlib.contextmanager
def run_moto_server(log_dir: Path, timeout_s: float = 30.0) -> Iterator[str]:
    """Start ``moto_server`` on a free loopback port; yields its endpoint URL; always reaps it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = log_dir / "moto_server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            _moto_command(port), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"moto_server exited with {proc.returncode}: " + log_path.read_text()
                )
            try:
                with urllib.request.urlopen(f"{url}/moto-api/", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not answer on {url}") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def fake_aws_env(config_dir: Path) -> Iterator[None]:
    """Fake credentials/region in the environment; no profile or ~/.aws file can interfere."""
    with pytest.MonkeyPatch.context() as mp:
        for var in (
            "AWS_PROFILE",
            "AWS_DEFAULT_PROFILE",
            "AWS_SESSION_TOKEN",
            "AWS_SECURITY_TOKEN",
            "AWS_ENDPOINT_URL",
            "AWS_ENDPOINT_URL_S3",
            "AWS_ROLE_ARN",
            "AWS_WEB_IDENTITY_TOKEN_FILE",
        ):
            mp.delenv(var, raising=False)
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        mp.setenv("AWS_CONFIG_FILE", os.fspath(config_dir / "config"))
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.fspath(config_dir / "credentials"))
        yield
