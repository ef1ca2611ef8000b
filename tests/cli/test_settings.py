"""One declaration per setting (loraplex.config.fields, read by loraplex.config.settings): a
field's metadata yields its flag, its config-file key, its bounds check and its place in the
constructor call, for ``serve`` and ``route`` alike, and both read config files with one loader."""

from __future__ import annotations

import argparse
import ast
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import pytest

from loraplex.config import EngineConfig, ServerConfig
from loraplex.config.fields import FieldError, Setting, check_fields, setting, setting_of
from loraplex.config.settings import Settings
from loraplex.router.cli import RouteConfigError, parse_route_args, route_settings
from loraplex.router.config import RouterConfig
from loraplex.router.homes import HomeSettings
from loraplex.router.scoring import Thresholds, Weights
from loraplex.server.args import ServeConfigError, parse_serve_args, serve_settings

# --------------------------------------------------------------------------- a throwaway config


@dataclass
class Inner:
    depth: int = field(default=2, metadata=setting("--depth", ge=0, help="depth ({default})"))


@dataclass
class Toy:
    size: int = field(
        default=3,
        metadata=setting("--size", "--toy-size", ge=1, le=10, help="size (default: {default})"),
    )
    name: str | None = field(
        default=None, metadata=setting("--name", env=("TOY_NAME",), help="name (default: {env})")
    )
    tags: list[str] = field(default_factory=list, metadata=setting("--tag", nargs=None))
    fast: bool = field(default=True, metadata=setting("--fast", cli_default=False))
    ratio: float = field(default=0.5, metadata=setting("--ratio", gt=0, group="tuning"))
    inner: Inner = field(default_factory=Inner)  # no setting: its settings are Toy's
    hidden: int = 5  # no setting: no flag, no key

    def validate(self) -> None:
        check_fields(self)
        check_fields(self.inner)


class ToyError(ValueError):
    pass


def toy(argv: list[str], env: dict[str, str] | None = None) -> Toy:
    settings = Settings(Toy, error=ToyError)
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser)
    values = settings.resolve(parser.parse_args(argv), env or {})
    config: Toy = values.build()
    try:
        config.validate()
    except FieldError as e:
        raise values.explain(e) from None
    return config


def test_a_field_with_metadata_is_a_flag_and_a_key(tmp_path: Path) -> None:
    assert toy([]) == Toy(fast=False)  # the command's default where it has its own
    got = toy(["--toy-size", "4", "--name", "n", "--tag", "a", "--tag", "b", "--fast",
               "--ratio", "2", "--depth", "7"])  # fmt: skip
    assert got == Toy(size=4, name="n", tags=["a", "b"], fast=True, ratio=2.0, inner=Inner(7))
    cfg = tmp_path / "toy.yaml"
    cfg.write_text("toy_size: 5\nname: file\ntag: [x]\nfast: yes\nratio: '0.25'\ndepth: 1\n")
    got = toy(["--config", str(cfg)])
    assert got == Toy(size=5, name="file", tags=["x"], fast=True, ratio=0.25, inner=Inner(1))
    with pytest.raises(SystemExit):
        toy(["--hidden", "6"])  # a field without a setting is not a flag
    cfg.write_text("hidden: 6\n")
    with pytest.raises(ToyError, match="unknown key 'hidden'"):
        toy(["--config", str(cfg)])


def test_precedence_flag_file_environment_default(tmp_path: Path) -> None:
    cfg = tmp_path / "toy.toml"
    cfg.write_text('name = "file"\n')
    env = {"TOY_NAME": "env"}
    assert toy([], env).name == "env"
    assert toy(["--config", str(cfg)], env).name == "file"
    assert toy(["--config", str(cfg), "--name", "flag"], env).name == "flag"
    assert toy(["--name", "flag", "--config", str(cfg)], env).name == "flag"
    assert toy([], {"TOY_NAME": "  "}).name is None  # blank: unset


def test_help_comes_from_the_declaration() -> None:
    parser = argparse.ArgumentParser()
    Settings(Toy, error=ToyError).add_arguments(parser)
    text = parser.format_help()
    assert "--size SIZE, --toy-size SIZE" in text and "size (default: 3)" in text
    assert "name (default: $TOY_NAME)" in text and "depth (2)" in text
    assert "tuning:" in text and "--ratio" in text.split("tuning:")[1]
    assert "--hidden" not in text


def test_a_command_may_offer_some_settings_only() -> None:
    """``only``: a command with a few of a config's settings, each as declared (``generate``)."""
    settings = Settings(Toy, error=ToyError, only=("size", "depth"))
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser, config_file=False)
    text = parser.format_help()
    assert "--toy-size" in text and "--depth" in text
    assert "--name" not in text and "--config" not in text
    values = settings.resolve(parser.parse_args(["--size", "4"]), {})
    assert (values["size"], values["depth"]) == (4, 2)
    with pytest.raises(TypeError, match=r"no settings \['nope'\]"):
        Settings(Toy, error=ToyError, only=("size", "nope"))


def test_bounds_errors_name_the_flag_or_key(tmp_path: Path) -> None:
    with pytest.raises(ToyError, match=r"^--size: must be between 1 and 10, got 11$"):
        toy(["--toy-size", "11"])
    with pytest.raises(ToyError, match=r"^--ratio: must be > 0, got 0.0$"):
        toy(["--ratio", "0"])
    cfg = tmp_path / "toy.yaml"
    cfg.write_text("depth: -1\n")
    with pytest.raises(ToyError, match=r"^key 'depth' in '.*toy.yaml': must be >= 0, got -1$"):
        toy(["--config", str(cfg)])
    with pytest.raises(FieldError, match=r"^invalid Toy.size: must be between 1 and 10, got 0$"):
        Toy(size=0).validate()  # the Python API names the field


def test_field_errors_name_fields_in_python_and_flags_on_the_command_line(
    tmp_path: Path,
) -> None:
    with pytest.raises(FieldError) as info:
        EngineConfig(model="m", max_loras=8, max_cpu_loras=2).validate()
    assert str(info.value) == (
        "invalid EngineConfig.max_cpu_loras: must be >= max_loras (8), got 2"
    )
    assert info.value.name == "max_cpu_loras"
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ServeConfigError) as serve:
        parse_serve_args([str(tmp_path), "--max-cpu-loras", "2"], environ={})
    assert str(serve.value) == "--max-cpu-loras: must be >= --max-loras (8), got 2"


# --------------------------------------------------------------------------- serve and route

SERVE_SAMPLES = {  # settings whose values have a syntax of their own: one valid value each
    "model": "MODEL",
    "dtype": "float16",
    "device": "cpu",
    "quantization": "int4",
    "quantization_group_size": "64",
    "adapter_eviction_policy": "lru",
    "disk_cache_dir": "DIR",
    "adapter_store_url": "s3://bucket/prefix",
    "host": "0.0.0.0",
    "served_model_name": "alias",
    "lora_modules": "a=ADAPTER",
    "api_keys": "k1",
    "admin_api_key": "adm",
    "metrics_api_key": "scrape",
    "allowed_lora_roots": "DIR",
    "log_level": "debug",
    "registry_url": "sqlite://",
    "trusted_keys": "KEY",
    "allowed_store_prefixes": "s3://bucket/adapters/",
    "tokenizer": "DIR",
    "revision": "v1",
    "tokenizer_revision": "v2",
    "download_dir": "DIR",
    "generation_config": "vllm",
    "override_generation_config": '{"temperature": 0.5}',
    "speculative_config": '{"method": "ngram", "num_speculative_tokens": 4}',
    "chat_template": "{{ messages[0].content }}",
    "tool_call_parser": "hermes",
    "hf_token": "hf_secret",
    "log_format": "json",
    "root_path": "/api",
    "ssl_keyfile": "KEY",
    "ssl_certfile": "KEY",
    "ssl_ca_certs": "KEY",
    "allowed_origins": '["*"]',
    "allowed_methods": '["GET"]',
    "allowed_headers": '["X-Y"]',
    "scheduling_policy": "fair",
    "slo_classes": "gold=8,standard=2,batch=1",
    "default_slo_class": "gold",
    "tenant_slo_classes": "acme=gold",
    "lora_rank_slot_budgets": "8:4,64:2",
    "max_cpu_loras": "40",  # at least --max-loras (8)
    "structured_outputs_whitespace": "bounded",
    "tensor_parallel_size": "2",
    "nnodes": "2",
    "node_rank": "1",
    "master_addr": "10.0.0.2",
    "master_port": "29500",
    "disable_access_log_for_endpoints": "/health,/metrics,/ping",
}
SERVE_NEEDS = {  # cross-field rules: what else a setting needs to be valid
    "nnodes": ["--tensor-parallel-size", "2", "--master-port", "29500"],
    "node_rank": ["--nnodes", "2", "--tensor-parallel-size", "2", "--master-port", "29500"],
    "enable_auto_tool_choice": ["--tool-call-parser", "hermes"],
    "ssl_keyfile": ["--ssl-certfile", "KEY"],
    "ssl_certfile": ["--ssl-keyfile", "KEY"],
    "disk_cache_dir": ["--disk-cache-bytes", "1G"],
    "disk_cache_bytes": ["--disk-cache-dir", "DIR"],
    "lora_modules": ["--enable-lora"],
    "require_signatures": ["--trusted-key", "KEY"],
    "enable_ssl_refresh": ["--ssl-certfile", "KEY", "--ssl-keyfile", "KEY"],
}
ROUTE_SAMPLES = {
    "replicas": "http://r9:8000",
    "replicas_file": "FILE",
    "replicas_dns": "replicas.svc:8000",
    "policy": "least-loaded",
    "weights": "device=2",
    "replica_api_key": "k",
    "status_api_key": "s",
    "push_api_key": "p",
    "push_targets": "holders",
    "host": "0.0.0.0",
    "log_level": "debug",
}


def _fill(text: str, paths: dict[str, str]) -> str:
    """'DIR' or 'NAME=DIR' with the placeholder replaced by a real path."""
    head, sep, tail = text.rpartition("=")
    return head + sep + paths.get(tail, tail)


def _sample(spec: Any, samples: dict[str, str], paths: dict[str, str]) -> tuple[str | None, Any]:
    """A valid value other than the default: the flag's text (None: a bare boolean flag) and
    the config-file value."""
    default = spec.default()
    if spec.kind == "bool":
        return None, not default
    if spec.kind == "int":
        number = int(samples[spec.name]) if spec.name in samples else (default or 0) + 7
        return str(number), number
    if spec.kind == "float":
        le = spec.setting.le
        base = 0.0 if default is None else default  # None: no limit unless set
        value = (base + le) / 2 if le is not None else base + 0.5
        return str(value), value
    text = _fill(samples[spec.name], paths)
    if spec.kind == "keyed":
        key, value = text.split("=")
        return text, {key: float(value)}
    return text, [text] if spec.kind == "list" else text


def _argvs(spec: Any, text: str | None) -> list[list[str]]:
    """The command line setting it, once per flag spelling."""
    if text is None:
        flag = spec.flag
        return [[flag] if not spec.default() else ["--no-" + flag[2:]]]
    return [[flag, text] for flag in spec.setting.flags]


def _keys(spec: Any) -> set[str]:
    """Every config-file key naming it, dashes and underscores (a short flag's too: ``q``)."""
    names = [*(f.lstrip("-") for f in spec.setting.flags), *spec.setting.keys]
    return {k for n in names for k in (n, n.replace("-", "_"))}


def _field(config: Any, name: str) -> Any:
    """Field ``name`` of a ServerConfig/RouterConfig or of the config it nests."""
    nested = ("engine", "thresholds", "homes")
    for part in (config, *(getattr(config, n, None) for n in nested)):
        if part is not None and name in {f.name for f in fields(part)}:
            return getattr(part, name)
    raise AssertionError(f"no field {name}")


@pytest.fixture
def paths(tmp_path: Path) -> dict[str, str]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (tmp_path / "pub.pem").write_text("key")
    (tmp_path / "replicas.txt").write_text("http://r:1\n")
    return {"MODEL": str(model), "DIR": str(tmp_path), "ADAPTER": str(adapter),
            "KEY": str(tmp_path / "pub.pem"), "FILE": str(tmp_path / "replicas.txt")}  # fmt: skip


def test_every_serve_setting_is_reachable_by_flag_and_by_key(
    paths: dict[str, str], tmp_path: Path
) -> None:
    specs = serve_settings().specs
    declared = {f.name for cls in (EngineConfig, ServerConfig) for f in fields(cls)
                if (s := setting_of(f)) is not None and s.flags}  # fmt: skip
    assert set(specs) == declared and len(specs) >= 35
    cfg = tmp_path / "c.yaml"
    for name, spec in specs.items():
        text, file_value = _sample(spec, SERVE_SAMPLES, paths)
        base = [] if name == "model" else [paths["MODEL"]]
        base += [_fill(a, paths) for a in SERVE_NEEDS.get(name, [])]
        by_flag = [parse_serve_args(base + argv, environ={}) for argv in _argvs(spec, text)]
        assert all(c == by_flag[0] for c in by_flag), name
        assert _field(by_flag[0], name) != spec.default(), name
        for key in _keys(spec):
            cfg.write_text(json.dumps({key: file_value}))  # JSON is YAML: types stay exact
            assert parse_serve_args([*base, "--config", str(cfg)], environ={}) == by_flag[0], key


def test_every_route_setting_is_reachable_by_flag_and_by_key(
    paths: dict[str, str], tmp_path: Path
) -> None:
    specs = route_settings().specs
    declared = {f.name for cls in (RouterConfig, Thresholds, HomeSettings) for f in fields(cls)
                if (s := setting_of(f)) is not None and s.flags}  # fmt: skip
    assert set(specs) == declared and {"replicas", "weights", "max_kv_usage"} <= declared
    cfg = tmp_path / "r.yaml"
    for name, spec in specs.items():
        text, file_value = _sample(spec, ROUTE_SAMPLES, paths)
        base = ["--replicas-dns", "other:1"] if name == "replicas" else ["--replica", "a:1"]
        by_flag = [parse_route_args(base + argv, environ={}) for argv in _argvs(spec, text)]
        assert all(c == by_flag[0] for c in by_flag), name
        assert _field(by_flag[0], name) != spec.default(), name
        for key in _keys(spec):
            cfg.write_text(json.dumps({key: file_value}))
            assert parse_route_args([*base, "--config", str(cfg)], environ={}) == by_flag[0], key


def _out_of_bounds(s: Setting) -> int | float | None:
    """A number just outside the declared bounds (None: no bounds)."""
    if s.le is not None:
        return s.le + 1
    if s.ge is not None:
        return s.ge - 1
    return s.gt


def test_serve_bounds_errors_name_the_flag_or_the_key(
    paths: dict[str, str], tmp_path: Path
) -> None:
    specs = serve_settings().specs
    bounded = {n: s for n, s in specs.items() if _out_of_bounds(s.setting) is not None}
    assert {"port", "max_loras", "kv_cache_memory_bytes", "registry_poll_s"} <= set(bounded)
    cfg = tmp_path / "c.yaml"
    for name, spec in bounded.items():
        bad = _out_of_bounds(spec.setting)
        assert bad is not None
        base = [paths["MODEL"], *(_fill(a, paths) for a in SERVE_NEEDS.get(name, []))]
        key = spec.flag[2:]
        cfg.write_text(json.dumps({key: bad}))
        with pytest.raises(ServeConfigError) as info:
            parse_serve_args([*base, "--config", str(cfg)], environ={})
        assert str(info.value).startswith(f"key {key!r} in {str(cfg)!r}: must be "), name
        if bad >= 0 or spec.setting.parse is None:  # '-1' is not a number of seconds
            with pytest.raises(ServeConfigError) as info:
                parse_serve_args([*base, spec.flag, str(bad)], environ={})
            assert str(info.value).startswith(f"{spec.flag}: must be "), name


@pytest.mark.parametrize(
    "cls", [EngineConfig, ServerConfig, RouterConfig, Thresholds, Weights, HomeSettings]
)
def test_validate_checks_every_declared_bound(cls: type) -> None:
    base: dict[str, Any] = {
        EngineConfig: {"model": "m"},
        ServerConfig: {"engine": EngineConfig(model="m")},
        RouterConfig: {"replicas": ["http://a:1"]},
    }.get(cls, {})
    checked = 0
    for f in fields(cls):
        s = setting_of(f)
        bad = _out_of_bounds(s) if s is not None else None
        if bad is None:
            continue
        with pytest.raises(FieldError) as info:
            cls(**{**base, f.name: bad}).validate()
        assert info.value.name == f.name
        assert str(info.value).startswith(f"invalid {cls.__name__}.{f.name}: must be ")
        checked += 1
    assert checked >= 3


BAD_FILES = [
    ("c.json", "{}", "must end in .yaml, .yml or .toml"),
    ("missing.yaml", None, "cannot read"),
    ("c.yaml", "port: [\n", "is not valid YAML"),
    ("c.toml", "port = \n", "is not valid TOML"),
    ("c.yaml", "- a list\n", "must hold a mapping"),
]


@pytest.mark.parametrize(("name", "text", "expect"), BAD_FILES)
def test_serve_and_route_share_one_config_file_loader(
    paths: dict[str, str], tmp_path: Path, name: str, text: str | None, expect: str
) -> None:
    cfg = tmp_path / name
    if text is not None:
        cfg.write_text(text)
    with pytest.raises(ServeConfigError) as serve:
        parse_serve_args([paths["MODEL"], "--config", str(cfg)], environ={})
    with pytest.raises(RouteConfigError) as route:
        parse_route_args(["--replica", "a:1", "--config", str(cfg)], environ={})
    assert str(serve.value) == str(route.value)  # one reader, one message
    msg = str(serve.value)
    assert msg.startswith("--config: ") and repr(str(cfg)) in msg and expect in msg


def test_unknown_and_duplicate_keys_in_both_commands(paths: dict[str, str], tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max-retrys: 1\n")
    with pytest.raises(RouteConfigError, match=r"unknown setting 'max-retrys'.*'max-retries'\?"):
        parse_route_args(["--replica", "a:1", "--config", str(cfg)], environ={})
    cfg.write_text("max-lora: 1\n")
    with pytest.raises(ServeConfigError, match=r"unknown key 'max-lora'.*'max-loras'\?"):
        parse_serve_args([paths["MODEL"], "--config", str(cfg)], environ={})
    cfg.write_text("max_waiting: 1\nmax-waiting: 2\n")
    with pytest.raises(
        RouteConfigError, match=r"max-waiting: sets the same option as .*max_waiting"
    ):
        parse_route_args(["--replica", "a:1", "--config", str(cfg)], environ={})
    with pytest.raises(
        ServeConfigError, match=r"'max-waiting'.* sets the same option as .*'max_waiting'"
    ):
        parse_serve_args([paths["MODEL"], "--config", str(cfg)], environ={})


def test_route_weights_merge_file_then_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "r.toml"
    cfg.write_text('replicas = "a:1"\n[weights]\ndevice = 3\nkv-usage = 0.2\n')
    c = parse_route_args(["--config", str(cfg), "--weight", "kv_usage=0.7"], environ={})
    assert c.weights == Weights(device=3.0, kv_usage=0.7) and c.replicas == ["http://a:1"]
    cfg.write_text('replicas = "a:1"\n[weights]\ncolour = 1\n')
    with pytest.raises(RouteConfigError, match="unknown weight 'colour'"):
        parse_route_args(["--config", str(cfg)], environ={})


def test_every_environment_variable_is_declared() -> None:
    """Each ``LORAPLEX_*`` name the source mentions is declared once: a setting's ``env=``, or
    ``loraplex.config.ENVIRONMENT`` (read through ``env_value``, which refuses other names)."""
    import re

    from loraplex.config import ENV_LORA_CPU_KERNEL, ENVIRONMENT, env_value, lora_cpu_kernel_enabled

    src = Path(__file__).resolve().parents[1] / "src" / "loraplex"
    named = {
        n for p in src.rglob("*.py") for n in re.findall(r"LORAPLEX_[A-Z0-9_]+", p.read_text())
    }
    by_setting = {v for cls in (EngineConfig, ServerConfig, RouterConfig) for f in fields(cls)
                  if (s := setting_of(f)) is not None for v in s.env}  # fmt: skip
    assert named - by_setting - set(ENVIRONMENT) == set()
    assert len(set(ENVIRONMENT)) == len(ENVIRONMENT)
    assert env_value("LORAPLEX_HOME", {"LORAPLEX_HOME": " /x "}) == "/x"
    assert env_value("LORAPLEX_HOME", {"LORAPLEX_HOME": "  "}) is None
    with pytest.raises(KeyError, match="not declared"):
        env_value("LORAPLEX_NOPE", {})
    assert lora_cpu_kernel_enabled({}) and lora_cpu_kernel_enabled({ENV_LORA_CPU_KERNEL: "1"})
    assert not lora_cpu_kernel_enabled({ENV_LORA_CPU_KERNEL: " 0 "})


def test_settings_module_imports_nothing_of_loraplex() -> None:
    """The config layer's base (the declarations and the command table): the config objects and
    the router build on it, never the reverse."""
    config = Path(__file__).resolve().parents[2] / "src" / "loraplex" / "config"
    for src in (config / "fields.py", config / "settings.py"):
        tree = ast.parse(src.read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not {m for m in imported if m.split(".")[0] == "loraplex"} - {
            "loraplex.config.fields"
        }
        assert not imported & {"torch", "numpy", "fastapi", "httpx"}
