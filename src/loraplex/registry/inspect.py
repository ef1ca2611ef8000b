"""Torch-free inspection of adapters and base models for the registry.

:func:`inspect_adapter` reads an adapter directory once (digest, file hashes, safetensors
header) and checks it against a base model's ``config.json``: supported config, tensor names
of the seven Llama projections, ``A: [r, d_in]`` / ``B: [d_out, r]`` shapes, rank limit.
Each failure is a :class:`ValidationError` with a short ``reason`` code.
:func:`base_model_info` fingerprints a base model directory (memoised across restarts).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.lora.digest import (
    ATTN_PROJ_NAMES,
    FLOAT_DTYPES,
    PROJ_NAMES,
    AdapterFiles,
    DigestError,
    read_adapter_dir,
    read_json_object,
)
from loraplex.registry.db import loraplex_home
from loraplex.registry.errors import RegistryError, ValidationError

_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?"
    r"(?P<module>(?:model\.)?layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\.(?P<proj>[^.]+))"
    r"\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)
_UNSUPPORTED_CONFIG = (
    "use_dora",
    "modules_to_save",
    "lora_bias",
    "fan_in_fan_out",
    "layer_replication",
    "use_qalora",
    "target_parameters",
    "trainable_token_indices",
    "alora_invocation_tokens",
    "use_bdlora",
    "arrow_config",
    "kasa_config",
    "monteclora_config",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def projection_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """proj name -> (d_in, d_out) from a Llama-family HF ``config.json`` dict."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    inter = int(config["intermediate_size"])
    q, kv = heads * head_dim, kv_heads * head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


@dataclass(frozen=True)
class BaseModelInfo:
    """A served base model: its name, content digest and ``config.json``."""

    name: str
    digest: str
    config: dict


@dataclass(frozen=True)
class AdapterInfo:
    """What inspection learned about one adapter directory."""

    files: AdapterFiles
    rank: int  # max over modules
    alpha: float
    dtype: str  # e.g. "float16"; "mixed" when tensors differ
    target_modules: tuple[str, ...]  # projections adapted in at least one layer, table order
    nbytes: int


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _load_memo(memo_path: Path) -> dict[str, Any]:
    try:
        data = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save_memo(memo_path: Path, memo: dict[str, Any]) -> None:
    """Write the memo atomically; a home we cannot write only costs re-hashing next time."""
    try:
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=memo_path.parent, prefix=".base-digests.")
        with os.fdopen(fd, "w") as f:
            json.dump(memo, f, sort_keys=True)
        os.replace(tmp, memo_path)
    except OSError:
        pass


def base_model_info(model_dir: str | Path, name: str | None = None) -> BaseModelInfo:
    """Fingerprint a base model directory.

    ``digest = sha256("loraplex-base-digest-v1\\n" + len + config.json bytes + per weight file in
    name order "name\\0size\\0sha256\\n")``. File hashes are memoised per (path, size, mtime_ns)
    in ``<LORAPLEX_HOME>/base-digests.json`` so a restart does not re-read gigabytes.
    """
    root = Path(model_dir).expanduser()
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise RegistryError(f"base model {model_dir}: missing config.json")
    try:
        cfg_bytes, config = read_json_object(cfg_path, f"base model {model_dir}: config.json")
    except DigestError as e:
        raise RegistryError(str(e)) from e
    weights = sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not weights:
        raise RegistryError(
            f"base model {model_dir}: no weight files ({', '.join(WEIGHT_SUFFIXES)})"
        )
    memo_path = loraplex_home() / "base-digests.json"
    memo = _load_memo(memo_path)
    changed = False
    h = hashlib.sha256(b"loraplex-base-digest-v1\n")
    h.update(f"{len(cfg_bytes)}\n".encode() + cfg_bytes)
    for p in weights:
        st = p.stat()
        key = str(p.resolve())
        entry = memo.get(key)
        if (
            isinstance(entry, dict)
            and entry.get("size") == st.st_size
            and entry.get("mtime_ns") == st.st_mtime_ns
            and isinstance(entry.get("sha256"), str)
        ):
            sha = entry["sha256"]
        else:
            sha = _file_sha256(p)
            memo[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
            changed = True
        h.update(f"{p.name}\0{st.st_size}\0{sha}\n".encode())
    if changed:
        _save_memo(memo_path, memo)
    return BaseModelInfo(name or root.resolve().name, h.hexdigest(), config)


def _check_config(config: dict[str, Any], max_rank: int) -> None:
    if config.get("peft_type") != "LORA":
        raise ValidationError(
            "unsupported_config", f"peft_type must be 'LORA', got {config.get('peft_type')!r}"
        )
    for field in _UNSUPPORTED_CONFIG:
        if config.get(field):
            raise ValidationError(
                "unsupported_config", f"{field}={config[field]!r} is not supported"
            )
    if config.get("bias", "none") != "none":
        raise ValidationError("unsupported_config", f"bias={config['bias']!r}: only 'none'")
    r = config.get("r", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise ValidationError("unsupported_config", f"r must be a positive integer, got {r!r}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValidationError("unsupported_config", f"lora_alpha must be a number, got {alpha!r}")
    for field in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(field) or {}, dict):
            raise ValidationError("unsupported_config", f"{field} must be a JSON object")
    ranks = [r, *(config.get("rank_pattern") or {}).values()]
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in ranks):
        raise ValidationError("unsupported_config", "rank_pattern values must be positive ints")
    too_big = [x for x in ranks if x > max_rank]
    if too_big:
        raise ValidationError("rank_too_large", f"rank {max(too_big)} > max rank {max_rank}")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        bad = [t for t in targets if not isinstance(t, str) or t.split(".")[-1] not in PROJ_NAMES]
        if bad:
            raise ValidationError(
                "unsupported_target",
                f"target_modules {bad} not supported (supported: {', '.join(PROJ_NAMES)})",
            )
    elif not isinstance(targets, str) or not targets:
        raise ValidationError(
            "unsupported_config", f"target_modules must be a string or list, got {targets!r}"
        )


def inspect_adapter(path: str | Path, base: BaseModelInfo, *, max_rank: int) -> AdapterInfo:
    """Read and validate the adapter in ``path`` for ``base``; ValidationError names the reason:
    ``unreadable``, ``unsupported_format``, ``unsupported_config``, ``unsupported_target``,
    ``unsupported_tensor``, ``unsupported_dtype``, ``incomplete_adapter``, ``shape_mismatch``,
    ``unsupported_base``, ``rank_too_large``."""
    root = Path(path)
    if (
        root.is_dir()
        and not (root / "adapter_model.safetensors").exists()
        and (root / "adapter_model.bin").exists()
    ):
        raise ValidationError(
            "unsupported_format",
            f"{path}: adapter_model.bin (pickle) is not accepted by the registry; "
            "convert it to adapter_model.safetensors",
        )
    try:
        files = read_adapter_dir(root)
    except (DigestError, OSError) as e:
        raise ValidationError("unreadable", str(e)) from e
    config = files.config
    _check_config(config, max_rank)
    try:
        shapes = projection_shapes(base.config)
        num_layers = int(base.config["num_hidden_layers"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise ValidationError(
            "unsupported_base", f"base model {base.name}: not a Llama-family config ({e})"
        ) from e

    modules: dict[tuple[int, str], dict[str, tuple[str, tuple[int, ...]]]] = {}
    dtypes: set[str] = set()
    for tname, t in sorted(files.tensors.items()):
        m = _KEY_RE.match(tname)
        if m is None:
            if any(k in tname for k in ("embed_tokens", "lm_head", "lora_embedding_")):
                raise ValidationError(
                    "unsupported_target", f"tensor {tname!r}: embedding / lm_head LoRA"
                )
            raise ValidationError(
                "unsupported_tensor", f"tensor {tname!r} is not a LoRA A/B projection weight"
            )
        proj, block, layer = m["proj"], m["block"], int(m["layer"])
        if proj not in PROJ_NAMES:
            raise ValidationError(
                "unsupported_target",
                f"tensor {tname!r}: module {proj!r} (supported: {', '.join(PROJ_NAMES)})",
            )
        if (block == "self_attn") != (proj in ATTN_PROJ_NAMES):
            raise ValidationError("unsupported_tensor", f"tensor {tname!r}: {proj} under {block}")
        if t.dtype not in FLOAT_DTYPES:
            raise ValidationError("unsupported_dtype", f"tensor {tname!r}: dtype {t.dtype}")
        dtypes.add(t.dtype.removeprefix("torch."))
        slot = modules.setdefault((layer, proj), {})
        if m["ab"] in slot:
            raise ValidationError("unsupported_tensor", f"tensor {tname!r} is a duplicate")
        slot[m["ab"]] = (tname, t.shape)
    if not modules:
        raise ValidationError("incomplete_adapter", f"{path}: no LoRA tensors")

    rank = 0
    for (layer, proj), slot in sorted(modules.items()):
        if set(slot) != {"A", "B"}:
            missing = ({"A", "B"} - set(slot)).pop()
            raise ValidationError(
                "incomplete_adapter", f"layer {layer} {proj}: lora_{missing} weight missing"
            )
        (a_name, a), (b_name, b) = slot["A"], slot["B"]
        if len(a) != 2 or len(b) != 2:
            raise ValidationError("shape_mismatch", f"{a_name!r}/{b_name!r}: expected 2-D tensors")
        if layer >= num_layers:
            raise ValidationError(
                "shape_mismatch",
                f"tensor {a_name!r}: layer {layer} >= base model num_hidden_layers {num_layers}",
            )
        d_in, d_out = shapes[proj]
        r = a[0]
        if a[1] != d_in or b[0] != d_out or b[1] != r:
            raise ValidationError(
                "shape_mismatch",
                f"layer {layer} {proj}: A {list(a)} / B {list(b)} do not fit the base model "
                f"{base.name} (expected A [r, {d_in}], B [{d_out}, r])",
            )
        rank = max(rank, r)
    if rank > max_rank:
        raise ValidationError("rank_too_large", f"rank {rank} > max rank {max_rank}")
    present = {proj for _, proj in modules}
    return AdapterInfo(
        files=files,
        rank=rank,
        alpha=float(config.get("lora_alpha", 8)),
        dtype=dtypes.pop() if len(dtypes) == 1 else "mixed",
        target_modules=tuple(p for p in PROJ_NAMES if p in present),
        nbytes=files.nbytes,
    )
