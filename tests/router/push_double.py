"""``PushReplicaDouble``: a TEST DOUBLE of a remote loraplex replica that implements only the
contract of ``POST /v1/admin/adapters/{name}/push`` (plus the routes the router polls), so the
router's fan-out is tested over real HTTP before the real route exists everywhere.

It checks what a replica must check of a push (the admin key, the config header, the body's
sha256, that the body is a safetensors file of tensors) and answers 201 with
``{"object": "adapter.revision", name, revision, sha256, previous_revision, persisted}``, where
``sha256`` digests the body and the config, as a replica's adapter digest does. ``mode``
makes it misbehave: ``refuse`` (409 on every push), ``diverge`` (a different digest),
``no_sha`` (a 201 without a sha256). Every push it took is kept in ``pushes``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from safetensors.torch import load

from loraplex.client import CONFIG_HEADER, MAX_CONFIG_BYTES, REVISION_HEADER, SHA256_HEADER


def peft_trainee(base_dir: Path, seed: int = 3) -> Any:
    """A PEFT model of the base in ``base_dir`` as a trainer holds it: LoRA r=4 on q, v and
    down projections, random non-zero A and B (``seed``), float32."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                     lora_dropout=0.0, task_type="CAUSAL_LM")  # fmt: skip
    model = get_peft_model(base, cfg)
    reseed(model, seed)
    return model.eval()


def reseed(model: Any, seed: int) -> None:
    """New random LoRA weights in place (the next revision a training step would produce)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))


LORA_CONFIG = {
    "peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"],
    "base_model_name_or_path": "tiny", "task_type": "CAUSAL_LM",
}  # fmt: skip
"""A small adapter_config.json for pushes of :func:`lora_tensors`."""


def lora_tensors(seed: int) -> dict[str, torch.Tensor]:
    """A rank-2 LoRA state dict on one q_proj (PEFT's key names), random from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    return {
        f"{prefix}.lora_A.weight": torch.randn(2, 8, generator=g),  # [r, d_in]
        f"{prefix}.lora_B.weight": torch.randn(8, 2, generator=g),  # [d_out, r]
    }


PROMPT = [5, 17, 42, 99, 7, 64]
"""Token ids every tiny test vocabulary has."""


def greedy_tokens(url: str, model: str, api_key: str, n: int = 6) -> tuple[list[int], Any]:
    """``n`` greedy tokens of ``model`` after :data:`PROMPT` from the server at ``url``, and
    the response's headers."""
    r = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {api_key}"},
                   timeout=120, json={"model": model, "prompt": PROMPT, "max_tokens": n,
                                      "temperature": 0, "return_token_ids": True})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"], r.headers


def served_revision(headers: Any) -> str | None:
    """The revision a response names (``x-loraplex-adapter: NAME;revision=REV;sha256=...``)."""
    fields = dict(kv.partition("=")[::2] for kv in headers.get("x-loraplex-adapter", "").split(";"))
    return fields.get("revision")


def _error(status: int, message: str, code: str) -> JSONResponse:
    err = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    return JSONResponse({"error": err}, status_code=status)


@dataclass
class Push:
    """One push the double took."""

    name: str
    revision: str
    body: bytes
    config: dict[str, Any]
    authorization: str | None
    persist: bool


@dataclass
class PushReplicaDouble:
    """The double's state; :meth:`app` is its ASGI app."""

    admin_key: str
    mode: str = "ok"  # ok | refuse | diverge | no_sha
    pushes: list[Push] = field(default_factory=list)
    active: dict[str, str] = field(default_factory=dict)  # name -> revision
    holds: set[str] = field(default_factory=set)  # names listed in /v1/adapters before a push

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/admin/adapters/{name}/push")
        async def push(name: str, request: Request) -> Response:
            if request.headers.get("authorization") != f"Bearer {self.admin_key}":
                return _error(401, "invalid API key", "invalid_api_key")
            body = await request.body()
            try:
                config_json = base64.b64decode(
                    request.headers.get(CONFIG_HEADER, ""), validate=True
                )
                if len(config_json) > MAX_CONFIG_BYTES:
                    return _error(400, "adapter config too large", "invalid_config")
                config = json.loads(config_json)
            except (binascii.Error, ValueError):
                return _error(400, f"bad {CONFIG_HEADER}", "invalid_config")
            if request.headers.get(SHA256_HEADER) != hashlib.sha256(body).hexdigest():
                return _error(400, "digest mismatch", "digest_mismatch")
            try:
                tensors = load(body)
            except Exception as e:  # any parse failure is the client's
                return _error(400, f"not a safetensors body: {e}", "invalid_tensors")
            if not tensors:
                return _error(400, "no tensors", "invalid_tensors")
            if self.mode == "refuse":
                return _error(409, f"adapter {name!r} is being rolled back here", "conflict")
            previous = self.active.get(name)
            revision = request.headers.get(REVISION_HEADER) or f"r{len(self.pushes) + 1}"
            salt = b"other" if self.mode == "diverge" else b""
            digest = hashlib.sha256(body + config_json + salt).hexdigest()
            persist = request.query_params.get("persist") == "disk"
            self.pushes.append(
                Push(name, revision, body, config, request.headers.get("authorization"), persist)
            )
            self.active[name] = revision
            answer: dict[str, Any] = {
                "object": "adapter.revision", "name": name, "revision": revision,
                "sha256": digest, "previous_revision": previous,
                "persisted": ["host", "disk"] if persist else ["host"],
            }  # fmt: skip
            if self.mode == "no_sha":
                del answer["sha256"]
            return JSONResponse(answer, status_code=201)

        @app.get("/health")
        def health() -> Response:
            return Response(status_code=200)

        @app.get("/v1/adapters")
        def adapters() -> dict[str, Any]:
            rows = [{"name": n, "tier": "host", "revision": "seed"} for n in sorted(self.holds)]
            rows += [
                {"name": n, "tier": "host", "revision": r}
                for n, r in self.active.items()
                if n not in self.holds
            ]
            return {"object": "list", "data": rows, "max_loras": 2, "max_cpu_loras": 4}

        @app.get("/v1/models")
        def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": "tiny", "object": "model", "parent": None}]}

        @app.get("/metrics")
        def metrics() -> PlainTextResponse:
            return PlainTextResponse("")

        return app
