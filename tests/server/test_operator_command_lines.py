"""The ``vllm serve`` command lines KServe and KubeAI build parse with their meaning, and the
listener options they turn on (an access log quiet for probes, TLS files reloaded) work.

- KServe's ``LLMInferenceService``: the ``kserve-config-llm-template`` entrypoint
  (config/llmisvcconfig/config-llm-template.yaml) runs ``eval "exec vllm serve /mnt/models
  --served-model-name NAME publishers/NS/models/NAME --port 8000 ${ACCESS_LOG_ARGS}
  ${SHUTDOWN_TIMEOUT_ARGS} [--tensor-parallel-size N] [--enable-ssl-refresh --ssl-certfile ...
  --ssl-keyfile ...] $@"``, where the access-log and shutdown arguments depend on the version
  ``vllm --version`` prints, and the controller (pkg/controller/v1alpha2/llmisvc/
  workload_lora.go) puts ``--enable-lora [--max-lora-rank=N] [--max-loras=N]
  [--max-cpu-loras=N] --lora-modules '{"name": A, "path": /mnt/lora/A}'
  '{"name": publishers/NS/models/A, ...}'`` in ``$@``, single-quoted for that ``eval``.
- KubeAI's model controller (internal/modelcontroller/engine_vllm.go) runs ``python3 -m
  vllm.entrypoints.openai.api_server --model=DIR --served-model-name=NAME [args] --enable-lora``
  with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``; its model catalog (charts/models/values.yaml)
  adds args such as ``--max-num-batched-token=...`` (an argparse prefix vLLM accepts).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shlex
import ssl
from pathlib import Path
from typing import Any

import httpx
import pytest

from loraplex.config import EngineConfig, LoRAModule, ServerConfig, endpoint_paths
from loraplex.server.app import create_app
from loraplex.server.args import parse_serve_args
from loraplex.server.listener import AccessLogFilter, CertRefresher
from loraplex.testing.server import serve_in_thread

NAME, NS = "tiny", "team-a"


def _kserve_argv(model: Path, adapter: Path, tls: tuple[Path, Path], new_vllm: bool) -> list[str]:
    """The argv of ``vllm serve`` after KServe's template and its ``eval`` (shlex splits and
    unquotes as bash does here); ``new_vllm``: what the template adds for vLLM >= 0.18."""
    lora = [
        "--enable-lora", "--max-lora-rank=16", "--max-loras=2", "--max-cpu-loras=4",
        "--lora-modules",
        *("'" + json.dumps({"name": n, "path": str(adapter)}, separators=(",", ":")) + "'"
          for n in ("sql", f"publishers/{NS}/models/sql")),
    ]  # fmt: skip
    if new_vllm:
        extra = "--disable-access-log-for-endpoints /health,/metrics,/ping --shutdown-timeout 15"
    else:
        extra = "--disable-uvicorn-access-log"
    line = (
        f'exec vllm serve {model} --served-model-name "{NAME}" "publishers/{NS}/models/{NAME}" '
        f"--port 8000 {extra} --tensor-parallel-size 1 --enable-ssl-refresh "
        f"--ssl-certfile {tls[0]} --ssl-keyfile {tls[1]} " + " ".join(lora)
    )
    argv = shlex.split(line)
    assert argv[:3] == ["exec", "vllm", "serve"]
    return argv[3:]


@pytest.fixture
def tls(tmp_path: Path) -> tuple[Path, Path]:
    crt, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    crt.write_text("cert")
    key.write_text("key")
    return crt, key


@pytest.mark.parametrize("new_vllm", [False, True])
def test_kserve_llminferenceservice_command_line(
    new_vllm: bool, tiny_model: Path, adapters: dict[str, Path], tls: tuple[Path, Path]
) -> None:
    adapter = adapters["all_r8"]
    config = parse_serve_args(_kserve_argv(tiny_model, adapter, tls, new_vllm), environ={})
    e = config.engine
    assert config.served_model_name == [NAME, f"publishers/{NS}/models/{NAME}"]
    assert config.port == 8000 and e.tensor_parallel_size == 1
    assert e.enable_lora and (e.max_lora_rank, e.max_loras, e.max_cpu_loras) == (16, 2, 4)
    assert config.lora_modules == [
        LoRAModule("sql", str(adapter)), LoRAModule(f"publishers/{NS}/models/sql", str(adapter))
    ]  # fmt: skip
    assert (config.ssl_certfile, config.ssl_keyfile) == tuple(str(p) for p in tls)
    assert config.enable_ssl_refresh
    if new_vllm:
        assert endpoint_paths(config.disable_access_log_for_endpoints) == [
            "/health", "/metrics", "/ping"
        ]  # fmt: skip
        assert config.shutdown_timeout_s == 15 and not config.disable_uvicorn_access_log
    else:
        assert config.disable_uvicorn_access_log and config.shutdown_timeout_s is None


def test_kserve_lora_modules_serve_under_both_names(
    tiny_model: Path, adapters: dict[str, Path], tls: tuple[Path, Path]
) -> None:
    """Both names KServe gives one adapter directory serve it, listed under the base."""
    argv = _kserve_argv(tiny_model, adapters["all_r8"], tls, new_vllm=True)
    parsed = parse_serve_args(argv, environ={})
    config = ServerConfig(  # the same adapters and names, served over plain HTTP here
        EngineConfig(model=str(tiny_model), max_loras=2, num_threads=1),
        served_model_name=parsed.served_model_name,
        lora_modules=parsed.lora_modules,
        log_level="warning",
    )
    with serve_in_thread(create_app(config)) as url, httpx.Client(base_url=url) as h:
        cards = {m["id"]: m for m in h.get("/v1/models").json()["data"]}
        long = f"publishers/{NS}/models/sql"
        assert [i for i, m in cards.items() if m["parent"] == NAME] == ["sql", long]
        assert cards["sql"]["sha256"] == cards[long]["sha256"]
        for model in ("sql", long, f"publishers/{NS}/models/{NAME}"):
            body = {"model": model, "prompt": "hi", "max_tokens": 2}
            assert h.post("/v1/completions", json=body, timeout=60).status_code == 200


def _kubeai_argv(model: Path) -> list[str]:
    """engine_vllm.go's args, with catalog args loraplex honours (values from the catalog)."""
    catalog = [
        "--max-model-len=2048", "--max-num-batched-token=2048", "--max-num-seqs=16",
        "--gpu-memory-utilization=0.9", "--enable-prefix-caching", "--disable-log-requests",
        "--enforce-eager", "--max-seq-len-to-capture=2048", "--tensor-parallel-size=1",
        "--swap-space=8", "--pipeline-parallel-size=1", "--distributed-executor-backend=mp",
    ]  # fmt: skip
    return [f"--model={model}", "--served-model-name=tiny-kubeai", *catalog, "--enable-lora"]


def test_kubeai_model_command_line(tiny_model: Path) -> None:
    argv = _kubeai_argv(tiny_model)
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}  # as KubeAI writes it
    config = parse_serve_args(argv, environ=env)
    e = config.engine
    assert config.served_model_name == ["tiny-kubeai"] and e.model == str(tiny_model.resolve())
    assert (e.max_model_len, e.max_num_batched_tokens, e.max_num_seqs) == (2048, 2048, 16)
    assert e.gpu_memory_utilization == 0.9 and e.enable_prefix_caching and e.enable_lora
    assert config.disable_log_requests and config.allow_runtime_lora_updating


@pytest.mark.parametrize(
    ("arg", "why"),
    [("--kv-cache-dtype=fp8", "only 'auto'"), ("--num-scheduler-steps=8", "only '1'"),
     ("--load-format=runai_streamer", "safetensors"), ("--quantization=bitsandbytes", ""),
     ("--pipeline-parallel-size=4", "only '1'"), ("--cpu-offload-gb=60", "only '0'")],
)  # fmt: skip
def test_kubeai_catalog_values_loraplex_cannot_honour_are_refused_in_one_line(
    arg: str, why: str, tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Values of KubeAI's catalog that loraplex does not run (fp8 KV, multi-step, streaming
    from S3, bitsandbytes, pipeline parallelism, CPU offload): one clear line, exit 2."""
    with pytest.raises(SystemExit) as info:
        parse_serve_args([str(tiny_model), arg], environ={})
    assert info.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "loraplex serve: error:" in line and arg.split("=")[0] in line and why in line


# -- the listener options -----------------------------------------------------------------------
def _access(path: str) -> logging.LogRecord:
    """A uvicorn access-log record (uvicorn.protocols.http.h11_impl's arguments)."""
    args = ("127.0.0.1:5000", "GET", path, "1.1", 200)
    return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                             args, None)  # fmt: skip


def test_access_log_filter_drops_only_the_listed_paths() -> None:
    f = AccessLogFilter(endpoint_paths(" /health, /metrics,,/ping "))
    assert f.paths == {"/health", "/metrics", "/ping"}
    for path, kept in (("/health", False), ("/metrics?x=1", False), ("/ping", False),
                       ("/v1/models", True), ("/healthz", True), ("/health/x", True)):  # fmt: skip
        assert f.filter(_access(path)) is kept, path
    other = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, "free text", None, None)
    assert f.filter(other)


def test_access_log_paths_must_be_paths(tiny_model: Path) -> None:
    from loraplex.server.args import ServeConfigError

    argv = [str(tiny_model), "--disable-access-log-for-endpoints", "health"]
    with pytest.raises((ServeConfigError, SystemExit)):
        parse_serve_args(argv, environ={})
    with pytest.raises(ServeConfigError, match="--enable-ssl-refresh: needs --ssl-certfile"):
        parse_serve_args([str(tiny_model), "--enable-ssl-refresh"], environ={})


class _Context:
    """Records what a refresher loads into it; fails while ``broken``."""

    def __init__(self) -> None:
        self.loads: list[tuple[Any, ...]] = []
        self.broken = False

    def load_cert_chain(self, certfile: str, keyfile: str | None = None) -> None:
        if self.broken:
            raise ssl.SSLError("key values mismatch")
        self.loads.append(("chain", Path(certfile).read_text(), keyfile))

    def load_verify_locations(self, cafile: str | None = None) -> None:
        self.loads.append(("ca", cafile))


def _touch(path: Path, text: str, ns: int) -> None:
    path.write_text(text)
    os.utime(path, ns=(ns, ns))  # explicit times: no clock to race


def test_cert_refresher_reloads_on_change_and_keeps_the_old_on_failure(tmp_path: Path) -> None:
    crt, key, ca = tmp_path / "tls.crt", tmp_path / "tls.key", tmp_path / "ca.crt"
    for p in (crt, key, ca):
        _touch(p, "v1", 10**18)
    ctx = _Context()
    r = CertRefresher(ctx, str(crt), str(key), str(ca), interval_s=3600)
    assert not r.check() and ctx.loads == []  # nothing changed since start
    _touch(crt, "v2", 2 * 10**18)
    assert r.check() and ctx.loads == [("chain", "v2", str(key)), ("ca", str(ca))]
    assert not r.check() and r.reloads == 1  # once per change
    ctx.broken = True
    _touch(key, "v3-half-written", 3 * 10**18)
    assert not r.check() and r.reloads == 1  # logged, the old certificate stays
    ctx.broken = False
    _touch(key, "v3", 4 * 10**18)
    assert r.check() and r.reloads == 2
    # Kubernetes' Secret volumes swap a symlink: a new file, same path
    new = tmp_path / "tls.crt.new"
    _touch(new, "v4", 4 * 10**18)
    os.replace(new, crt)
    assert r.check() and ctx.loads[-2] == ("chain", "v4", str(key))


def test_cert_refresher_loads_a_real_certificate_into_a_real_context(tmp_path: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def write_pair(cn: str, ns: int) -> None:
        k = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
        cert = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(k.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(datetime.datetime(2024, 1, 1))
            .not_valid_after(datetime.datetime(2124, 1, 1))
            .sign(k, hashes.SHA256())
        )  # fmt: skip
        pem = k.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        _touch(key, pem.decode(), ns)
        _touch(crt, cert.public_bytes(serialization.Encoding.PEM).decode(), ns)

    crt, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    write_pair("first", 10**18)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(crt), str(key))
    r = CertRefresher(ctx, str(crt), str(key), interval_s=3600)
    write_pair("second", 2 * 10**18)
    assert r.check() and r.reloads == 1
    _touch(key, "not a key", 3 * 10**18)  # a half-written pair
    assert not r.check() and r.reloads == 1
