"""Flags and config file of ``loraplex serve MODEL_DIR`` (vLLM's flag names, so a vLLM user
only changes the command name).

Every flag, config key, environment fallback, bound and default is declared once, on the
``EngineConfig``/``ServerConfig`` field it sets (see :mod:`loraplex.config.fields`); this module
adds MODEL_DIR and the rules that need the file system or the command line as a whole.

Precedence, per setting: explicit command-line flag > ``--config`` file > environment (API keys,
registry URL) > built-in default. Built-in defaults are the dataclass defaults, except
``enable_lora``, which is off unless ``--enable-lora`` (as in vLLM).

Every semantic problem raises ``ServeConfigError`` with one message naming the flag or config
key; syntax errors on the command line are argparse's (exit code 2).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from loraplex.config import LoRAModule, ServerConfig, parse_byte_size
from loraplex.config.fields import FieldError
from loraplex.config.settings import Settings, Values
from loraplex.hub import HubError, is_hub_id, resolve_hub_dir
from loraplex.lora.peft.files import CONFIG_NAME
from loraplex.server.vllm_compat import add_vllm_compat_arguments, file_key, normalize_argv

__all__ = [
    "ServeConfigError",
    "add_serve_arguments",
    "config_from_args",
    "normalize_argv",
    "parse_byte_size",
    "parse_serve_args",
    "serve_settings",
]


class ServeConfigError(ValueError):
    """A problem with ``loraplex serve``'s flags or config file; the message names the flag/key."""


def serve_settings() -> Settings:
    """``serve``'s settings: every declared field of ServerConfig and its EngineConfig."""
    return Settings(ServerConfig, error=ServeConfigError, other_key=file_key)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``serve``'s vLLM-compatible flags to ``parser``.

    Every flag defaults to ``argparse.SUPPRESS``, so the namespace holds only what was given
    explicitly; ``config_from_args`` merges it with ``--config`` and the built-in defaults.
    """
    parser.add_argument(
        "model_dir",
        nargs="?",
        default=argparse.SUPPRESS,
        metavar="MODEL_DIR",
        help="Hugging Face-format model directory (holds config.json) or hub id (org/name)",
    )
    serve_settings().add_arguments(parser)
    add_vllm_compat_arguments(parser)
    if parser.epilog is None:
        parser.epilog = (
            "Every other flag of `vllm serve` is accepted where its value is what loraplex "
            "does anyway (--pipeline-parallel-size 1, --enforce-eager, --kv-cache-dtype auto, "
            "...) and otherwise refused with 'not supported: FLAG'. Underscore spellings "
            "(--max_model_len) work as in vLLM."
        )


def _resolve(path: str) -> Path:
    return Path(path).expanduser().resolve()


class _Hub:
    """Hub ids of one command line resolved to local snapshot directories (``--download-dir``,
    ``--hf-token`` and the environment's ``HF_*`` variables)."""

    def __init__(self, values: Values, environ: Mapping[str, str]) -> None:
        self.values = values
        self.environ = environ

    def local(
        self, path: str, name: str, *, revision: str | None = None, adapter: bool = False
    ) -> str:
        """``path`` itself if it exists locally or is no hub id, else its snapshot directory;
        ServeConfigError naming setting ``name`` (or MODEL_DIR) if it cannot be resolved."""
        if _resolve(path).exists() or not is_hub_id(path):
            return path
        try:
            return str(
                resolve_hub_dir(
                    path,
                    environ=self.environ,
                    revision=revision,
                    download_dir=self.values["download_dir"],
                    token=self.values["hf_token"],
                    adapter=adapter,
                )
            )
        except HubError as e:
            where = name if name == "MODEL_DIR" else self.values.where(name)
            raise ServeConfigError(f"{where}: {e}") from None


def _chat_template(values: Values) -> str | None:
    """``--chat-template``'s text: a file's contents, or the template given inline (vLLM's
    rule: a value that names no file and holds no Jinja is a missing file)."""
    given = values["chat_template"]
    if given is None:
        return None
    path = Path(given).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise values.error("chat_template", f"cannot read {given!r}: {e}") from None
    if not any(c in given for c in "{}\n"):
        raise values.error("chat_template", f"{given!r} is neither a file nor a Jinja template")
    return str(given)


def _what(path: Path) -> str:
    return "does not exist" if not path.exists() else "is not a directory"


def config_from_args(
    args: argparse.Namespace, *, environ: Mapping[str, str] | None = None
) -> ServerConfig:
    """Build and validate the ServerConfig from ``add_serve_arguments``' namespace.

    Merges explicit flags > ``--config`` file > environment > built-in defaults, checks the
    model directory (config.json), each ``--lora-modules`` directory (adapter_config.json) and
    each ``--allowed-lora-roots`` directory, and resolves those paths (relative paths are
    relative to the working directory, also in the file). The served name defaults to MODEL_DIR
    as given, so clients use the same name as with vLLM. Raises ServeConfigError naming the
    flag or key at fault.
    """
    env = os.environ if environ is None else environ
    values = serve_settings().resolve(args, env)

    # MODEL_DIR: positional or --model (both only if equal), else the file's 'model'
    positional = getattr(args, "model_dir", None)
    option = getattr(args, "model", None)
    if positional is not None and option is not None and _resolve(positional) != _resolve(option):
        raise ServeConfigError(
            f"MODEL_DIR {positional!r} and --model {option!r} differ; give the model once"
        )
    model = positional if positional is not None else values["model"]
    model_where = "MODEL_DIR" if positional is not None else values.where("model")
    if model is None:
        raise ServeConfigError(
            "MODEL_DIR is required: loraplex serve MODEL_DIR [flags] (put MODEL_DIR first: "
            "--lora-modules, --served-model-name, --api-key and --allowed-lora-roots take "
            "every word after them)"
        )
    hub = _Hub(values, env)
    local_model = hub.local(
        model, "MODEL_DIR" if positional is not None else "model", revision=values["revision"]
    )
    values["model"] = local_model
    if values["tokenizer"] is not None:
        values["tokenizer"] = hub.local(
            values["tokenizer"], "tokenizer", revision=values["tokenizer_revision"]
        )
    values["chat_template"] = _chat_template(values)
    values["served_model_name"] = list(values["served_model_name"]) or [model]

    config: ServerConfig = values.build()
    try:
        config.validate()
    except FieldError as e:
        raise _explain(values, config, e) from None
    modules = [
        replace(m, path=hub.local(m.path, "lora_modules", adapter=True))
        if "://" not in m.path
        else m
        for m in config.lora_modules
    ]
    config = replace(config, lora_modules=modules)
    return _check_paths(values, config, model, local_model, model_where)


def _explain(values: Values, config: ServerConfig, e: FieldError) -> ServeConfigError:
    """``validate()``'s error named by flag or key, with a hint where LoRA is off."""
    msg = str(values.explain(e))
    if e.name == "lora_modules" and not config.engine.enable_lora:
        if values.given("enable_lora"):
            msg += f" (it is turned off by {values.where('enable_lora')})"
        elif values.given("lora_modules") and not values.where("lora_modules").startswith("--"):
            msg += " (or set 'enable-lora: true' in the config file)"
    return ServeConfigError(msg)


def _check_paths(
    values: Values, config: ServerConfig, model: str, local_model: str, model_where: str
) -> ServerConfig:
    """The config with every local path checked and resolved (ServeConfigError naming it);
    ``model`` as given, ``local_model`` its directory (a hub snapshot for a hub id)."""
    model_dir = _resolve(local_model)
    if not model_dir.is_dir():
        raise ServeConfigError(f"{model_where}: {model!r} {_what(model_dir)}")
    if not (model_dir / "config.json").is_file():
        raise ServeConfigError(
            f"{model_where}: {model!r} has no config.json (expected a Hugging Face-format "
            "model directory)"
        )
    engine = config.engine
    tokenizer = engine.tokenizer
    if tokenizer is not None:
        tok_dir = _resolve(tokenizer)
        if not tok_dir.is_dir():
            raise values.error("tokenizer", f"{tokenizer!r} {_what(tok_dir)}")
        tokenizer = str(tok_dir)
    generation = engine.generation_config
    if generation not in ("auto", "vllm"):
        gen_dir = _resolve(generation)
        if not (gen_dir / "generation_config.json").is_file():
            raise values.error(
                "generation_config",
                f"{generation!r} is not a directory holding generation_config.json (or use "
                "auto or vllm)",
            )
        generation = str(gen_dir)
    modules = []
    for m in config.lora_modules:
        if "://" in m.path and not m.path.startswith("file://"):  # object store: checked at load
            modules.append(m)
            continue
        adapter_dir = _resolve(m.path.removeprefix("file://"))
        if not adapter_dir.is_dir():
            problem = f"adapter {m.name!r}: {m.path!r} {_what(adapter_dir)}"
            raise values.error("lora_modules", problem)
        if not (adapter_dir / CONFIG_NAME).is_file():
            raise values.error(
                "lora_modules",
                f"adapter {m.name!r}: {m.path!r} has no adapter_config.json (expected a PEFT "
                "adapter directory)",
            )
        modules.append(LoRAModule(m.name, str(adapter_dir), m.base_model_name, m.warm))
    disk_dir = engine.disk_cache_dir
    if disk_dir is not None:
        disk_path = _resolve(disk_dir)
        if disk_path.exists() and not disk_path.is_dir():
            raise values.error("disk_cache_dir", f"{disk_dir!r} is not a directory")
        disk_dir = str(disk_path)
    store_url = engine.adapter_store_url
    if store_url is not None and "://" not in store_url:
        store_path = _resolve(store_url)
        if not store_path.is_dir():
            raise values.error("adapter_store_url", f"{store_url!r} is not a directory")
        store_url = str(store_path)
    roots = []
    for root in config.allowed_lora_roots:
        root_dir = _resolve(root)
        if not root_dir.is_dir():
            raise values.error("allowed_lora_roots", f"{root!r} {_what(root_dir)}")
        roots.append(str(root_dir))
    trusted = []
    for key_file in config.trusted_keys:
        key_path = _resolve(key_file)
        if not key_path.is_file():
            raise values.error("trusted_keys", f"{key_file!r} is not a file")
        trusted.append(str(key_path))
    engine = replace(
        engine,
        model=str(model_dir),
        tokenizer=tokenizer,
        generation_config=generation,
        disk_cache_dir=disk_dir,
        adapter_store_url=store_url,
    )
    return replace(
        config, engine=engine, lora_modules=modules, allowed_lora_roots=roots, trusted_keys=trusted
    )


def parse_serve_args(argv: list[str], *, environ: Mapping[str, str] | None = None) -> ServerConfig:
    """Parse ``serve``'s argv (without the command name) into a validated ServerConfig.

    argparse errors (unknown flags, malformed values) exit with code 2; semantic problems
    raise ServeConfigError.
    """
    parser = argparse.ArgumentParser(
        prog="loraplex serve",
        description="Serve MODEL_DIR and its LoRA adapters over an OpenAI-compatible API.",
        allow_abbrev=False,  # a vLLM command line must parse exactly as vLLM would
    )
    add_serve_arguments(parser)
    return config_from_args(parser.parse_args(normalize_argv(argv)), environ=environ)
