"""The operator examples under deploy/: an AIBrix ``ModelAdapter`` (deploy/aibrix/) and a KServe
``LLMInferenceService`` (deploy/kserve/) validate against the CRD schemas read from those
projects (tests/deploy/data/, each naming its source and commit), made strict here: a field the
schema does not know fails the test (the API server would drop it without a word). Their
loraplex command lines parse with the real ``loraplex serve`` parser, KServe's built as its
template and controller build it."""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from loraplex.config import LoRAModule
from loraplex.server.args import parse_serve_args

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DATA = Path(__file__).parent / "data"


def _docs(path: Path) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in yaml.safe_load_all(path.read_text()) if d is not None}


def _strict(schema: Any) -> Any:
    """A copy where objects with declared properties refuse others (unless the CRD keeps
    unknown fields there), as kubectl --validate=strict does."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k == "properties" else _strict(v)) for k, v in schema.items()}
    if "properties" in schema:
        out["properties"] = {k: _strict(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            out["additionalProperties"] = False
    return out


def _crd_schema(path: Path, version: str) -> dict[str, Any]:
    crd = yaml.safe_load(path.read_text())
    if crd.get("kind") == "CustomResourceDefinition":
        (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
        crd = v["schema"]["openAPIV3Schema"]
    return _strict(crd)  # type: ignore[no-any-return]


def _secret(name: str, key: str) -> str:
    """A value of the example Secrets (deploy/kubernetes/secrets.yaml)."""
    for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "secrets.yaml").read_text()):
        if d and d["kind"] == "Secret" and d["metadata"]["name"] == name:
            return str(d["stringData"][key])
    raise AssertionError(f"no Secret {name}")


def _model_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    return path


def _adapter_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text("{}")
    return path


# -- AIBrix -----------------------------------------------------------------------------------
def test_aibrix_model_adapter_matches_the_crd_and_the_pods(tmp_path: Path) -> None:
    docs = _docs(DEPLOY / "aibrix" / "modeladapter.yaml")
    adapter, dep = docs["ModelAdapter"], docs["Deployment"]
    assert adapter["apiVersion"] == "model.aibrix.ai/v1alpha1"
    schema = _crd_schema(DATA / "aibrix_modeladapters_crd.yaml", "v1alpha1")
    jsonschema.validate(adapter, schema)
    bad = copy.deepcopy(adapter)
    bad["spec"]["artifactUrl"] = bad["spec"].pop("artifactURL")  # a typo fails
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    spec = adapter["spec"]
    # pkg/utils/modeladapter.go AllowedSchemas; a local path for loraplex's runtime load
    assert spec["artifactURL"].startswith("/")

    # the controller's pods: podSelector labels + adapter.model.aibrix.ai/enabled, port 8000
    pod = dep["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert spec["podSelector"]["matchLabels"].items() <= labels.items()
    assert labels["adapter.model.aibrix.ai/enabled"] == "true"
    assert labels.get("model.aibrix.ai/engine", "vllm") == "vllm"
    (c,) = pod["spec"]["containers"]
    assert [p["containerPort"] for p in c["ports"]] == [8000]
    env = {e["name"]: e for e in c["env"]}
    admin = env["LORAPLEX_ADMIN_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert spec["additionalConfig"]["api-key"] == _secret(admin["name"], admin["key"])

    args = [str(_model_dir(tmp_path / "base")) if a == "/models/base" else a for a in c["args"]]
    roots = tmp_path / "adapters"
    _adapter_dir(roots / Path(spec["artifactURL"]).name)
    args = [str(roots) if a == "/adapters" else a for a in args]
    environ = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]["value"]}
    config = parse_serve_args(args, environ=environ)
    assert config.port == 8000 and config.engine.enable_lora
    assert config.served_model_name == [labels["model.aibrix.ai/name"]] == [spec["baseModel"]]
    assert config.allow_runtime_lora_updating
    mount = {m["mountPath"] for m in c["volumeMounts"]}
    assert "/adapters" in mount and spec["artifactURL"].startswith("/adapters/")


# -- KServe -----------------------------------------------------------------------------------
def _kserve_vllm_argv(isvc: dict[str, Any], access_log_args: str) -> list[str]:
    """``vllm serve``'s argv as KServe runs it: kserve-config-llm-template's eval line
    (config/llmisvcconfig/config-llm-template.yaml) with the controller's LoRA flags
    (workload_lora.go: adapters sorted by name, each under NAME and
    publishers/NS/models/NAME at /mnt/lora/NAME, single-quoted) and then the container's
    args, split as bash's eval splits them."""
    spec, ns = isvc["spec"], isvc["metadata"]["namespace"]
    name, lora = spec["model"]["name"], spec["model"]["lora"]
    flags = ["--enable-lora", f"--max-lora-rank={lora['maxRank']}",
             f"--max-loras={lora['maxAdapters']}", f"--max-cpu-loras={lora['maxCpuAdapters']}",
             "--lora-modules"]  # fmt: skip
    for a in sorted(lora["adapters"], key=lambda a: a["name"]):
        path = f"/mnt/lora/{re.sub(r'[^a-zA-Z0-9._-]', '-', a['name'])}"
        for n in (a["name"], f"publishers/{ns}/models/{a['name']}"):
            flags.append("'" + json.dumps({"name": n, "path": path}, separators=(",", ":")) + "'")
    (main,) = [c for c in spec["template"]["containers"] if c["name"] == "main"]
    rest = " ".join(flags + [shlex.quote(a) for a in main.get("args", [])])
    line = (f'exec vllm serve /mnt/models --served-model-name "{name}" '
            f'"publishers/{ns}/models/{name}" --port 8000 {access_log_args} {rest}')  # fmt: skip
    return shlex.split(line)[3:]


@pytest.mark.parametrize(
    "access_log_args",
    ["--disable-uvicorn-access-log",  # what the template picks for the shim's version
     "--disable-access-log-for-endpoints /health,/metrics,/ping --shutdown-timeout 15"],
)  # fmt: skip
def test_kserve_llminferenceservice_matches_the_crd_and_parses(
    access_log_args: str, tmp_path: Path
) -> None:
    isvc = _docs(DEPLOY / "kserve" / "llminferenceservice.yaml")["LLMInferenceService"]
    assert isvc["apiVersion"] == "serving.kserve.io/v1alpha2"
    schema = _crd_schema(DATA / "kserve_llminferenceservice_v1alpha2_schema.yaml", "v1alpha2")
    jsonschema.validate(isvc, schema)
    # adapters are LLMModelSpec items, schemaless in the CRD: check them against spec.model's
    model_schema = copy.deepcopy(schema["properties"]["spec"]["properties"]["model"])
    del model_schema["properties"]["lora"]
    adapters = isvc["spec"]["model"]["lora"]["adapters"]
    for a in adapters:
        jsonschema.validate(a, model_schema)
        assert a["name"] and a["uri"].split("://")[0] in ("hf", "s3", "pvc")  # not oci://
    bad = copy.deepcopy(isvc)
    bad["spec"]["model"]["lora"]["maxLoras"] = 8  # vLLM's flag name is not the field name
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)

    (main,) = isvc["spec"]["template"]["containers"]
    assert main["image"].startswith("ghcr.io/loraplex/loraplex-vllm:")
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert re.search(r"^FROM replica AS vllm-compat$", dockerfile, re.M)
    assert (
        "/usr/local/bin/vllm" in dockerfile and "vllm.entrypoints.openai.api_server" in dockerfile
    )

    argv = _kserve_vllm_argv(isvc, access_log_args)
    model = _model_dir(tmp_path / "mnt" / "models")
    for a in adapters:
        _adapter_dir(tmp_path / "mnt" / "lora" / a["name"])
    argv = [a.replace("/mnt/", f"{tmp_path}/mnt/") for a in argv]
    config = parse_serve_args(argv, environ={})
    lora, ns = isvc["spec"]["model"]["lora"], isvc["metadata"]["namespace"]
    name = isvc["spec"]["model"]["name"]
    e = config.engine
    assert config.served_model_name == [name, f"publishers/{ns}/models/{name}"]
    assert e.model == str(model) and e.enable_lora and config.port == 8000
    assert (e.max_lora_rank, e.max_loras, e.max_cpu_loras) == (
        lora["maxRank"], lora["maxAdapters"], lora["maxCpuAdapters"]
    )  # fmt: skip
    want = [
        LoRAModule(n, str(tmp_path / "mnt" / "lora" / a["name"]))
        for a in sorted(adapters, key=lambda a: a["name"])
        for n in (a["name"], f"publishers/{ns}/models/{a['name']}")
    ]
    assert config.lora_modules == want
    assert config.max_waiting == 64 and e.dtype == "bfloat16"  # the container's own args
