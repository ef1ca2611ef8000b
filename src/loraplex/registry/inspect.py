"""Torch-free inspection of adapters and base models for the registry.

:func:`inspect_adapter` reads an adapter directory once (digest, file hashes, safetensors
header) and checks it against a base model's ``config.json`` with the engine loader's own
format rules (:mod:`loraplex.lora.peft`: supported config, tensor names of the seven
Llama projections, the embedding and the LM head, ``A: [r, d_in]`` / ``B: [d_out, r]`` shapes,
targeted modules, rank limit).
Each failure is a :class:`ValidationError` with a short ``reason`` code.
:func:`base_model_info` fingerprints a base model directory (memoised across restarts).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.checkpoint.modules import (
    LAYER_MODULE_ORDER,
    PROJ_NAMES,
    VOCAB_MODULES,
    BaseModelSpec,
)
from loraplex.checkpoint.safetensors import FLOAT_DTYPES
from loraplex.config import QUANTIZE_AT_LOAD
from loraplex.lora.digest import AdapterFiles, DigestError, read_adapter_dir, read_json_object
from loraplex.lora.peft.activation import invocation_tokens
from loraplex.lora.peft.config import parse_lora_config, unservable_targets
from loraplex.lora.peft.errors import FormatError
from loraplex.lora.peft.files import BIN_NAME, SAFETENSORS_NAME
from loraplex.lora.peft.layout import check_layout
from loraplex.lora.peft.tensors import TensorMeta
from loraplex.registry.db import loraplex_home
from loraplex.registry.errors import RegistryError, ValidationError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


@dataclass(frozen=True)
class BaseModelInfo:
    """A served base model: its name, content digest and ``config.json``."""

    name: str
    digest: str
    config: dict
    quantization: str | None = None
    """How the served base's weights are quantized (``quantization_of``): recorded with every
    registration and validation; None: float weights."""


def quantization_of(config: dict, requested: str | None = None) -> str | None:
    """The base's quantization as the registry records it: ``--quantization int8/int4``
    (quantized at load from these float files), else the checkpoint's
    ``quantization_config.quant_method`` with its bits, group size and, where activations are
    quantized too, their bits (``gptq w4 g128``, ``compressed-tensors w4 g128 a8``)."""
    if requested in QUANTIZE_AT_LOAD:
        return requested
    qc = config.get("quantization_config")
    if not isinstance(qc, dict) or not qc.get("quant_method"):
        return requested
    parts = [str(qc["quant_method"])]
    bits, group, acts = qc.get("bits"), qc.get("group_size"), None
    groups = qc.get("config_groups")
    if isinstance(groups, dict) and groups:  # compressed-tensors: its (first) scheme
        scheme = next(iter(groups.values()))
        w = scheme.get("weights") if isinstance(scheme, dict) else None
        a = scheme.get("input_activations") if isinstance(scheme, dict) else None
        if isinstance(w, dict):
            bits, group = w.get("num_bits"), w.get("group_size")
        if isinstance(a, dict) and a.get("num_bits"):
            acts = f"a{a['num_bits']}"
    if bits:
        parts.append(f"w{bits}")
    if group not in (None, -1):
        parts.append(f"g{group}")
    if acts:
        parts.append(acts)
    return " ".join(parts)


@dataclass(frozen=True)
class AdapterInfo:
    """What inspection learned about one adapter directory."""

    files: AdapterFiles
    rank: int  # max over modules
    alpha: float
    dtype: str  # e.g. "float16"; "mixed" when tensors differ
    target_modules: tuple[str, ...]  # modules adapted (embed_tokens, lm_head, then projections)
    nbytes: int
    alora_invocation_tokens: tuple[int, ...] | None = None  # an activated LoRA's invocation


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


def base_model_info(
    model_dir: str | Path, name: str | None = None, quantization: str | None = None
) -> BaseModelInfo:
    """Fingerprint a base model directory (``quantization``: the server's ``--quantization``,
    recorded as :func:`quantization_of` says; the digest is the files', so adapters registered
    for a float base stay valid when it is served quantized at load).

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
    return BaseModelInfo(
        name or root.resolve().name, h.hexdigest(), config, quantization_of(config, quantization)
    )


def inspect_adapter(path: str | Path, base: BaseModelInfo, *, max_rank: int) -> AdapterInfo:
    """Read and validate the adapter in ``path`` for ``base`` with the loader's format rules
    (:mod:`loraplex.lora.peft`), so a registered adapter is one the engine loads.

    ValidationError names the reason: ``unreadable``, ``unsupported_format`` (pickle weights),
    ``unsupported_config`` (also ``modules_to_save``, naming the module),
    ``unsupported_target`` (also a config naming a module we do not serve, e.g. GPT-2's
    ``c_attn``), ``unsupported_tensor``, ``unsupported_dtype``,
    ``incomplete_adapter``, ``shape_mismatch``, ``unsupported_base``, ``rank_too_large``."""
    root = Path(path)
    if root.is_dir() and not (root / SAFETENSORS_NAME).exists() and (root / BIN_NAME).exists():
        raise ValidationError(
            "unsupported_format",
            f"{path}: {BIN_NAME} (pickle) is not accepted by the registry; "
            f"convert it to {SAFETENSORS_NAME}",
        )
    try:
        files = read_adapter_dir(root)
    except (DigestError, OSError) as e:
        raise ValidationError("unreadable", str(e)) from e
    return inspect_files(files, base, max_rank=max_rank)


def inspect_files(files: AdapterFiles, base: BaseModelInfo, *, max_rank: int) -> AdapterInfo:
    """:func:`inspect_adapter` of an adapter already read into memory (a directory's files, or
    pushed bytes): the same format rules and :class:`ValidationError` reasons."""
    config = files.config
    try:
        settings = parse_lora_config(config)
        bad = unservable_targets(config.get("target_modules"))
        if bad:
            supported = ", ".join((*PROJ_NAMES, *VOCAB_MODULES))
            raise FormatError(
                "unsupported_target", f"target_modules {bad} not supported (supported: {supported})"
            )
        try:
            spec = BaseModelSpec.from_hf_config(base.config)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            raise FormatError(
                "unsupported_base", f"base model {base.name}: not a Llama-family config ({e})"
            ) from e
        metas = {
            name: TensorMeta(t.shape, t.dtype, t.dtype in FLOAT_DTYPES)
            for name, t in files.tensors.items()
        }
        layout = check_layout(settings, metas, spec, max_rank=max_rank)
    except FormatError as e:
        raise ValidationError(e.reason, str(e)) from e
    dtypes = {t.dtype.removeprefix("torch.") for t in files.tensors.values()}
    present = {proj for _, proj in layout}
    order = (*VOCAB_MODULES, *LAYER_MODULE_ORDER)
    return AdapterInfo(
        files=files,
        rank=max(m.rank for m in layout.values()),
        alpha=float(config.get("lora_alpha", 8)),
        dtype=dtypes.pop() if len(dtypes) == 1 else "mixed",
        target_modules=tuple(p for p in order if p in present),
        nbytes=files.nbytes,
        alora_invocation_tokens=invocation_tokens(config),
    )
