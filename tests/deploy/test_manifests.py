"""The Kubernetes manifests under deploy/: every YAML parses, the objects reference each other
consistently, and the containers' command lines parse with the real ``loraplex serve`` and
``loraplex route`` parsers (so a renamed flag breaks this test, not a rollout)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from loraplex.router.cli import build_parser as route_parser
from loraplex.router.cli import config_from_args as route_config
from loraplex.server.args import parse_serve_args

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
YAMLS = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def _docs() -> list[dict[str, Any]]:
    out = []
    for p in YAMLS:
        for doc in yaml.safe_load_all(p.read_text()):
            if doc is not None:
                doc["__file__"] = p.name
                out.append(doc)
    return out


def _objects() -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in _docs() if "metadata" in d}


def _container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    cs = deployment["spec"]["template"]["spec"]["containers"]
    return next(c for c in cs if c["name"] == name)


def _port(container: dict[str, Any], ref: int | str) -> int:
    for p in container["ports"]:
        if ref in (p.get("name"), p["containerPort"]):
            return int(p["containerPort"])
    raise AssertionError(f"container {container['name']} has no port {ref!r}")


def _env_value(container: dict[str, Any], name: str, objs: dict[Any, Any]) -> str:
    """The value an env var will hold, resolving secretKeyRef against the manifests."""
    var = next(e for e in container["env"] if e["name"] == name)
    if "value" in var:
        return str(var["value"])
    ref = var["valueFrom"]["secretKeyRef"]
    return str(objs[("Secret", ref["name"])]["stringData"][ref["key"]])


def _expand(args: list[str], container: dict[str, Any], objs: dict[Any, Any]) -> list[str]:
    """Kubernetes' $(VAR) expansion of container args."""
    return [
        re.sub(r"\$\((\w+)\)", lambda m: _env_value(container, m.group(1), objs), a) for a in args
    ]


def test_deploy_tree_has_manifests_and_readme() -> None:
    assert (DEPLOY / "README.md").is_file()
    assert len(YAMLS) >= 6


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_parses_with_required_fields(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path} is empty"
    for d in docs:
        assert isinstance(d.get("apiVersion"), str) and isinstance(d.get("kind"), str), d
        if d["kind"] != "Kustomization":
            assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", d["metadata"]["name"])
        if d["kind"] in ("Deployment", "StatefulSet"):
            spec = d["spec"]
            labels = spec["template"]["metadata"]["labels"]
            assert spec["selector"]["matchLabels"].items() <= labels.items()
            for c in spec["template"]["spec"]["containers"]:
                assert c["image"] and not c["image"].endswith(":latest"), c["image"]
                assert c["ports"] and "readinessProbe" in c, c["name"]


def test_kustomization_lists_existing_files() -> None:
    k = yaml.safe_load((DEPLOY / "kubernetes" / "kustomization.yaml").read_text())
    for r in k["resources"]:
        assert (DEPLOY / "kubernetes" / r).is_file(), r
    assert k["namespace"] == "loraplex"


def test_references_resolve() -> None:
    """Every Secret key, ConfigMap and claim a pod uses is defined in the manifests."""
    objs = _objects()
    for d in _docs():
        if d["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = d["spec"]["template"]["spec"]
        for v in pod.get("volumes", []):
            if "configMap" in v:
                assert ("ConfigMap", v["configMap"]["name"]) in objs
            if "persistentVolumeClaim" in v:
                assert ("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]) in objs
        if "serviceAccountName" in pod:
            assert ("ServiceAccount", pod["serviceAccountName"]) in objs
        for c in pod["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in objs[("Secret", ref["name"])]["stringData"], ref
            for src in c.get("envFrom", []):
                assert ("Secret", src["secretRef"]["name"]) in objs
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            assert mounts <= {v["name"] for v in pod.get("volumes", [])} | {
                t["metadata"]["name"] for t in d["spec"].get("volumeClaimTemplates", [])
            }


def test_replica_runs_loraplex_serve_with_valid_flags(tmp_path: Path) -> None:
    objs = _objects()
    dep = objs[("Deployment", "loraplex-replica")]
    c = _container(dep, "loraplex")
    assert c["command"] == ["loraplex", "serve"]
    args = _expand(c["args"], c, objs)
    model_dir = tmp_path / "base"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    args = [str(model_dir) if a == "/models/base" else a for a in args]
    config = parse_serve_args(args, environ={})  # the real parser and its semantic checks
    http = _port(c, "http")
    assert config.port == http and config.host == "0.0.0.0"
    assert config.engine.enable_lora and config.engine.device == "cuda"
    # the registry on PostgreSQL, from the Secret, as --registry-url
    i = c["args"].index("--registry-url")
    assert c["args"][i + 1] == "$(LORAPLEX_REGISTRY_URL)"
    assert _env_value(c, "LORAPLEX_REGISTRY_URL", objs).startswith("postgresql+psycopg://")
    assert getattr(config, "registry_url", None) == _env_value(c, "LORAPLEX_REGISTRY_URL", objs)
    # the disk tier lives on a mounted volume (emptyDir or a claim)
    disk = config.engine.disk_cache_dir
    assert disk is not None
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    mount = next(n for p, n in mounts.items() if disk.startswith(p.rstrip("/") + "/"))
    vol = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == mount)
    assert "emptyDir" in vol or "persistentVolumeClaim" in vol
    # probes: readiness (and liveness, startup) on /health at the serving port
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/health" and _port(c, get["port"]) == http, probe
    # the headless Service the router resolves selects these pods on that port
    svc = objs[("Service", "loraplex-replicas")]
    assert svc["spec"]["clusterIP"] == "None"
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert _port(c, svc["spec"]["ports"][0]["targetPort"]) == http


def test_router_runs_loraplex_route_with_valid_flags(tmp_path: Path) -> None:
    objs = _objects()
    dep = objs[("Deployment", "loraplex-router")]
    c = _container(dep, "router")
    assert c["command"] == ["loraplex", "route"]
    # mount the ConfigMap's files where the pod would see them
    mount = next(m for m in c["volumeMounts"] if m["name"] == "config")
    cm_name = next(
        v["configMap"]["name"]
        for v in dep["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "config"
    )
    for key, text in objs[("ConfigMap", cm_name)]["data"].items():
        (tmp_path / key).write_text(text)
    args = [a.replace(mount["mountPath"], str(tmp_path)) for a in _expand(c["args"], c, objs)]
    env = {"LORAPLEX_API_KEY": _env_value(c, "LORAPLEX_API_KEY", objs)}
    config = route_config(route_parser().parse_args(args), environ=env)  # real parser + checks
    http = _port(c, "http")
    assert config.port == http and config.host == "0.0.0.0"
    assert config.policy == "home" and config.replica_api_key == env["LORAPLEX_API_KEY"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert _port(c, c["readinessProbe"]["httpGet"]["port"]) == http
    # --replicas-dns names the headless replica Service and its port
    assert config.replicas_dns is not None
    host, port = config.replicas_dns.rsplit(":", 1)
    svc = objs[("Service", "loraplex-replicas")]
    assert host.split(".")[0] == svc["metadata"]["name"]
    assert host.split(".")[1] == "loraplex"  # the kustomization's namespace
    assert int(port) == svc["spec"]["ports"][0]["port"]
    router_svc = objs[("Service", "loraplex-router")]
    assert _port(c, router_svc["spec"]["ports"][0]["targetPort"]) == http
    assert (
        router_svc["spec"]["selector"].items()
        <= dep["spec"]["template"]["metadata"]["labels"].items()
    )


def test_gateway_inference_pool_with_lora_affinity() -> None:
    objs = _objects()
    pool = objs[("InferencePool", "loraplex")]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    replica = objs[("Deployment", "loraplex-replica")]
    labels = replica["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    http = _port(_container(replica, "loraplex"), "http")
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [http]
    # the endpoint picker: its Service, its Deployment, its plugin config
    ref = pool["spec"]["endpointPickerRef"]
    epp_svc = objs[("Service", ref["name"])]
    assert ref["port"]["number"] in [p["port"] for p in epp_svc["spec"]["ports"]]
    epp = objs[("Deployment", "loraplex-epp")]
    c = _container(epp, "epp")
    args = c["args"]
    assert args[args.index("--pool-name") + 1] == pool["metadata"]["name"]
    config_file = Path(args[args.index("--config-file") + 1])
    mount = next(m for m in c["volumeMounts"] if str(config_file).startswith(m["mountPath"]))
    vol = next(v for v in epp["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    plugins = yaml.safe_load(
        objs[("ConfigMap", vol["configMap"]["name"])]["data"][config_file.name]
    )
    assert plugins["kind"] == "EndpointPickerConfig"
    types = {p["type"] for p in plugins["plugins"]}
    assert "lora-affinity-scorer" in types
    profile = plugins["schedulingProfiles"][0]["plugins"]
    refs = {p["pluginRef"]: p.get("weight", 1) for p in profile}
    assert refs.get("lora-affinity-scorer", 0) > 0  # enabled, with a weight
    assert set(refs) <= types
    route = objs[("HTTPRoute", "loraplex")]
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    assert (backend["kind"], backend["name"]) == ("InferencePool", "loraplex")


def test_dockerfile_has_both_targets() -> None:
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert re.search(r"^FROM .* AS replica$", text, re.M)
    assert re.search(r"^FROM .* AS router$", text, re.M)
    assert "'torch' not in sys.modules" in text


def test_service_monitor_scrapes_the_replicas_with_the_metrics_key() -> None:
    objs = _objects()
    sm = objs[("ServiceMonitor", "loraplex-replicas")]
    svc = objs[("Service", "loraplex-replicas")]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["metadata"]["namespace"] in sm["spec"]["namespaceSelector"]["matchNames"]
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] in {p["name"] for p in svc["spec"]["ports"]} and ep["path"] == "/metrics"
    cred = ep["authorization"]["credentials"]
    assert cred["key"] in objs[("Secret", cred["name"])]["stringData"]
    dep = objs[("Deployment", "loraplex-replica")]
    env = {e["name"]: e for e in _container(dep, "loraplex")["env"]}
    ref = env["LORAPLEX_METRICS_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == (cred["name"], cred["key"])  # the key replicas accept


def test_grafana_dashboard_reads_only_metrics_the_server_exports(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    """Every series the adapter dashboard queries is in a real scrape of a server."""
    import json

    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from loraplex.config import EngineConfig, LoRAModule, ServerConfig
    from loraplex.server.app import create_app

    dash = json.loads((DEPLOY / "monitoring" / "grafana-loraplex-adapters.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"([a-zA-Z_:][\w:]*)\{", e)}
    assert len(used) >= 15 and all(re.search(r'pod=~"\$pod"', e) for e in exprs)
    config = ServerConfig(
        engine=EngineConfig(model=str(tiny_model), device="cpu", num_threads=1, max_loras=2),
        lora_modules=[LoRAModule("sql", str(adapters["all_r8"]))],
    )
    with TestClient(create_app(config)) as client:
        body = {"model": "sql", "prompt": "hi", "max_tokens": 2}
        assert client.post("/v1/completions", json=body).status_code == 200
        text = client.get("/metrics").text
    exported = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert sorted(used - exported) == []
