"""The command line: clear messages and exit code 2 on bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.cli import main


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
