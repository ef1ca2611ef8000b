"""Hugging Face hub ids (``org/name``) for models, tokenizers and adapters, as vLLM takes them.

:func:`resolve_hub_dir` turns an id into a local snapshot directory through
``huggingface_hub.snapshot_download``: its cache (``--download-dir``, else ``$HF_HUB_CACHE``,
else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``), ``$HF_HUB_OFFLINE`` (cache only, no
network) and tokens (``--hf-token``, else ``$HF_TOKEN``, else the one ``huggingface-cli login``
stored). The environment is passed in, so a caller (a test) can lay out a cache and go offline
without touching the process's. Torch-free.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

__all__ = ["HubError", "hub_cache_dir", "is_hub_id", "resolve_hub_dir"]

MODEL_PATTERNS = (
    "*.json",
    "*.safetensors",
    "*.model",
    "*.txt",
    "*.jinja",
    "tokenizer*",
)
"""Files a base model needs (weights, config, tokenizer, chat template); no .bin/.pt copies."""
ADAPTER_PATTERNS = ("*.json", "*.safetensors", "*.md")
_TRUE = ("1", "true", "yes", "on")


class HubError(ValueError):
    """A hub id that cannot be resolved; the message says why and what to do."""


def is_hub_id(text: str) -> bool:
    """``org/name`` (one slash, hub-legal characters, not a relative or absolute path)."""
    return bool(re.fullmatch(r"[\w.-]+/[\w.-]+", text)) and not text.startswith((".", "/", "~"))


def hub_cache_dir(environ: Mapping[str, str], download_dir: str | None = None) -> Path:
    """The hub cache directory ``huggingface_hub`` uses under ``environ``."""
    if download_dir:
        return Path(download_dir).expanduser()
    if environ.get("HF_HUB_CACHE"):
        return Path(environ["HF_HUB_CACHE"]).expanduser()
    home = environ.get("HF_HOME") or str(
        Path(environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface"
    )
    return Path(home).expanduser() / "hub"


def _offline(environ: Mapping[str, str]) -> bool:
    return any(
        environ.get(v, "").strip().lower() in _TRUE
        for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def resolve_hub_dir(
    repo_id: str,
    *,
    environ: Mapping[str, str],
    revision: str | None = None,
    download_dir: str | None = None,
    token: str | None = None,
    adapter: bool = False,
) -> Path:
    """The local snapshot directory of hub repo ``repo_id`` at ``revision`` (default: main),
    downloaded into the cache unless it is there (offline: the cache only). Raises HubError."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    cache = hub_cache_dir(environ, download_dir)
    offline = _offline(environ)
    token = token or environ.get("HF_TOKEN") or environ.get("HUGGING_FACE_HUB_TOKEN") or None
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=str(cache),
            token=token,
            local_files_only=offline,
            allow_patterns=list(ADAPTER_PATTERNS if adapter else MODEL_PATTERNS),
        )
    except LocalEntryNotFoundError:
        at = f" at revision {revision!r}" if revision else ""
        how = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
        raise HubError(
            f"hub id {repo_id!r}{at} is not in the hub cache {cache} and {how} (download it "
            f"first, e.g. `huggingface-cli download {repo_id}`, or give a local directory)"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise HubError(f"hub id {repo_id!r}: {type(e).__name__}: {e}") from None
    return Path(str(path))
