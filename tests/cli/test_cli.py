"""The command line: clear messages and exit code 2 on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraplex.cli import GENERATE_SETTINGS, build_parser, generate_engine_options, main
from loraplex.config import EngineConfig
from loraplex.server.args import serve_settings
from loraplex.testing.sync import wait_healthy


def test_generate_with_adapter(tiny_model: Path, adapters: dict[str, Path], capsys) -> None:
    rc = main(
        [
            "generate",
            str(tiny_model),
            "--prompt",
            "Hello",
            "--max-tokens",
            "3",
            "--lora",
            f"a={adapters['all_r8']}",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "[base]" in out and "[a@" in out and "2 requests, 6 tokens" in out


def test_generate_flags_are_the_declared_settings() -> None:
    """``generate``'s engine flags are ``serve``'s declarations (flags, defaults, bounds and
    cross-field rules), not a second list: ``--max-loras 64`` takes 64 host copies too."""
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    generate = sub.choices["generate"]  # type: ignore[index]
    declared = serve_settings().specs
    for name in GENERATE_SETTINGS:
        (action,) = [a for a in generate._actions if a.dest == name]
        assert action.option_strings == list(declared[name].setting.flags), name
        assert action.choices == declared[name].setting.choices, name

    def options(*flags: str) -> dict[str, object]:
        args = build_parser().parse_args(["generate", "m", "--prompt", "x", *flags])
        return generate_engine_options(args)

    got = options("--max-loras", "64")
    assert got["max_loras"] == 64 and got["max_lora_rank"] == 64 and got["dtype"] == "auto"
    assert EngineConfig(model="m", **got).max_cpu_loras == 64  # type: ignore[arg-type]
    assert options("--dtype", "half")["dtype"] == "float16"  # vLLM's alias, as for serve
    with pytest.raises(ValueError, match=r"^--max-cpu-loras: must be >= --max-loras \(8\), got 2$"):
        options("--max-cpu-loras", "2")
    with pytest.raises(SystemExit):
        options("--max-loras", "0x")


def test_generate_refuses_a_bad_setting_before_loading(capsys) -> None:
    rc = main(["generate", "missing", "--prompt", "x", "--max-loras", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and "loraplex generate: error: --max-loras: must be >= 1, got 0" in err


def test_bad_model_dir_is_one_clear_message(tmp_path: Path, capsys) -> None:
    rc = main(["generate", str(tmp_path / "missing"), "--prompt", "x"])
    err = capsys.readouterr().err
    assert rc == 2 and "model directory not found" in err and "Traceback" not in err


def test_bad_lora_flag(tiny_model: Path, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["generate", str(tiny_model), "--prompt", "x", "--lora", "no-equals-sign"])
    assert e.value.code == 2
    assert "NAME=PATH" in capsys.readouterr().err


def test_bad_adapter_path(tiny_model: Path, tmp_path: Path, capsys) -> None:
    rc = main(["generate", str(tiny_model), "--prompt", "x", "--lora", f"a={tmp_path}/nope"])
    assert rc == 2 and "not a directory" in capsys.readouterr().err


def test_serve_bad_model_dir_exit_2(tmp_path: Path, capsys) -> None:
    rc = main(["serve", str(tmp_path / "missing")])
    err = capsys.readouterr().err
    assert rc == 2 and "loraplex serve: error:" in err and "missing" in err
    assert "Traceback" not in err


def test_serve_lora_without_enable_lora_exit_2(
    tiny_model: Path, adapters: dict[str, Path], capsys
) -> None:
    rc = main(["serve", str(tiny_model), "--lora-modules", f"a={adapters['all_r8']}"])
    assert rc == 2 and "--enable-lora" in capsys.readouterr().err


def test_serve_unknown_flag_exit_2(tiny_model: Path) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", str(tiny_model), "--pipeline-parallel-size", "2"])
    assert e.value.code == 2


def test_serve_as_a_user_runs_it(tiny_model: Path, adapters: dict[str, Path]) -> None:
    """`loraplex serve` in a subprocess, with vLLM flags: health, a request on an adapter,
    then SIGINT stops it cleanly."""
    import signal
    import subprocess
    import sys

    import httpx

    from loraplex.testing.server import free_port

    port = free_port()
    cmd = [
        sys.executable, "-m", "loraplex.cli", "serve", str(tiny_model),
        "--port", str(port), "--enable-lora", "--max-loras", "2",
        "--lora-modules", f"sql={adapters['all_r8']}",
        json.dumps({"name": "mlp", "path": str(adapters["mlp_r16"]), "base_model_name": "tiny"}),
        "--served-model-name", "tiny", "--num-threads", "1",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url)
        models = httpx.get(f"{url}/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["tiny", "sql", "mlp"]
        r = httpx.post(
            f"{url}/v1/completions",
            json={"model": "sql", "prompt": "Hello", "max_tokens": 4, "temperature": 0},
            timeout=30,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0
