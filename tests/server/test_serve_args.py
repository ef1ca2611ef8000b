"""``loraplex serve`` flags and config file: vLLM-compatible parsing, precedence, clear errors."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from loraplex.config import EngineConfig, LoRAModule, ServerConfig
from loraplex.server.args import (
    ServeConfigError,
    add_serve_arguments,
    config_from_args,
    parse_byte_size,
    parse_serve_args,
)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def make_adapter(root: Path, name: str) -> Path:
    d = root / "adapters" / name
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text("{}")
    return d


@pytest.fixture
def adapters(tmp_path: Path) -> dict[str, Path]:
    return {n: make_adapter(tmp_path, n) for n in ("sql", "chat", "code")}


def parse(argv: list[str], env: dict[str, str] | None = None) -> ServerConfig:
    return parse_serve_args([str(a) for a in argv], environ=env or {})


def error_of(argv: list[str], env: dict[str, str] | None = None) -> str:
    with pytest.raises(ServeConfigError) as info:
        parse(argv, env)
    return str(info.value)


# --------------------------------------------------------------------------- defaults


def test_defaults_come_from_the_dataclasses(model_dir: Path) -> None:
    cfg = parse([model_dir])
    want_engine = EngineConfig(model=str(model_dir.resolve()), enable_lora=False)
    assert cfg.engine == want_engine  # every engine default, except LoRA off as in vLLM
    want = ServerConfig(engine=want_engine, served_model_name=[str(model_dir)])
    assert cfg == want
    assert cfg.model_names == [str(model_dir)]  # the name as typed, like vLLM


def test_model_flag_form_and_conflicts(model_dir: Path, tmp_path: Path) -> None:
    assert parse(["--model", model_dir]).engine.model == str(model_dir.resolve())
    assert parse([model_dir, "--model", model_dir]).engine.model == str(model_dir.resolve())
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    msg = error_of([model_dir, "--model", other])
    assert "MODEL_DIR" in msg and "--model" in msg and "differ" in msg
    assert "MODEL_DIR is required" in error_of(["--port", "1"])


def test_relative_model_dir_is_resolved_but_served_as_typed(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(model_dir.parent)
    cfg = parse(["model"])
    assert cfg.engine.model == str(model_dir.resolve())
    assert cfg.served_model_name == ["model"]


# --------------------------------------------------------------------------- flags


def test_all_scalar_flags(model_dir: Path) -> None:
    cfg = parse(
        [model_dir, "--host", "0.0.0.0", "--port", "9000", "--max-loras", "4",
         "--max-cpu-loras", "16", "--max-lora-rank", "32", "--max-model-len", "32k",
         "--max-num-seqs", "8", "--max-num-batched-tokens", "1K", "--seed", "7",
         "--device", "cpu", "--num-threads", "2", "--max-waiting", "10",
         "--uvicorn-log-level", "WARNING"]
    )  # fmt: skip
    e = cfg.engine
    assert (cfg.host, cfg.port, cfg.max_waiting, cfg.log_level) == ("0.0.0.0", 9000, 10, "warning")
    assert (e.max_loras, e.max_cpu_loras, e.max_lora_rank) == (4, 16, 32)
    assert (e.max_model_len, e.max_num_seqs, e.max_num_batched_tokens) == (32000, 8, 1024)
    assert (e.seed, e.device, e.num_threads) == (7, "cpu", 2)
    assert parse([model_dir, "--log-level", "debug"]).log_level == "debug"


@pytest.mark.parametrize(
    ("flag", "want"),
    [("auto", "auto"), ("half", "float16"), ("float16", "float16"), ("float", "float32"),
     ("float32", "float32"), ("bfloat16", "bfloat16"), ("BFloat16", "bfloat16")],
)  # fmt: skip
def test_dtype_aliases(model_dir: Path, flag: str, want: str) -> None:
    assert parse([model_dir, "--dtype", flag]).engine.dtype == want


@pytest.mark.parametrize(
    ("text", "want"),
    [("4096", 4096), ("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("2gib", 2 * 2**30),
     ("1.5Gi", 3 * 2**29), ("1G", 10**9), ("1GB", 10**9), ("500M", 500 * 10**6),
     ("64 KiB", 65536), ("10B", 10)],
)  # fmt: skip
def test_byte_sizes(text: str, want: int) -> None:
    assert parse_byte_size(text) == want


@pytest.mark.parametrize("text", ["", "GiB", "1X", "1ib", "-1", "1.2.3G"])
def test_bad_byte_sizes(text: str) -> None:
    with pytest.raises(ValueError, match="byte size"):
        parse_byte_size(text)


def test_kv_cache_memory_flag(model_dir: Path) -> None:
    assert parse([model_dir, "--kv-cache-memory", "2GiB"]).engine.kv_cache_memory_bytes == 2**31
    cfg = parse([model_dir, "--kv-cache-memory-bytes", "1000"])  # vLLM's spelling
    assert cfg.engine.kv_cache_memory_bytes == 1000
    assert "--kv-cache-memory" in error_of([model_dir, "--kv-cache-memory", "0"])


def test_prefix_caching_boolean_optional(model_dir: Path) -> None:
    assert parse([model_dir]).engine.enable_prefix_caching is True
    assert parse([model_dir, "--no-enable-prefix-caching"]).engine.enable_prefix_caching is False
    assert parse([model_dir, "--enable-prefix-caching"]).engine.enable_prefix_caching is True


def test_lora_modules_name_path_and_json(model_dir: Path, adapters: dict[str, Path]) -> None:
    spec = json.dumps({"name": "chat", "path": str(adapters["chat"]), "base_model_name": "base"})
    cfg = parse([model_dir, "--enable-lora", "--lora-modules", f"sql={adapters['sql']}", spec])
    assert cfg.engine.enable_lora is True
    assert cfg.lora_modules == [
        LoRAModule("sql", str(adapters["sql"].resolve())),
        LoRAModule("chat", str(adapters["chat"].resolve()), base_model_name="base"),
    ]
    # repeated flag adds to the list
    cfg = parse(
        [model_dir, "--enable-lora", "--lora-modules", f"sql={adapters['sql']}",
         "--lora-modules", f"code={adapters['code']}"]
    )  # fmt: skip
    assert [m.name for m in cfg.lora_modules] == ["sql", "code"]


def test_served_model_names_and_api_keys(model_dir: Path) -> None:
    cfg = parse(
        [model_dir, "--served-model-name", "llama", "alias", "--api-key", "k1",
         "--api-key", "k2", "k3", "--admin-api-key", "root"]
    )  # fmt: skip
    assert cfg.served_model_name == ["llama", "alias"]
    assert cfg.model_names[0] == "llama"
    assert cfg.api_keys == ["k1", "k2", "k3"]
    assert cfg.admin_api_key == "root"


def test_api_keys_from_environment(model_dir: Path) -> None:
    assert parse([model_dir], {"VLLM_API_KEY": "v"}).api_keys == ["v"]
    assert parse([model_dir], {"LORAPLEX_API_KEY": "l"}).api_keys == ["l"]
    both = {"LORAPLEX_API_KEY": "l", "VLLM_API_KEY": "v"}
    assert parse([model_dir], both).api_keys == ["l"]  # the specific one wins
    assert parse([model_dir, "--api-key", "cli"], both).api_keys == ["cli"]  # flag wins
    assert parse([model_dir], {"VLLM_API_KEY": ""}).api_keys == []
    cfg = parse([model_dir], {"LORAPLEX_ADMIN_API_KEY": "adm"})
    assert cfg.admin_api_key == "adm"
    assert parse([model_dir, "--admin-api-key", "x"], {"LORAPLEX_ADMIN_API_KEY": "adm"}
                 ).admin_api_key == "x"  # fmt: skip


def test_env_defaults_to_process_environment(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    monkeypatch.delenv("LORAPLEX_API_KEY", raising=False)
    assert parse_serve_args([str(model_dir)]).api_keys == ["from-env"]


def test_admin_key_must_differ_from_inference_keys(model_dir: Path) -> None:
    msg = error_of([model_dir, "--api-key", "same", "--admin-api-key", "same"])
    assert "--admin-api-key" in msg and "differ" in msg
    msg = error_of([model_dir], {"VLLM_API_KEY": "s", "LORAPLEX_ADMIN_API_KEY": "s"})
    assert "LORAPLEX_ADMIN_API_KEY" in msg


def test_allowed_lora_roots_resolved(model_dir: Path, tmp_path: Path) -> None:
    cfg = parse([model_dir, "--allowed-lora-roots", tmp_path, tmp_path / "model"])
    assert cfg.allowed_lora_roots == [str(tmp_path.resolve()), str(model_dir.resolve())]


def test_max_cpu_loras_follows_max_loras_unless_given(model_dir: Path) -> None:
    default_cpu = EngineConfig(model="m").max_cpu_loras
    assert parse([model_dir, "--max-loras", "2"]).engine.max_cpu_loras == default_cpu
    big = default_cpu * 2
    assert parse([model_dir, "--max-loras", str(big)]).engine.max_cpu_loras == big
    msg = error_of([model_dir, "--max-loras", "8", "--max-cpu-loras", "4"])
    assert "--max-cpu-loras" in msg and "8" in msg


# --------------------------------------------------------------------------- errors


def test_missing_model_dir(tmp_path: Path) -> None:
    msg = error_of([tmp_path / "nope"])
    assert "MODEL_DIR" in msg and "does not exist" in msg
    offline = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}  # a hub id
    msg = error_of(["meta-llama/Llama-3.2-1B"], offline)
    assert "MODEL_DIR" in msg and "HF_HUB_OFFLINE" in msg and "huggingface-cli download" in msg


def test_model_dir_without_config_json(tmp_path: Path) -> None:
    msg = error_of([tmp_path])
    assert "MODEL_DIR" in msg and "config.json" in msg


def test_missing_adapter_dir_and_adapter_config(model_dir: Path, tmp_path: Path) -> None:
    msg = error_of([model_dir, "--enable-lora", "--lora-modules", f"x={tmp_path / 'gone'}"])
    assert "--lora-modules" in msg and "'x'" in msg and "does not exist" in msg
    msg = error_of([model_dir, "--enable-lora", "--lora-modules", f"x={tmp_path}"])
    assert "--lora-modules" in msg and "adapter_config.json" in msg


def test_lora_modules_need_enable_lora(model_dir: Path, adapters: dict[str, Path]) -> None:
    msg = error_of([model_dir, "--lora-modules", f"sql={adapters['sql']}"])
    assert "--lora-modules" in msg and "add" in msg and "--enable-lora" in msg
    msg = error_of([model_dir, "--no-enable-lora", "--lora-modules", f"sql={adapters['sql']}"])
    assert "--enable-lora" in msg


def test_duplicate_names(model_dir: Path, adapters: dict[str, Path]) -> None:
    msg = error_of(
        [model_dir, "--enable-lora", "--lora-modules", f"a={adapters['sql']}",
         f"a={adapters['chat']}"]
    )  # fmt: skip
    assert "--lora-modules" in msg and "'a'" in msg and "twice" in msg
    msg = error_of(
        [model_dir, "--served-model-name", "base", "--enable-lora", "--lora-modules",
         f"base={adapters['sql']}"]
    )  # fmt: skip
    assert "'base'" in msg and "served model name" in msg


@pytest.mark.parametrize("port", ["-1", "65536", "100000"])
def test_bad_port(model_dir: Path, port: str) -> None:
    msg = error_of([model_dir, "--port", port])
    assert "--port" in msg and "65535" in msg


@pytest.mark.parametrize(
    "flag", ["--max-loras", "--max-lora-rank", "--max-num-seqs", "--max-model-len", "--num-threads"]
)
def test_non_positive_numbers(model_dir: Path, flag: str) -> None:
    assert flag in error_of([model_dir, flag, "0"])


def test_bad_allowed_root(model_dir: Path, tmp_path: Path) -> None:
    msg = error_of([model_dir, "--allowed-lora-roots", tmp_path / "missing"])
    assert "--allowed-lora-roots" in msg and "does not exist" in msg
    msg = error_of([model_dir, "--allowed-lora-roots", model_dir / "config.json"])
    assert "--allowed-lora-roots" in msg and "not a directory" in msg


@pytest.mark.parametrize(
    "argv",
    [
        ["--pipeline-parallel-size", "2"],  # a vLLM flag loraplex supports with value 1 only
        ["--kv-cache-dtype", "fp8"],  # a vLLM flag loraplex does not support
        ["--quantization", "bitsandbytes"],  # a method loraplex does not serve
        ["--gpu-memory-utilization", "most"],
        ["--max-lora", "4"],  # no abbreviations: vLLM command lines parse exactly
        ["--port", "eighty"],
        ["--dtype", "int8"],
        ["--device", "tpu"],
        ["--kv-cache-memory", "lots"],
        ["--lora-modules", "no-equals-sign"],
        ["--lora-modules", '{"name": "x"}'],
        ["--lora-modules", '{"name": "x", "path": "/p", "rank": 8}'],
        ["--api-key", ""],
        ["--log-level", "loud"],
    ],
)
def test_argparse_errors_exit_2(
    model_dir: Path, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse([model_dir, *argv])
    assert info.value.code == 2
    assert argv[0] in capsys.readouterr().err


# --------------------------------------------------------------------------- config files


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_yaml_config_dash_and_underscore_keys(model_dir: Path, adapters: dict[str, Path],
                                              tmp_path: Path) -> None:  # fmt: skip
    cfg_file = write(
        tmp_path / "serve.yaml",
        f"""
model: {model_dir}
port: 9001
max-loras: 3
max_cpu_loras: 6
dtype: half
kv_cache_memory: 512MiB
enable-lora: true
enable_prefix_caching: false
served-model-name: base
api_key: [a, b]
lora-modules:
  - sql={adapters["sql"]}
""",
    )
    cfg = parse(["--config", cfg_file])
    e = cfg.engine
    assert (cfg.port, e.max_loras, e.max_cpu_loras, e.dtype) == (9001, 3, 6, "float16")
    assert e.kv_cache_memory_bytes == 512 * 2**20
    assert e.enable_lora is True and e.enable_prefix_caching is False
    assert cfg.served_model_name == ["base"] and cfg.api_keys == ["a", "b"]
    assert cfg.lora_modules == [LoRAModule("sql", str(adapters["sql"].resolve()))]
    assert e.model == str(model_dir.resolve())


@pytest.mark.parametrize("shape", ["strings", "dicts", "mapping", "mapping-of-dicts"])
def test_yaml_lora_module_shapes(model_dir: Path, adapters: dict[str, Path], tmp_path: Path,
                                 shape: str) -> None:  # fmt: skip
    sql, chat = adapters["sql"], adapters["chat"]
    body = {
        "strings": f"  - sql={sql}\n  - chat={chat}\n",
        "dicts": f"  - {{name: sql, path: {sql}}}\n"
        f"  - {{name: chat, path: {chat}, base_model_name: base}}\n",
        "mapping": f"  sql: {sql}\n  chat: {chat}\n",
        "mapping-of-dicts": f"  sql: {sql}\n  chat: {{path: {chat}, base_model_name: base}}\n",
    }[shape]
    cfg_file = write(tmp_path / "c.yml", f"enable_lora: true\nlora_modules:\n{body}")
    cfg = parse([model_dir, "--config", cfg_file])
    assert [(m.name, m.path) for m in cfg.lora_modules] == [
        ("sql", str(sql.resolve())),
        ("chat", str(chat.resolve())),
    ]
    if shape in ("dicts", "mapping-of-dicts"):
        assert cfg.lora_modules[1].base_model_name == "base"


def test_toml_config_with_all_lora_shapes(model_dir: Path, adapters: dict[str, Path],
                                          tmp_path: Path) -> None:  # fmt: skip
    sql, chat, code = (str(adapters[n]) for n in ("sql", "chat", "code"))
    common = f'model = "{model_dir}"\nenable-lora = true\nmax_num_seqs = 4\n'
    common += 'kv-cache-memory = "1G"\nserved_model_name = ["a", "b"]\n'
    shapes = {
        "strings": f'lora-modules = ["sql={sql}", "chat={chat}", "code={code}"]\n',
        "dicts": f'lora_modules = [{{name = "sql", path = "{sql}"}}, '
        f'{{name = "chat", path = "{chat}", base_model_name = "a"}}, '
        f'{{name = "code", path = "{code}"}}]\n',
        "mapping": f'[lora-modules]\nsql = "{sql}"\nchat = "{chat}"\ncode = "{code}"\n',
    }
    for shape, body in shapes.items():
        cfg = parse(["--config", write(tmp_path / f"{shape}.toml", common + body)])
        assert [m.name for m in cfg.lora_modules] == ["sql", "chat", "code"], shape
        assert cfg.engine.max_num_seqs == 4 and cfg.engine.kv_cache_memory_bytes == 10**9
        assert cfg.served_model_name == ["a", "b"]
    assert cfg.lora_modules[1].base_model_name is None
    cfg = parse(["--config", tmp_path / "dicts.toml"])
    assert cfg.lora_modules[1].base_model_name == "a"


def test_cli_overrides_file(model_dir: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    cfg_file = write(
        tmp_path / "c.yaml",
        f"port: 9001\nmax-loras: 3\nenable-prefix-caching: false\napi-key: filekey\n"
        f"enable-lora: true\nlora-modules: {{sql: {adapters['sql']}}}\n",
    )
    cfg = parse(
        [model_dir, "--config", cfg_file, "--port", "9002", "--enable-prefix-caching",
         "--lora-modules", f"code={adapters['code']}"],
        {"VLLM_API_KEY": "envkey"},
    )  # fmt: skip
    assert cfg.port == 9002
    assert cfg.engine.max_loras == 3  # not on the command line: from the file
    assert cfg.engine.enable_prefix_caching is True
    assert [m.name for m in cfg.lora_modules] == ["code"]  # a list flag replaces the file's
    assert cfg.api_keys == ["filekey"]  # file beats the environment
    # the flag given before --config still wins
    assert parse(["--port", "1", model_dir, "--config", cfg_file]).port == 1


def test_config_from_args_with_a_host_parser(model_dir: Path, tmp_path: Path) -> None:
    """The CLI mounts the flags on a subparser and calls config_from_args itself."""
    parser = argparse.ArgumentParser(prog="loraplex")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(sub.add_parser("serve"))
    cfg_file = write(tmp_path / "c.toml", "port = 7000\nseed = 3\n")
    args = parser.parse_args(["serve", str(model_dir), "--config", str(cfg_file), "--seed", "5"])
    cfg = config_from_args(args, environ={})
    assert (cfg.port, cfg.engine.seed) == (7000, 5)


def test_unknown_config_key(model_dir: Path, tmp_path: Path) -> None:
    cfg_file = write(tmp_path / "c.yaml", "max-lora: 3\n")
    msg = error_of([model_dir, "--config", cfg_file])
    assert "unknown key 'max-lora'" in msg and str(cfg_file) in msg and "max-loras" in msg
    cfg_file = write(tmp_path / "c.toml", "pipeline-parallel-size = 2\n")
    msg = error_of([model_dir, "--config", cfg_file])
    assert "'pipeline-parallel-size'" in msg and str(cfg_file) in msg


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ("port: eighty\n", "'port'"),
        ("port: true\n", "integer"),
        ("dtype: int8\n", "dtype"),
        ("enable-lora: maybe\n", "true or false"),
        ("admin-api-key: 1234\n", "quote it"),
        ("served-model-name: {a: 1}\n", "list of strings"),
        ("lora-modules: 3\n", "'lora-modules'"),
        ("lora-modules: [{name: x}]\n", "'path'"),
        ("max_loras: 1\nmax-loras: 2\n", "same option"),
        ("- just\n- a list\n", "mapping"),
        ("port: [\n", "not valid YAML"),
        ("config: other.yaml\n", "unknown key 'config'"),
    ],
)
def test_bad_config_values(model_dir: Path, tmp_path: Path, text: str, expect: str) -> None:
    cfg_file = write(tmp_path / "c.yaml", text)
    msg = error_of([model_dir, "--config", cfg_file])
    assert expect in msg and str(cfg_file) in msg


def test_config_file_errors_name_the_file(model_dir: Path, tmp_path: Path) -> None:
    assert ".toml" in error_of([model_dir, "--config", write(tmp_path / "c.json", "{}")])
    msg = error_of([model_dir, "--config", tmp_path / "missing.yaml"])
    assert "--config" in msg and "missing.yaml" in msg
    msg = error_of([model_dir, "--config", write(tmp_path / "c.toml", "port = \n")])
    assert "not valid TOML" in msg
    # null and empty files keep the defaults
    assert parse([model_dir, "--config", write(tmp_path / "e.yaml", "")]).port == 8000
    assert parse([model_dir, "--config", write(tmp_path / "n.yaml", "port: null\n")]).port == 8000


def test_file_problems_name_the_key(model_dir: Path, adapters: dict[str, Path],
                                    tmp_path: Path) -> None:  # fmt: skip
    cfg_file = write(tmp_path / "c.yaml", f"lora-modules: {{sql: {adapters['sql']}}}\n")
    msg = error_of([model_dir, "--config", cfg_file])
    assert "key 'lora-modules'" in msg and "--enable-lora" in msg
    cfg_file = write(tmp_path / "d.yaml", "port: 70000\n")
    assert "key 'port'" in error_of([model_dir, "--config", cfg_file])
    cfg_file = write(tmp_path / "e.yaml", f"allowed_lora_roots: {tmp_path / 'nope'}\n")
    assert "key 'allowed_lora_roots'" in error_of([model_dir, "--config", cfg_file])


def test_import_does_not_need_torch() -> None:
    code = "import sys, loraplex.server.args; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- adapter cache tiers


def test_adapter_cache_flags(model_dir: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    e = parse(
        [
            model_dir,
            "--max-cpu-lora-bytes", "2GiB",
            "--disk-cache-dir", tmp_path / "l2",
            "--disk-cache-bytes", "20G",
            "--adapter-eviction-policy", "LRU",
            "--adapter-min-residency", "2.5",
            "--adapter-load-timeout", "30s",
            "--adapter-store-url", store,
        ]
    ).engine  # fmt: skip
    assert e.max_cpu_lora_bytes == 2 * 2**30 and e.disk_cache_bytes == 20 * 10**9
    assert e.disk_cache_dir == str((tmp_path / "l2").resolve())
    assert e.adapter_eviction_policy == "lru"
    assert (e.adapter_min_residency_s, e.adapter_load_timeout_s) == (2.5, 30.0)
    assert e.adapter_store_url == str(store.resolve())
    s3 = parse([model_dir, "--adapter-store-url", "s3://bucket/prefix"]).engine
    assert s3.adapter_store_url == "s3://bucket/prefix"
    d = parse([model_dir]).engine
    assert (d.adapter_eviction_policy, d.disk_cache_dir, d.adapter_store_url) == (
        "hybrid",
        None,
        None,
    )


def test_adapter_cache_flags_in_a_config_file(model_dir: Path, tmp_path: Path) -> None:
    cfg_file = write(
        tmp_path / "serve.yaml",
        f"""
model: {model_dir}
max-cpu-lora-bytes: 512MiB
disk-cache-dir: {tmp_path / "l2"}
disk_cache_bytes: 1GiB
adapter-eviction-policy: fifo
adapter-min-residency: 1
""",
    )
    e = parse(["--config", cfg_file]).engine
    assert (e.max_cpu_lora_bytes, e.disk_cache_bytes) == (512 * 2**20, 2**30)
    assert e.adapter_eviction_policy == "fifo" and e.adapter_min_residency_s == 1.0


@pytest.mark.parametrize(
    "argv",
    [
        ["--adapter-eviction-policy", "mru"],
        ["--adapter-min-residency", "-1"],
        ["--adapter-min-residency", "soon"],
        ["--max-cpu-lora-bytes", "lots"],
        ["--disk-cache-bytes", "lots"],
        ["--adapter-store-url", "ftp://host/x"],
        ["--adapter-store-url", "s3://"],
    ],
)
def test_adapter_cache_flag_syntax_errors_exit_2(
    model_dir: Path, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse([model_dir, *argv])
    assert info.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_adapter_cache_flag_semantic_errors(model_dir: Path, tmp_path: Path) -> None:
    assert "--disk-cache-dir: needs --disk-cache-bytes" in error_of(
        [model_dir, "--disk-cache-dir", tmp_path / "l2"]
    )
    assert "--disk-cache-bytes: needs --disk-cache-dir" in error_of(
        [model_dir, "--disk-cache-bytes", "1G"]
    )
    assert "--max-cpu-lora-bytes: must be >= 1" in error_of(
        [model_dir, "--max-cpu-lora-bytes", "0"]
    )
    assert "--adapter-store-url: " in error_of(
        [model_dir, "--adapter-store-url", tmp_path / "missing"]
    )
    (tmp_path / "file").write_text("x")
    assert "is not a directory" in error_of(
        [model_dir, "--disk-cache-dir", tmp_path / "file", "--disk-cache-bytes", "1G"]
    )


def test_lora_module_warm_policy_and_store_uris(
    model_dir: Path, adapters: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a = next(iter(adapters.values()))
    spec = json.dumps({"name": "x", "path": str(a), "warm": "device-preferred"})
    cfg = parse([model_dir, "--enable-lora", "--lora-modules", spec, "s3m=s3://bucket/p/s3m"])
    assert [(m.name, m.warm) for m in cfg.lora_modules] == [
        ("x", "device-preferred"),
        ("s3m", "on-demand"),
    ]
    assert cfg.lora_modules[1].path == "s3://bucket/p/s3m"  # checked by the store at load time
    bad = json.dumps({"name": "x", "path": str(a), "warm": "always"})
    with pytest.raises(SystemExit) as e:
        parse([model_dir, "--enable-lora", "--lora-modules", bad])
    assert e.value.code == 2 and "'warm' must be one of" in capsys.readouterr().err


def test_registry_flags(model_dir: Path, tmp_path: Path) -> None:
    key = tmp_path / "pub.pem"
    key.write_text("-----BEGIN PUBLIC KEY-----\n")
    c = parse([model_dir, "--registry-url", "sqlite:///r.db", "--registry-poll-interval", "0.5",
               "--require-signatures", "--trusted-key", key, "--swap-eviction-delay", "5",
               "--allowed-store-prefixes", "s3://b/adapters/"])  # fmt: skip
    assert c.registry_url == "sqlite:///r.db" and c.registry_poll_s == 0.5
    assert c.require_signatures and c.trusted_keys == [str(key.resolve())]
    assert c.swap_eviction_delay_s == 5 and c.allowed_store_prefixes == ["s3://b/adapters/"]
    assert parse([model_dir]).registry_url is None  # in memory
    env = {"LORAPLEX_REGISTRY_URL": "postgresql+psycopg://db/reg"}
    assert parse([model_dir], env).registry_url == "postgresql+psycopg://db/reg"
    assert parse([model_dir, "--registry-url", "sqlite://"], env).registry_url == "sqlite://"


def test_bad_registry_flags(model_dir: Path, tmp_path: Path) -> None:
    assert "--trusted-key" in error_of([model_dir, "--require-signatures"])
    assert "not a file" in error_of([model_dir, "--trusted-key", tmp_path / "missing.pem"])
    assert "s3://" in error_of([model_dir, "--allowed-store-prefixes", "bucket/x"])
    assert "--registry-poll-interval" in error_of([model_dir, "--registry-poll-interval", "0"])


# --------------------------------------------------------------------------- scheduling


def test_scheduling_flags(model_dir: Path) -> None:
    e = parse([model_dir, "--scheduling-policy", "FAIR", "--slo-classes", "gold=8,batch=1",
               "--default-slo-class", "batch", "--tenant-slo-classes", "acme=gold",
               "--lora-rank-slot-budgets", "8:6,64:2", "--max-lora-device-fraction", "0.25",
               "--max-loras", "8"]).engine  # fmt: skip
    assert e.scheduling_policy == "fair"
    assert e.slo_class_weights() == (("gold", 8.0), ("batch", 1.0))
    assert e.default_slo_class == "batch" and e.tenant_classes() == {"acme": "gold"}
    assert e.rank_slot_budgets() == {8: 6, 64: 2} and e.max_lora_device_fraction == 0.25
    assert parse([model_dir, "--scheduling-policy", "priority"]).engine.scheduling_policy == (
        "priority"
    )
    d = parse([model_dir]).engine
    assert (d.scheduling_policy, d.lora_rank_slot_budgets, d.max_lora_device_fraction) == (
        "fcfs", None, None)  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--scheduling-policy", "lifo"], ["--scheduling-policy", "fcfs, priority, fair"]),
        (["--slo-classes", "gold"], ["--slo-classes", "NAME=WEIGHT"]),
        (["--slo-classes", "gold=0,standard=1"], ["--slo-classes", "positive"]),
        (["--slo-classes", "gold=1,gold=2"], ["--slo-classes", "twice"]),
        (["--default-slo-class", "silver"], ["--default-slo-class", "--slo-classes", "silver"]),
        (["--tenant-slo-classes", "acme=silver"], ["--tenant-slo-classes", "silver"]),
        (["--tenant-slo-classes", "acme"], ["--tenant-slo-classes", "TENANT=CLASS"]),
        (["--lora-rank-slot-budgets", "8:0,64:1"], ["--lora-rank-slot-budgets", "positive"]),
        (["--lora-rank-slot-budgets", "8:2"], ["--lora-rank-slot-budgets", "--max-lora-rank"]),
        (["--lora-rank-slot-budgets", "64:20"], ["--lora-rank-slot-budgets", "--max-loras"]),
        (["--max-lora-device-fraction", "1.5"], ["--max-lora-device-fraction"]),
        (["--max-lora-device-fraction", "0"], ["--max-lora-device-fraction"]),
    ],
)
def test_scheduling_flag_errors(
    model_dir: Path, argv: list[str], words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Syntax errors exit 2 from argparse; rules across flags raise ServeConfigError; both
    name the flag and the problem."""
    try:
        parse([model_dir, *argv])
    except SystemExit as e:
        assert e.code == 2
        msg = capsys.readouterr().err
    except ServeConfigError as e:
        msg = str(e)
    else:
        pytest.fail(f"{argv} accepted")
    for w in words:
        assert w in msg, (w, msg)


def test_serve_leaves_one_core_to_the_http_side_unless_told() -> None:
    """serve on CPU without --num-threads: torch's threads minus one (at least one); an
    explicit --num-threads, or a CUDA device, is kept as given."""
    import torch

    from loraplex.config import EngineConfig
    from loraplex.server.app import reserve_http_core

    n = torch.get_num_threads()
    got = reserve_http_core(EngineConfig(model="m", device="cpu"))
    assert got.num_threads == (n - 1 if n >= 2 else None)
    assert reserve_http_core(EngineConfig(model="m", device="cpu", num_threads=3)).num_threads == 3
    assert reserve_http_core(EngineConfig(model="m", device="cuda")).num_threads is None
