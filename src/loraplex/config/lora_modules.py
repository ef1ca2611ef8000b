"""The adapters ``loraplex serve`` starts with (vLLM's ``--lora-modules``): ``LoRAModule`` and
the spellings of one, on the command line ('name=path' or vLLM's JSON) and in a config file."""

from __future__ import annotations

import json
from dataclasses import dataclass

from loraplex.warm import WarmPolicy, WarmSchedule, parse_warm


@dataclass(frozen=True)
class LoRAModule:
    """An adapter served under ``name`` from ``path`` (vLLM's ``--lora-modules``)."""

    name: str
    path: str  # a local PEFT directory, or an object-store URI (s3://bucket/prefix/name)
    base_model_name: str | None = None
    warm: WarmPolicy | WarmSchedule = "on-demand"
    """device-preferred | host | on-demand (start-up pre-warming), or a window schedule (the
    prewarm scheduler warms it ahead of each window; on-demand outside them)."""


def _lora_from_mapping(obj: object) -> LoRAModule:
    """{"name": ..., "path": ..., "base_model_name": ...} (vLLM's JSON form) -> LoRAModule."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected an object with name and path, got {obj!r}")
    allowed = ("name", "path", "base_model_name", "warm")
    unknown = [k for k in obj if k not in allowed]
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r} in {obj!r} (allowed: {', '.join(allowed)})")
    name, path, base = obj.get("name"), obj.get("path"), obj.get("base_model_name")
    for field_name, value in (("name", name), ("path", path)):
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{field_name!r} must be a non-empty string in {obj!r}")
    if base is not None and (not isinstance(base, str) or not base.strip()):
        raise ValueError(f"'base_model_name' must be a non-empty string in {obj!r}")
    warm = parse_warm(obj.get("warm", "on-demand"))
    assert isinstance(name, str) and isinstance(path, str)
    return LoRAModule(name=name.strip(), path=path.strip(), base_model_name=base, warm=warm)


def parse_lora_module(text: str) -> LoRAModule:
    """'name=path' or vLLM's JSON '{"name": ..., "path": ..., "base_model_name": ...}'."""
    spec = text.strip()
    if spec.startswith("{"):
        try:
            obj = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid JSON {text!r}: {e.msg}") from None
        return _lora_from_mapping(obj)
    name, sep, path = spec.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(
            f"expected NAME=PATH or JSON like "
            f'{{"name": "sql", "path": "/adapters/sql"}}, got {text!r}'
        )
    return LoRAModule(name=name.strip(), path=path.strip())


def lora_modules_from_value(value: object) -> list[LoRAModule]:
    """A config-file value: list of 'name=path' strings or dicts, or a mapping name -> path."""
    if isinstance(value, str):
        return [parse_lora_module(value)]
    if isinstance(value, list):
        out = []
        for item in value:
            if isinstance(item, str):
                out.append(parse_lora_module(item))
            elif isinstance(item, dict):
                out.append(_lora_from_mapping(item))
            else:
                raise ValueError(f"each item must be 'name=path' or a mapping, got {item!r}")
        return out
    if isinstance(value, dict):
        if isinstance(value.get("name"), str) and isinstance(value.get("path"), str):
            return [_lora_from_mapping(value)]  # one module written as a single mapping
        out = []
        for name, spec in value.items():
            if not isinstance(name, str) or not name.strip():
                raise ValueError(f"adapter names must be non-empty strings, got {name!r}")
            if isinstance(spec, str):
                out.append(_lora_from_mapping({"name": name, "path": spec}))
            elif isinstance(spec, dict):
                if spec.get("name", name) != name:
                    raise ValueError(f"adapter {name!r} has a different name {spec['name']!r}")
                out.append(_lora_from_mapping({**spec, "name": name}))
            else:
                raise ValueError(f"adapter {name!r}: expected a path, got {spec!r}")
        return out
    raise ValueError(f"expected a list or a mapping of name to path, got {value!r}")
