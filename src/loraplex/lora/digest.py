"""The adapter digest (the ``sha256`` of :class:`~loraplex.types.AdapterRef`) without torch.

:func:`loraplex.lora.adapter.compute_adapter_digest` hashes ``(config, tensors)`` once they are
loaded; :func:`digest_safetensors_dir` computes the same value straight from
``adapter_config.json`` + ``adapter_model.safetensors`` by parsing the safetensors header
(8-byte little-endian length, then JSON) and hashing each tensor's bytes, so the registry and
other torch-free tools name adapters exactly as the engine does::

    h = sha256(DIGEST_VERSION)
    h.update(canonical_json(_math_config(config)) + "\\n")
    for name in sorted(tensors):
        h.update(canonical_json({name, dtype: "torch.<dtype>", shape, nbytes}) + "\\n")
        h.update(raw little-endian bytes of the tensor)

``_math_config`` keeps ``rank_pattern`` / ``alpha_pattern`` as ``[[pattern, value], ...]`` in
file order, because the maths takes the first pattern (in file order) that matches a module
(PEFT's ``get_pattern_key``): two configs whose patterns differ only in order may give a module
different scales, so they must not share a digest. This is digest version 2; version 1 sorted
the pattern keys. A v1 digest never equals a v2 digest of any files (the version line is hashed
first), so a revision registered under v1 fails verification under v2 with a digest mismatch
(never a silent pass) until it is registered again; ``legacy_digest`` computes the v1 value
so that the error can say so.

:func:`read_safetensors_adapter` is how adapter weights are read (by the engine, through
:func:`loraplex.lora.adapter.read_adapter`, and by the registry): the file's bytes are read into
memory the process owns, hashed there and parsed from there (never a memory map of a file that
another process may rewrite or truncate).

The safetensors header is parsed by :mod:`loraplex.checkpoint.safetensors` (loraplex's one
header reader); its :class:`~loraplex.checkpoint.safetensors.SafetensorsError` reaches the
callers here as a :class:`DigestError` with the same message.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.checkpoint.safetensors import SafetensorsError, TensorInfo, parse_safetensors_header
from loraplex.lora.peft.files import CONFIG_NAME, SAFETENSORS_NAME

DIGEST_VERSION = b"loraplex-adapter-digest-v2\n"
LEGACY_DIGEST_VERSION = b"loraplex-adapter-digest-v1\n"
"""The previous version (pattern keys sorted); only used to explain a mismatch."""

# Config fields that change what the adapter computes, with PEFT's defaults (a missing field and
# its default digest the same). Unsupported variants are listed too, so that if one is ever
# supported its adapters can never share a digest with plain LoRA.
_DIGEST_FIELDS: dict[str, Any] = {
    "peft_type": None,
    "r": 8,
    "lora_alpha": 8,
    "use_rslora": False,
    "target_modules": None,
    "exclude_modules": None,
    "layers_to_transform": None,
    "layers_pattern": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "use_dora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "lora_bias": False,
    "modules_to_save": None,
    "layer_replication": None,
    "use_qalora": False,
    "target_parameters": None,
    "trainable_token_indices": None,
    "init_lora_weights": True,
    "alora_invocation_tokens": None,
    "use_bdlora": None,
    "arrow_config": None,
    "kasa_config": None,
    "monteclora_config": None,
}


class DigestError(ValueError):
    """The adapter files cannot be read or parsed (missing, not JSON, corrupt header, ...)."""


def read_json_object(path: Path, what: str) -> tuple[bytes, dict[str, Any]]:
    """The bytes of a JSON file holding one object, and the object; :class:`DigestError`
    starting with ``what`` when it is not valid JSON or not an object."""
    raw = path.read_bytes()
    return raw, parse_config_bytes(raw, what)


def _as_float(v: Any) -> Any:
    """16 and 16.0 are the same alpha: numbers become floats, anything else is left alone."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v


def _math_config(config: Mapping[str, Any], *, ordered_patterns: bool = True) -> dict[str, Any]:
    """The digest-relevant subset of ``config``, normalised so equal math gives equal JSON.

    Missing/None/empty values take PEFT's default, alphas are floats, name lists are sorted
    sets and an int ``layers_to_transform`` is the one-element list it means. With
    ``ordered_patterns`` (digest v2) ``rank_pattern`` / ``alpha_pattern`` become lists of
    ``[pattern, value]`` in file order (the first match wins); v1 left them as objects, whose
    keys the canonical JSON sorts.
    """
    out: dict[str, Any] = {}
    for key, default in _DIGEST_FIELDS.items():
        value = config.get(key)
        if value is None or (isinstance(value, (list, dict)) and not value):
            value = default
        out[key] = value
    out["lora_alpha"] = _as_float(out["lora_alpha"])
    if isinstance(out["alpha_pattern"], dict):
        out["alpha_pattern"] = {k: _as_float(v) for k, v in out["alpha_pattern"].items()}
    if ordered_patterns:
        for key in ("rank_pattern", "alpha_pattern"):
            if isinstance(out[key], dict):
                out[key] = [[k, v] for k, v in out[key].items()]
    for key in ("target_modules", "exclude_modules", "modules_to_save"):
        if isinstance(out[key], list) and all(isinstance(x, str) for x in out[key]):
            out[key] = sorted(set(out[key]))
    layers = out["layers_to_transform"]
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if isinstance(layers, list) and all(isinstance(i, int) for i in layers):
        out["layers_to_transform"] = sorted(set(layers))
    return out


def config_digest_line(config: Mapping[str, Any], *, legacy: bool = False) -> bytes:
    """The config part of the digest: canonical JSON of the math config and a newline
    (``legacy``: as digest v1 spelled it, pattern keys sorted)."""
    math = _math_config(config, ordered_patterns=not legacy)
    return json.dumps(math, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def tensor_header_line(name: str, torch_dtype: str, shape: list[int], nbytes: int) -> bytes:
    """The per-tensor header line hashed before the tensor's bytes."""
    header = {"name": name, "dtype": torch_dtype, "shape": shape, "nbytes": nbytes}
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def read_owned(path: str | Path) -> bytearray:
    """The bytes of the file at ``path`` as a buffer this process owns (one read; no memory
    map). A file truncated while it is read yields the bytes that were there; whoever parses
    them finds the tensors do not fit. ``OSError`` if it cannot be read."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        buf = bytearray(size)
        got = 0
        with memoryview(buf) as view:
            while got < size:
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
    if got < size:
        del buf[got:]
    return buf


def _digest(
    config: Mapping[str, Any],
    data: bytes | bytearray | memoryview,
    tensors: Mapping[str, TensorInfo],
    *,
    legacy: bool = False,
) -> str:
    h = hashlib.sha256(LEGACY_DIGEST_VERSION if legacy else DIGEST_VERSION)
    h.update(config_digest_line(config, legacy=legacy))
    with memoryview(data) as view:
        for name in sorted(tensors):
            t = tensors[name]
            h.update(tensor_header_line(name, t.dtype, list(t.shape), t.nbytes))
            h.update(view[t.start : t.end])
    return h.hexdigest()


@dataclass(frozen=True, eq=False)
class SafetensorsAdapter:
    """An adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) read once
    into memory this process owns: what is hashed is what gets parsed, and nothing another
    process does to the files afterwards can change it."""

    config: dict[str, Any]
    config_bytes: bytes
    data: bytearray  # the whole weights file
    tensors: dict[str, TensorInfo]  # offsets index ``data``
    digest: str  # the adapter digest of exactly these bytes

    def legacy_digest(self) -> str:
        """The digest v1 gave these bytes (to explain a mismatch with an old registration)."""
        return _digest(self.config, self.data, self.tensors, legacy=True)


def read_safetensors_adapter(path: str | Path) -> SafetensorsAdapter:
    """Read an adapter directory's config and safetensors weights into owned memory, parse the
    header from those bytes and hash them (one read, one pass). :class:`DigestError` naming
    ``path`` when a file is missing, unreadable, or does not parse."""
    root = Path(path)
    cfg_path, st_path = root / CONFIG_NAME, root / SAFETENSORS_NAME
    if not root.is_dir():
        raise DigestError(f"{path}: directory not found")
    if not cfg_path.is_file():
        raise DigestError(f"{path}: missing {CONFIG_NAME}")
    if not st_path.is_file():
        raise DigestError(f"{path}: missing {SAFETENSORS_NAME}")
    try:
        cfg_bytes, config = read_json_object(cfg_path, f"{path}: {CONFIG_NAME}")
        data = read_owned(st_path)
    except OSError as e:
        raise DigestError(f"{path}: cannot read the adapter files ({e.strerror or e})") from e
    return safetensors_adapter_of(cfg_bytes, config, data, st_path)


def safetensors_adapter_of(
    config_bytes: bytes, config: dict[str, Any], data: bytearray, where: str | Path
) -> SafetensorsAdapter:
    """Parse and hash an adapter already in owned memory (``data``: a whole safetensors file,
    e.g. a pushed body); :class:`DigestError` naming ``where`` when the header does not parse."""
    try:
        tensors = parse_safetensors_header(data, where)
    except SafetensorsError as e:  # the message names the file and what is wrong
        raise DigestError(str(e)) from e
    return SafetensorsAdapter(config, config_bytes, data, tensors, _digest(config, data, tensors))


def parse_config_bytes(raw: bytes, what: str) -> dict[str, Any]:
    """The JSON object in ``raw`` (e.g. an ``adapter_config.json``); :class:`DigestError`
    starting with ``what`` when it is not valid JSON or not an object."""
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DigestError(f"{what} is not valid JSON ({e})") from e
    if not isinstance(obj, dict):
        raise DigestError(f"{what} must hold a JSON object")
    return obj


@dataclass(frozen=True)
class AdapterFiles:
    """What one read of an adapter directory yields: the digest, plain file hashes, the config
    and the tensor table (for torch-free validation)."""

    digest: str  # == compute_adapter_digest(config, tensors)
    weights_sha256: str  # sha256 of adapter_model.safetensors as a file
    config_sha256: str  # sha256 of adapter_config.json as a file
    config: dict[str, Any]
    tensors: dict[str, TensorInfo]
    nbytes: int  # bytes of all tensors


def read_adapter_dir(path: str | Path) -> AdapterFiles:
    """Hash an adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``):
    the adapter digest and both file hashes, all of the same bytes (each file is read once;
    only safetensors is accepted)."""
    root = Path(path)
    if root.is_dir() and not (root / SAFETENSORS_NAME).is_file():
        raise DigestError(f"{path}: missing {SAFETENSORS_NAME} (only safetensors is supported)")
    return adapter_files_of(read_safetensors_adapter(root))


def adapter_files_of(a: SafetensorsAdapter, weights_sha256: str | None = None) -> AdapterFiles:
    """The :class:`AdapterFiles` of an adapter read (or pushed) into owned memory: its digest
    and the hashes its two files have (or would have, written as received).
    ``weights_sha256``: the weights' file hash when the caller has just checked it (a push's
    body digest), else it is computed."""
    return AdapterFiles(
        digest=a.digest,
        weights_sha256=weights_sha256 or hashlib.sha256(a.data).hexdigest(),
        config_sha256=hashlib.sha256(a.config_bytes).hexdigest(),
        config=a.config,
        tensors=a.tensors,
        nbytes=sum(t.nbytes for t in a.tensors.values()),
    )


def digest_safetensors_dir(path: str | Path) -> str:
    """``compute_adapter_digest(config, tensors)`` of an adapter directory, without torch."""
    return read_adapter_dir(path).digest
