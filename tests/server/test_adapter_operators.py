"""The adapter operators' contract (issue 33, item 2): what controllers that drive ``vllm serve``
(the GIE dynamic-LoRA sidecar, KubeAI, AIBrix) see on a live loraplex server.

- ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (``allow_runtime_lora_updating``): off, vLLM's
  ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` answer 404 as vLLM's absent
  routes do; on, they work without a key on a server without keys, as in vLLM; an admin key,
  once set, is required whatever the variable says, and inference keys never load (fail
  closed).
- vLLM's bodies, status codes and messages (vllm/entrypoints/openai/models/serving.py):
  already loaded 400 ``InvalidUserInput`` unless ``load_inplace``, unknown name 404, no
  adapter at the path 404 ``NotFoundError``; ``load_inplace`` swaps the weights under the same
  name, and the next request is served with the new digest.
- ``/v1/models`` model cards as vLLM writes them: base entries ``root`` = the model path and
  ``parent`` null; adapters ``root`` = their path and ``parent`` = the base model's served name
  (``base_model_name`` of a ``--lora-modules`` JSON entry when it is a served name).
- The GIE sidecar's reconcile loop (tools/dynamic-lora-sidecar/sidecar/sidecar.py, removed
  upstream in #2744), its HTTP calls reproduced: ``GET /health``, ``GET /v1/models`` (ids),
  ``POST /v1/load_lora_adapter`` ``{lora_name, lora_path, base_model_name}`` for each
  ``ensureExist`` adapter not listed, ``POST /v1/unload_lora_adapter`` ``{lora_name}`` for each
  listed ``ensureNotExist`` one; ``/v1/models`` then lists exactly the ConfigMap's adapters.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import yaml

from loraplex.config import EngineConfig, LoRAModule, ServerConfig, parse_vllm_env_flag
from loraplex.server.app import ServerState, create_app
from loraplex.server.args import parse_serve_args
from loraplex.testing.server import serve_in_thread

BASE, ALIAS = "tiny", "tiny-alias"
KEY, ADMIN = "sk-inference", "sk-admin"
SIDECAR_SCHEMA = Path(__file__).parent / "data" / "gie_lora_sidecar_schema.yaml"


@dataclass
class Live:
    url: str
    state: ServerState
    root: Path  # the allowed root, holding copies of the test adapters by name

    def post(self, route: str, key: str | None = None, **body: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(f"{self.url}{route}", json=body, headers=headers, timeout=60)

    def get(self, route: str, key: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(f"{self.url}{route}", headers=headers, timeout=60)

    def cards(self, key: str | None = None) -> dict[str, dict[str, Any]]:
        r = self.get("/v1/models", key)
        assert r.status_code == 200, r.text
        return {m["id"]: m for m in r.json()["data"]}


def _root(adapters: dict[str, Path], root: Path) -> Path:
    """An allowed root holding copies of three test adapters as a, b, c."""
    for name, src in (("a", "all_r8"), ("b", "mlp_r16"), ("c", "attn_r4_rslora")):
        if not (root / name).exists():
            shutil.copytree(adapters[src], root / name)
    return root


@contextlib.contextmanager
def live(tiny_model: Path, root: Path, **server: Any) -> Iterator[Live]:
    """A server on the tiny model: served as ``tiny`` and ``tiny-alias``, ``static`` from
    ``--lora-modules`` with ``base_model_name`` ``tiny-alias``, runtime loads under ``root``."""
    config = ServerConfig(
        EngineConfig(model=str(tiny_model), enable_lora=True, max_loras=2, num_threads=1),
        served_model_name=[BASE, ALIAS],
        lora_modules=[LoRAModule("static", str(root / "c"), base_model_name=ALIAS)],
        allowed_lora_roots=[str(root)],
        log_level="warning",
        **server,
    )
    app = create_app(config)
    with serve_in_thread(app) as url:
        yield Live(url, app.state.loraplex, root)


@pytest.fixture(scope="module")
def open_server(
    tiny_model: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Live]:
    """No key at all and VLLM_ALLOW_RUNTIME_LORA_UPDATING on: vLLM's open runtime loading."""
    root = _root(adapters, tmp_path_factory.mktemp("allowed"))
    with live(tiny_model, root, allow_runtime_lora_updating=True) as server:
        yield server


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    return err


def _served_digest(server: Live, model: str) -> str:
    """The sha256 prefix of the weights that served one completion of ``model``."""
    body = {"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.headers["x-loraplex-adapter"].split("sha256=")[1]


# -- the environment variable, read as vLLM reads it -----------------------------------------
@pytest.mark.parametrize(
    ("value", "on"),
    [("1", True), ("true", True), ("True", True), (" TRUE ", True), ("0", False),
     ("false", False), ("yes", False), ("on", False)],
)  # fmt: skip
def test_env_var_reads_as_vllm_envs(value: str, on: bool, tiny_model: Path) -> None:
    """vllm.envs: ``os.environ.get(NAME, "0").strip().lower() in ("1", "true")`` (KubeAI
    writes ``True``); the flag wins over the variable."""
    assert parse_vllm_env_flag(value) is on
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": value}
    assert parse_serve_args([str(tiny_model)], environ=env).allow_runtime_lora_updating is on
    flag = [str(tiny_model), "--no-allow-runtime-lora-updating"]
    assert parse_serve_args(flag, environ=env).allow_runtime_lora_updating is False
    assert parse_serve_args([str(tiny_model)], environ={}).allow_runtime_lora_updating is False


# -- who may load: the variable, the admin key, inference keys -------------------------------
def _tries(server: Live, key: str | None) -> tuple[httpx.Response, httpx.Response]:
    path = str(server.root / "a")
    load = server.post("/v1/load_lora_adapter", key, lora_name="a", lora_path=path)
    unload = server.post("/v1/unload_lora_adapter", key, lora_name="a")
    return load, unload


def test_off_answers_404_as_vllm_without_the_routes(
    tiny_model: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    with live(tiny_model, _root(adapters, tmp_path)) as server:
        for key in (None, "anything"):
            for r in _tries(server, key):
                err = _error(r, 404)
                assert err["code"] == "admin_api_disabled"
                assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in err["message"]
        assert list(server.cards()) == [BASE, ALIAS, "static"]  # nothing else changed


def test_on_with_inference_keys_fails_closed(
    tiny_model: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """vLLM would let its one --api-key load; loraplex never lets an inference key load, and
    without an admin key nobody can: 401 without a valid key, 403 with an inference key."""
    root = _root(adapters, tmp_path)
    with live(tiny_model, root, allow_runtime_lora_updating=True, api_keys=[KEY]) as server:
        for key in (None, "sk-wrong"):
            for r in _tries(server, key):
                assert _error(r, 401)["code"] == "invalid_api_key"
        for r in _tries(server, KEY):
            err = _error(r, 403)
            assert err["type"] == "permission_error" and "--admin-api-key" in err["message"]
        assert "a" not in server.cards(KEY)


@pytest.mark.parametrize("runtime_updating", [True, False])
def test_admin_key_is_required_once_set(
    runtime_updating: bool, tiny_model: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """With --admin-api-key the routes are admin routes whatever the variable says (and the
    variable off does not take loraplex's own admin API away)."""
    root = _root(adapters, tmp_path)
    with live(
        tiny_model, root, allow_runtime_lora_updating=runtime_updating, admin_api_key=ADMIN
    ) as server:
        for key in (None, "sk-wrong"):
            for r in _tries(server, key):
                assert _error(r, 401)["type"] == "authentication_error"
        load, unload = _tries(server, ADMIN)
        assert load.status_code == 200 and unload.status_code == 200, (load.text, unload.text)
    with live(
        tiny_model, root, allow_runtime_lora_updating=runtime_updating, admin_api_key=ADMIN,
        api_keys=[KEY],
    ) as server:  # fmt: skip
        for r in _tries(server, KEY):
            assert _error(r, 403)["type"] == "permission_error"
        load = server.post("/v1/load_lora_adapter", ADMIN, lora_name="a", lora_path=str(root / "a"))
        assert load.status_code == 200, load.text
        assert "a" in server.cards(KEY)


# -- vLLM's bodies, codes and messages; load_inplace --------------------------------------------
def test_load_unload_as_vllm_and_load_inplace_swaps_the_digest(open_server: Live) -> None:
    s, root = open_server, open_server.root
    r = s.post("/v1/load_lora_adapter", lora_name="swap", lora_path=str(root / "a"))
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'swap' added successfully."
    first = s.cards()["swap"]["sha256"]
    assert _served_digest(s, "swap") == first[:16]

    r = s.post("/v1/load_lora_adapter", lora_name="swap", lora_path=str(root / "b"))
    err = _error(r, 400)
    assert err["type"] == "InvalidUserInput" and err["message"] == (
        "The lora adapter 'swap' has already been loaded. If you want to load the adapter in "
        "place, set 'load_inplace' to True."
    )
    assert s.cards()["swap"]["sha256"] == first

    r = s.post(
        "/v1/load_lora_adapter", lora_name="swap", lora_path=str(root / "b"), load_inplace=True
    )
    assert r.status_code == 200, r.text
    card = s.cards()["swap"]
    assert card["sha256"] != first and card["root"] == str((root / "b").resolve())
    assert _served_digest(s, "swap") == card["sha256"][:16]  # the very next request

    r = s.post("/v1/unload_lora_adapter", lora_name="swap")
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'swap' removed successfully."
    assert "swap" not in s.cards()
    err = _error(s.post("/v1/unload_lora_adapter", lora_name="swap"), 404)
    assert err["type"] == "NotFoundError"
    assert err["message"] == "The lora adapter 'swap' cannot be found."

    # load_inplace of a name not loaded is a plain load (vLLM)
    r = s.post(
        "/v1/load_lora_adapter", lora_name="fresh", lora_path=str(root / "a"), load_inplace=True
    )
    assert r.status_code == 200, r.text
    assert s.post("/v1/unload_lora_adapter", lora_name="fresh").status_code == 200


def test_load_errors_as_vllm(open_server: Live, adapters: dict[str, Path]) -> None:
    s = open_server
    missing = str(s.root / "nowhere")
    err = _error(s.post("/v1/load_lora_adapter", lora_name="x", lora_path=missing), 404)
    assert err["type"] == "NotFoundError" and err["param"] == "lora_path"
    assert err["message"].startswith("Loading lora x failed: No adapter found for ")
    assert str(s.root) not in err["message"]  # never a server path
    outside = str(adapters["all_r8"])
    err = _error(s.post("/v1/load_lora_adapter", lora_name="x", lora_path=outside), 400)
    assert err["param"] == "lora_path" and "outside the allowed roots" in err["message"]
    for body in ({"lora_name": "x"}, {"lora_path": missing}, {"lora_name": "", "lora_path": "/"}):
        assert httpx.post(f"{s.url}/v1/load_lora_adapter", json=body).status_code == 400
    assert "x" not in s.cards()


# -- /v1/models model cards ----------------------------------------------------------------------
def test_model_cards_parent_and_root_as_vllm(open_server: Live, tiny_model: Path) -> None:
    s = open_server
    r = s.post("/v1/load_lora_adapter", lora_name="card", lora_path=str(s.root / "a"))
    assert r.status_code == 200, r.text
    try:
        cards = s.cards()
        for name in (BASE, ALIAS):  # vLLM: root = the model path, parent = None
            assert cards[name]["root"] == str(tiny_model) and cards[name]["parent"] is None
        # --lora-modules' base_model_name names the parent when it is a served name
        assert cards["static"]["parent"] == ALIAS
        assert cards["static"]["root"] == str((s.root / "c").resolve())
        # a runtime load: the first served name (vLLM's load route takes no base model)
        assert cards["card"]["parent"] == BASE
        assert cards["card"]["root"] == str((s.root / "a").resolve())
        for card in cards.values():
            assert card["object"] == "model" and card["max_model_len"] > 0
            (perm,) = card["permission"]
            assert perm["object"] == "model_permission" and perm["allow_sampling"] is True
    finally:
        s.post("/v1/unload_lora_adapter", lora_name="card")


# -- the GIE dynamic-LoRA sidecar's flow ------------------------------------------------------
def _configmap(root: Path, exist: list[str], not_exist: list[str]) -> str:
    """The sidecar's ConfigMap file (``vLLMLoRAConfig``), as an operator writes it."""

    def models(names: list[str]) -> list[dict[str, str]]:
        return [{"id": f"sql-{n}", "source": str(root / n)} for n in names]

    return yaml.safe_dump({"vLLMLoRAConfig": {
        "name": "loraplex-tiny", "port": 8000, "defaultBaseModel": BASE,
        "ensureExist": {"models": models(exist)},
        "ensureNotExist": {"models": models(not_exist)},
    }})  # fmt: skip


def _reconcile(url: str, text: str) -> list[tuple[str, str, int]]:
    """One reconcile of the sidecar against ``url``, its HTTP calls as sidecar.py makes them
    (no auth header, ``raise_for_status`` on each load/unload); the calls made."""
    config = yaml.safe_load(text)
    jsonschema.validate(config, yaml.safe_load(SIDECAR_SCHEMA.read_text()))
    c = config["vLLMLoRAConfig"]
    default = c.get("defaultBaseModel", "")
    exist = {a["id"]: a for a in c.get("ensureExist", {}).get("models", [])}
    not_exist = {a["id"]: a for a in c.get("ensureNotExist", {}).get("models", [])}
    calls = []
    with httpx.Client(base_url=url, timeout=60) as h:
        assert h.get("/health").status_code == 200

        def registered() -> set[str]:
            return {m.get("id", "") for m in h.get("/v1/models").json()["data"]}

        for id_, a in exist.items():
            if id_ in not_exist or id_ in registered():
                continue
            payload = {"lora_name": id_, "lora_path": a["source"],
                       "base_model_name": a.get("base-model", default)}  # fmt: skip
            r = h.post("/v1/load_lora_adapter", json=payload)
            r.raise_for_status()
            calls.append(("load", id_, r.status_code))
        for id_ in not_exist:
            if id_ in exist or id_ not in registered():
                continue
            r = h.post("/v1/unload_lora_adapter", json={"lora_name": id_})
            r.raise_for_status()
            calls.append(("unload", id_, r.status_code))
    return calls


def test_gie_sidecar_flow_ends_with_exactly_the_configmap_adapters(
    tiny_model: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    root = _root(adapters, tmp_path)
    with live(tiny_model, root, allow_runtime_lora_updating=True) as server:
        adapters_listed = lambda: {i for i, m in server.cards().items() if m["parent"]}  # noqa: E731
        first = _configmap(root, exist=["a", "b"], not_exist=["c"])
        assert _reconcile(server.url, first) == [
            ("load", "sql-a", 200), ("load", "sql-b", 200)
        ]  # fmt: skip
        assert adapters_listed() == {"static", "sql-a", "sql-b"}
        assert _reconcile(server.url, first) == []  # idempotent: nothing left to do
        # the operator edits the ConfigMap: b goes, c comes
        second = _configmap(root, exist=["a", "c"], not_exist=["b"])
        assert _reconcile(server.url, second) == [
            ("load", "sql-c", 200), ("unload", "sql-b", 200)
        ]  # fmt: skip
        cards = server.cards()
        assert {i for i, m in cards.items() if m["parent"]} == {"static", "sql-a", "sql-c"}
        assert cards["sql-c"]["root"] == str((root / "c").resolve())
        assert all(cards[i]["parent"] == BASE for i in ("sql-a", "sql-c"))
        for model in ("sql-a", "sql-c"):
            assert _served_digest(server, model) == cards[model]["sha256"][:16]
