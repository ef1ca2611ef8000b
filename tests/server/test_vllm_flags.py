"""``loraplex serve`` takes a vLLM command line: vLLM's flags with vLLM's meaning, the ones that
do not apply refused with one 'not supported: X' line, underscore spellings, ``--version`` and
``python -m loraplex``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loraplex.cli import build_parser, main
from loraplex.config import ServerConfig
from loraplex.server.args import ServeConfigError, parse_serve_args
from loraplex.server.vllm_compat import ANY, VllmFlag, normalize_argv, vllm_flags

VLLM_FLAGS = Path(__file__).parent / "data" / "vllm_serve_flags.txt"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def parse(argv: list[object], env: dict[str, str] | None = None) -> ServerConfig:
    return parse_serve_args([str(a) for a in argv], environ=env or {})


def refused(argv: list[object], capsys: pytest.CaptureFixture[str]) -> str:
    """The one error line argparse prints (exit status 2)."""
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    return err.strip().splitlines()[-1]


def test_every_vllm_serve_flag_is_known(model_dir: Path) -> None:
    """Each option string of vLLM 0.32's ``vllm serve`` is a loraplex flag or a listed one
    (accepted or refused clearly), never argparse's 'unrecognized arguments'."""
    import argparse

    from loraplex.server.args import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    known = set(parser._option_string_actions)
    names = [ln.strip() for ln in VLLM_FLAGS.read_text().splitlines() if ln.startswith("-")]
    assert len(names) > 400
    assert [n for n in names if n not in known] == []


def test_accepted_vllm_flags_with_vllm_meaning(model_dir: Path, tmp_path: Path) -> None:
    tok = tmp_path / "tok"
    tok.mkdir()
    cfg = parse(
        [model_dir, "--tensor-parallel-size", "1", "-pp", "1", "--data-parallel-size", "1",
         "--gpu-memory-utilization", "0.75", "--trust-remote-code", "--enforce-eager",
         "--kv-cache-dtype", "auto", "--load-format", "safetensors", "--disable-log-requests",
         "--generation-config", "vllm", "--tokenizer", tok, "--revision", "main",
         "--max_model_len", "64", "--max_num_seqs=4", "--block-size", "32",
         "--num-gpu-blocks-override", "100", "--disable-log-stats", "--skip-tokenizer-init",
         "--enable-chunked-prefill", "--swap-space", "4", "--max-num-queued-reqs", "50"]
    )  # fmt: skip
    e = cfg.engine
    assert (e.gpu_memory_utilization, e.trust_remote_code, e.generation_config) == (
        0.75, True, "vllm")  # fmt: skip
    assert (e.tokenizer, e.revision, e.max_model_len, e.max_num_seqs) == (str(tok), "main", 64, 4)
    assert (e.block_size, e.num_kv_blocks, e.skip_tokenizer_init) == (32, 100, True)
    assert cfg.disable_log_requests and cfg.disable_log_stats and cfg.max_waiting == 50


def test_per_request_lora_scale_flag_is_accepted(model_dir: Path) -> None:
    """vLLM PR #52757 gates ``lora_scale`` behind a flag; loraplex always serves it (issue 49)."""
    for argv in (["--enable-per-request-lora-scale"], ["--no-enable-per-request-lora-scale"]):
        parse([model_dir, *argv])  # no error


def test_vllm_default_queues_instead_of_refusing(model_dir: Path) -> None:
    assert parse([model_dir]).max_waiting == 0  # no cap: requests queue, as in vLLM
    assert parse([model_dir, "--max-waiting", "7"]).max_waiting == 7


def test_no_enable_log_requests_is_disable_log_requests(model_dir: Path) -> None:
    assert not parse([model_dir]).disable_log_requests
    assert not parse([model_dir, "--enable-log-requests"]).disable_log_requests
    assert parse([model_dir, "--no-enable-log-requests"]).disable_log_requests


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["--pipeline-parallel-size", "2"], "not supported: --pipeline-parallel-size 2 (only '1'"),
        (["-pp", "4"], "not supported: -pp 4"),
        (["--qlora-adapter-name-or-path", "x"], "serve the QLoRA adapter with --lora-modules"),
        (
            ["--quantization-param-path", "x"],
            "not supported: --quantization-param-path x (loraplex reads",
        ),
        (["--num-speculative-tokens", "4"], "not supported: --num-speculative-tokens 4 (set"),
        (["--no-enable-chunked-prefill"], "not supported: --no-enable-chunked-prefill"),
        (["--kv-cache-dtype", "fp8"], "not supported: --kv-cache-dtype fp8"),
        (["--enable-sleep-mode"], "not supported: --enable-sleep-mode"),
        (["--limit-mm-per-prompt", "{}"], "text-only"),
        (["--numa-bind"], "not supported: --numa-bind"),
        (["--enable-expert-parallel"], "expert parallelism is not supported"),
    ],
)
def test_refused_vllm_flags_name_themselves(
    model_dir: Path, argv: list[str], want: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = refused([model_dir, *argv], capsys)
    assert line.startswith("loraplex serve: error: not supported: ") and want in line


@pytest.mark.parametrize(
    ("value", "want"),
    [
        ('{"method": "eagle3", "model": "x"}', "method 'eagle3' is not supported by loraplex"),
        ('{"method": "ngram"}', "method 'ngram' needs num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens must be"),
        ('{"method": "suffix", "typo": 1}', "unknown key 'typo'"),
        ("{nope", "invalid JSON"),
    ],
)
def test_a_bad_speculative_config_names_the_flag_and_the_problem(
    model_dir: Path, value: str, want: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = refused([model_dir, "--speculative-config", value], capsys)
    assert "--speculative-config" in line and want in line, line


def _other_value(f: VllmFlag) -> list[str]:
    """A command line giving ``f`` a value loraplex does not accept."""
    name = f.flags[0]
    if f.takes == "bool":
        return [name] if "true" not in f.accepts else ["--no-" + name[2:]]
    if f.takes == "true":
        return [name]
    return [name, "zzz-not-a-value"]


def test_each_listed_flag_accepts_its_values_and_refuses_others(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for f in vllm_flags():
        if f.accepts != ANY:
            line = refused([model_dir, *_other_value(f)], capsys)
            assert f"not supported: {_other_value(f)[0]}" in line, f.flags
        for value in () if f.accepts == ANY else f.accepts:
            if f.takes == "bool":
                argv = [f.flags[0] if value == "true" else "--no-" + f.flags[0][2:]]
            elif f.takes == "true":
                argv = [f.flags[0]]
            else:
                argv = [f.flags[0], value]
            parse([model_dir, *argv])  # accepted: no error


def test_tool_choice_flags(model_dir: Path) -> None:
    cfg = parse([model_dir, "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"])
    assert cfg.enable_auto_tool_choice and cfg.tool_call_parser == "llama3_json"
    with pytest.raises(ServeConfigError, match=r"--enable-auto-tool-choice: needs --tool-call-p"):
        parse([model_dir, "--enable-auto-tool-choice"])


def test_chat_template_file_or_inline(model_dir: Path, tmp_path: Path) -> None:
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert parse([model_dir, "--chat-template", f]).chat_template == f.read_text()
    inline = "{{ messages[0].content }}"
    assert parse([model_dir, "--chat-template", inline]).chat_template == inline
    with pytest.raises(ServeConfigError, match=r"--chat-template: .*neither a file nor"):
        parse([model_dir, "--chat-template", tmp_path / "missing.jinja"])


def test_generation_config_dir(model_dir: Path, tmp_path: Path) -> None:
    gen = tmp_path / "gen"
    gen.mkdir()
    with pytest.raises(ServeConfigError, match=r"--generation-config: .*generation_config.json"):
        parse([model_dir, "--generation-config", gen])
    (gen / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    assert parse([model_dir, "--generation-config", gen]).engine.generation_config == str(gen)
    over = '{"temperature": 0.5}'
    cfg = parse([model_dir, "--override-generation-config", over])
    assert cfg.engine.generation_overrides == {"temperature": 0.5}
    with pytest.raises(SystemExit):
        parse([model_dir, "--override-generation-config", "[1]"])


def test_gpu_memory_utilization_budget() -> None:
    from loraplex.config import EngineConfig

    gib = 1 << 30
    cfg = EngineConfig(model="m", gpu_memory_utilization=0.5)
    assert cfg.device_kv_budget(free_bytes=90 * gib, total_bytes=100 * gib) == 40 * gib
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization 0.5 leaves no memory"):
        cfg.device_kv_budget(free_bytes=40 * gib, total_bytes=100 * gib)


def test_underscore_spellings() -> None:
    assert normalize_argv(["--max_model_len=8", "--lora-modules", "a_b=/x_y", "--", "--x_y"]) == [
        "--max-model-len=8", "--lora-modules", "a_b=/x_y", "--", "--x_y"]  # fmt: skip
    args = build_parser().parse_args(
        ["serve", "M", *normalize_argv(["--max_num_seqs", "3", "--enable_lora"])]
    )
    assert (args.max_num_seqs, args.enable_lora) == (3, True)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import loraplex

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == loraplex.__version__
    out = subprocess.run(
        [sys.executable, "-m", "loraplex", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == loraplex.__version__


def test_python_m_loraplex_serve_reports_errors(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "loraplex", "serve", str(tmp_path), "--kv-cache-dtype", "fp8"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "not supported: --kv-cache-dtype fp8" in out.stderr


def test_chat_template_flag_renders_chat_requests(tiny_model: Path, tmp_path: Path) -> None:
    """``--chat-template`` replaces the tokenizer's template for every chat request."""
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from loraplex.server.app import create_app

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<<{{ m.content }}>>{% endfor %}")
    cfg = parse([tiny_model, "--chat-template", template, "--device", "cpu"])
    want = len(
        AutoTokenizer.from_pretrained(str(tiny_model))(
            "<<hello>>", add_special_tokens=False
        ).input_ids
    )
    with TestClient(create_app(cfg)) as client:
        body = {"model": str(tiny_model), "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 1}  # fmt: skip
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == want


def test_vllm_keys_in_a_config_file(model_dir: Path, tmp_path: Path) -> None:
    """A vLLM YAML config's keys: accepted like the flags, or refused naming the key."""
    f = tmp_path / "vllm.yaml"
    f.write_text("tensor-parallel-size: 1\nenforce_eager: true\nenable-log-requests: false\n"
                 "max_model_len: 64\n")  # fmt: skip
    cfg = parse([model_dir, "--config", f])
    assert cfg.disable_log_requests and cfg.engine.max_model_len == 64
    f.write_text("pipeline-parallel-size: 2\n")
    with pytest.raises(ServeConfigError, match=r"key 'pipeline-parallel-size' .*not supported: "):
        parse([model_dir, "--config", f])
    f.write_text("kv-cache-dtype: fp8\n")
    with pytest.raises(ServeConfigError, match=r"not supported: kv-cache-dtype: fp8"):
        parse([model_dir, "--config", f])
    f.write_text("quantization: int4\nquantization-group-size: 64\n")  # loraplex's own keys
    cfg = parse([model_dir, "--config", f])
    assert (cfg.engine.quantization, cfg.engine.quantization_group_size) == ("int4", 64)
    f.write_text("tensor-paralel-size: 1\n")  # a typo stays an unknown key
    with pytest.raises(ServeConfigError, match=r"unknown key"):
        parse([model_dir, "--config", f])
