"""Hub ids (``org/name``) for the model, the tokenizer and ``--lora-modules`` resolve through
``huggingface_hub``'s cache, offline: each test lays out a hub cache directory itself
(``models--org--name/snapshots/<commit>/...`` and ``refs/<branch>``); nothing is downloaded."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from loraplex.hub import HubError, hub_cache_dir, is_hub_id, resolve_hub_dir
from loraplex.server.args import ServeConfigError, parse_serve_args

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def lay_out(cache: Path, repo: str, src: Path, commit: str = COMMIT, ref: str = "main") -> Path:
    """Put ``src``'s files into the hub cache as ``repo`` at ``commit``, with ``refs/<ref>``."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / commit
    shutil.copytree(src, snap, dirs_exist_ok=True)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    return snap


def offline(cache: Path) -> dict[str, str]:
    return {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}


def test_is_hub_id() -> None:
    assert is_hub_id("meta-llama/Llama-3.2-1B") and is_hub_id("org/name.v2")
    for text in ("./org/name", "/abs/dir", "dir", "a/b/c", "~/x", "s3://b/p"):
        assert not is_hub_id(text), text


def test_cache_dir_follows_the_environment(tmp_path: Path) -> None:
    assert hub_cache_dir({"HF_HUB_CACHE": "/c"}) == Path("/c")
    assert hub_cache_dir({"HF_HOME": "/h"}) == Path("/h/hub")
    assert hub_cache_dir({"HF_HOME": "/h"}, download_dir="/d") == Path("/d")


def test_model_tokenizer_and_adapters_by_hub_id(
    tiny_model: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    cache = tmp_path / "hub"
    snap = lay_out(cache, "acme/tiny", tiny_model)
    tok = lay_out(cache, "acme/tiny-tok", tiny_model, commit=OTHER)
    name, adapter = next(iter(adapters.items()))
    lora = lay_out(cache, "acme/tiny-lora", adapter)
    cfg = parse_serve_args(
        ["acme/tiny", "--tokenizer", "acme/tiny-tok", "--enable-lora",
         "--lora-modules", f"{name}=acme/tiny-lora"],
        environ=offline(cache),
    )  # fmt: skip
    assert Path(cfg.engine.model) == snap.resolve()
    assert Path(cfg.engine.tokenizer or "") == tok.resolve()
    assert Path(cfg.lora_modules[0].path) == lora.resolve()
    assert cfg.served_model_name == ["acme/tiny"]  # clients use the id, as with vLLM


def test_hf_home_and_download_dir(tiny_model: Path, tmp_path: Path) -> None:
    snap = lay_out(tmp_path / "home" / "hub", "acme/tiny", tiny_model)
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "home")}
    assert Path(parse_serve_args(["acme/tiny"], environ=env).engine.model) == snap.resolve()
    other = lay_out(tmp_path / "dl", "acme/tiny", tiny_model, commit=OTHER)
    cfg = parse_serve_args(["acme/tiny", "--download-dir", str(tmp_path / "dl")], environ=env)
    assert Path(cfg.engine.model) == other.resolve()


def test_revision_picks_the_branch(tiny_model: Path, tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    lay_out(cache, "acme/tiny", tiny_model)
    v2 = lay_out(cache, "acme/tiny", tiny_model, commit=OTHER, ref="v2")
    cfg = parse_serve_args(["acme/tiny", "--revision", "v2"], environ=offline(cache))
    assert Path(cfg.engine.model) == v2.resolve()
    assert resolve_hub_dir("acme/tiny", environ=offline(cache), revision=OTHER) == v2


def test_missing_hub_ids_are_clear_errors(tiny_model: Path, tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    with pytest.raises(HubError, match=r"'acme/none' is not in the hub cache .*HF_HUB_OFFLINE"):
        resolve_hub_dir("acme/none", environ=offline(cache))
    lay_out(cache, "acme/tiny", tiny_model)
    with pytest.raises(ServeConfigError, match=r"--lora-modules: hub id 'acme/no-lora'"):
        parse_serve_args(
            ["acme/tiny", "--enable-lora", "--lora-modules", "x=acme/no-lora"],
            environ=offline(cache),
        )
    with pytest.raises(ServeConfigError, match=r"--revision|revision 'v9'"):
        parse_serve_args(["acme/tiny", "--revision", "v9"], environ=offline(cache))


def test_a_local_directory_wins_over_a_hub_id(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = tmp_path / "acme" / "tiny"
    shutil.copytree(tiny_model, local)
    monkeypatch.chdir(tmp_path)
    cfg = parse_serve_args(["acme/tiny"], environ=offline(tmp_path / "empty-cache"))
    assert Path(cfg.engine.model) == local.resolve()


def test_server_runs_a_hub_model(tiny_model: Path, tmp_path: Path) -> None:
    """The resolved snapshot serves (the engine loads it like any directory)."""
    from fastapi.testclient import TestClient

    from loraplex.server.app import create_app

    cache = tmp_path / "hub"
    lay_out(cache, "acme/tiny", tiny_model)
    cfg = parse_serve_args(["acme/tiny", "--device", "cpu"], environ=offline(cache))
    with TestClient(create_app(cfg)) as client:
        r = client.post(
            "/v1/completions",
            json={"model": "acme/tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "acme/tiny"
