"""``loraplex.client.push_adapter``: a PEFT model or a state dict becomes exactly the bytes and
config ``save_pretrained`` would write, with their sha256 and the push headers; a refusal raises
:class:`PushError` with the server's own message; importing the client costs no torch."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load, load_file

from loraplex.client import (
    CONFIG_HEADER,
    MAX_CONFIG_BYTES,
    REVISION_HEADER,
    SHA256_HEADER,
    PushError,
    encode_adapter,
    push_adapter,
    push_headers,
    push_path,
)
from loraplex.testing.server import free_port, serve_in_thread
from tests.router.push_double import LORA_CONFIG, PushReplicaDouble, peft_trainee


def _lists_as_sets(d: dict[str, Any]) -> dict[str, Any]:
    return {k: sorted(map(str, v)) if isinstance(v, list) else v for k, v in d.items()}


def test_a_peft_model_is_pushed_as_save_pretrained_writes_it(
    tiny_model: Path, tmp_path: Path
) -> None:
    model = peft_trainee(tiny_model)
    body, config_json = encode_adapter(model)
    model.save_pretrained(str(tmp_path))
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    pushed = load(body)
    assert sorted(pushed) == sorted(saved) and len(saved) == 2 * 3 * 3  # A, B x 3 modules x 3
    for k, t in saved.items():
        assert pushed[k].dtype == t.dtype == torch.float32
        assert torch.equal(pushed[k], t), k
    written = json.loads((tmp_path / "adapter_config.json").read_text())
    assert _lists_as_sets(json.loads(config_json)) == _lists_as_sets(written)
    # the headers: the body's sha256 and the config, padded standard base64
    h = push_headers(body, config_json, api_key="k", revision="step-7")
    assert h[SHA256_HEADER] == hashlib.sha256(body).hexdigest()
    assert base64.b64decode(h[CONFIG_HEADER], validate=True) == config_json
    assert h[REVISION_HEADER] == "step-7" and h["Authorization"] == "Bearer k"
    assert h["Content-Type"] == "application/octet-stream"


def test_the_pushed_bytes_are_a_copy_not_the_trained_parameters(tiny_model: Path) -> None:
    model = peft_trainee(tiny_model)
    body, _ = encode_adapter(model)
    with torch.no_grad():  # a later training step changes the parameters, not the pushed bytes
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(1.0)
    assert encode_adapter(model)[0] != body


def test_bad_arguments_are_refused_before_anything_is_sent() -> None:
    tensors = {"base_model.model.x.lora_A.weight": torch.ones(2, 4)}
    with pytest.raises(ValueError, match="needs config"):
        encode_adapter(tensors)
    with pytest.raises(ValueError, match="needs config"):
        encode_adapter(b"\0" * 8)
    with pytest.raises(ValueError, match="no tensors"):
        encode_adapter({}, LORA_CONFIG)
    with pytest.raises(TypeError, match="PEFT model, a state dict"):
        encode_adapter([1, 2], LORA_CONFIG)
    with pytest.raises(ValueError, match=f"at most {MAX_CONFIG_BYTES}"):
        encode_adapter(tensors, {**LORA_CONFIG, "pad": "x" * MAX_CONFIG_BYTES})
    with pytest.raises(TypeError, match="config must be"):
        encode_adapter(tensors, 3)
    with pytest.raises(ValueError, match="non-empty"):
        push_adapter("http://127.0.0.1:1", "", tensors, config=LORA_CONFIG)
    # JSON text and a set (as PEFT configs hold target_modules) are accepted
    _, cfg = encode_adapter(tensors, {**LORA_CONFIG, "target_modules": {"v_proj", "q_proj"}})
    assert json.loads(cfg)["target_modules"] == ["q_proj", "v_proj"]
    assert json.loads(encode_adapter(tensors, json.dumps(LORA_CONFIG))[1]) == LORA_CONFIG
    assert push_path("a b/c") == "/v1/admin/adapters/a%20b%2Fc/push"


def test_a_refusal_raises_the_servers_message() -> None:
    double = PushReplicaDouble("sk-admin")
    tensors = {"base_model.model.x.lora_A.weight": torch.ones(2, 4)}
    with serve_in_thread(double.app()) as url:
        with pytest.raises(PushError) as e:
            push_adapter(url, "t", tensors, config=LORA_CONFIG, api_key="sk-nope")
        assert e.value.status == 401 and e.value.code == "invalid_api_key"
        assert "invalid API key" in str(e.value) and "'t'" in str(e.value)
        with httpx.Client() as http:  # a reused client, the persist flag, the answer returned
            answer = push_adapter(url, "t", tensors, config=LORA_CONFIG, api_key="sk-admin",
                                  persist=True, client=http)  # fmt: skip
        assert answer["revision"] == "r1" and answer["persisted"] == ["host", "disk"]
    with pytest.raises(PushError) as e:
        push_adapter(f"http://127.0.0.1:{free_port()}", "t", tensors, config=LORA_CONFIG)
    assert e.value.status == 0 and "ConnectError" in str(e.value)


def test_importing_the_client_imports_neither_torch_nor_peft() -> None:
    code = (
        "import sys, loraplex.client; "
        "print(sorted(m for m in ('torch', 'peft', 'safetensors') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr
