"""One declaration per setting: a config dataclass field's metadata gives its command-line flag,
its config-file key, its bounds and its help, and the config object is built from the fields.

A field declares itself with ``field(default=..., metadata=setting("--flag", ...))``; from
that one declaration come

- the argparse option (``Settings.add_arguments``): flags and aliases, value parser, metavar,
  help with ``{default}``/``{env}``/``{choices}`` filled in; every option defaults to
  ``argparse.SUPPRESS`` so the namespace holds only what was typed;
- the config-file key (``Settings.read_file``): each flag without its dashes, dashes or
  underscores, plus ``keys``; values typed like the flag's (strings go through the parser);
- the environment fallback (``env``) and the precedence flag > file > environment > default
  (``Settings.resolve``);
- the bounds and choices checked by the dataclass's own ``validate()`` (``check_fields``),
  which the commands run and whose ``FieldError`` they name by flag or key (``Values.explain``);
- the constructor call (``Values.build``): no hand-written keyword lists.

A dataclass-typed field without a setting (``ServerConfig.engine``) contributes its own
settings; one with a setting is one ``NAME=VALUE`` flag and a mapping in the file
(``RouterConfig.weights``). Cross-field rules stay explicit code in ``validate()``.

The declarations themselves (``setting``, ``Setting``, ``FieldError``, ``check_fields``) are
:mod:`loraplex.config.fields`'s; this module reads them into one command's table. Torch-free and
importing nothing of loraplex but that module.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import types
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import MISSING, Field, dataclass, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

from loraplex.config.fields import UNSET, FieldError, Setting, integer, nonempty, number, setting_of

__all__ = [
    "CONFIG_SUFFIXES",
    "FileWording",
    "Settings",
    "Values",
    "load_config_file",
]

CONFIG_SUFFIXES = (".yaml", ".yml", ".toml")

# --------------------------------------------------------------------------- one command's table

_WORDS = {"true": True, "yes": True, "on": True, "1": True,
          "false": False, "no": False, "off": False, "0": False}  # fmt: skip


def _show(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class _Spec:
    """One setting of a command: the field, its declaration and the kind of value its type is."""

    name: str
    setting: Setting
    kind: str  # bool | int | float | str | list | keyed
    field: Field[Any]
    items: Mapping[str, _Spec]  # keyed: the nested fields' specs

    @property
    def flag(self) -> str:
        return self.setting.flags[0] if self.setting.flags else self.name

    def default(self) -> Any:
        """The command's default (a fresh one for factories); MISSING where required."""
        if self.setting.cli_default is not UNSET:
            return self.setting.cli_default
        if self.field.default_factory is not MISSING:
            return self.field.default_factory()
        return self.field.default

    def help(self) -> str:
        s = self.setting
        text = s.help.replace("{env}", " or ".join(f"${v}" for v in s.env))
        text = text.replace("{choices}", ", ".join(map(str, s.choices or ())))
        if "{default}" in text:
            text = text.replace("{default}", _show(self.default()))
        if self.kind == "keyed":
            text += "; names: " + ", ".join(
                f"{n} ({_show(i.default())})" for n, i in self.items.items()
            )
        return text.replace("%", "%%")  # argparse %-formats help

    def parse(self, text: str) -> Any:
        """One flag value (one item of a list, one NAME=VALUE of a keyed setting)."""
        if self.kind == "keyed":
            name, sep, value = text.partition("=")
            item = self.items.get(name.strip().replace("-", "_"))
            if not sep or item is None:
                raise ValueError(
                    f"expected NAME=VALUE with NAME one of {', '.join(self.items)}, got {text!r}"
                )
            try:
                return item.name, item.parse(value)
            except ValueError as e:
                raise ValueError(f"{text!r}: {e}") from None
        if self.setting.parse is not None:
            return self.setting.parse(text)
        return {"int": integer, "float": number}.get(self.kind, nonempty)(text)

    def coerce(self, value: object) -> Any:
        """A config-file value, typed like the flag's (raises ValueError)."""
        out = self.setting.coerce(value) if self.setting.coerce else self._by_kind(value)
        choices = self.setting.choices
        if self.kind != "list" and choices is not None and out not in choices:
            raise ValueError(f"expected one of {', '.join(map(str, choices))}, got {value!r}")
        return out

    def _by_kind(self, value: object) -> Any:
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        if self.kind == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.strip().lower() in _WORDS:
                return _WORDS[value.strip().lower()]
            raise ValueError(f"expected true or false, got {value!r}")
        if self.kind == "keyed":
            if not isinstance(value, dict):
                raise ValueError(f"expected a mapping, got {value!r}")
            out = {}
            for k, v in value.items():
                item = self.items.get(str(k).replace("-", "_"))
                if item is None:
                    label = self.flag.lstrip("-")
                    known = ", ".join(self.items)
                    raise ValueError(f"unknown {label} {k!r} (known: {known})")
                out[item.name] = item.coerce(v)
            return out
        if isinstance(value, str) and self.kind != "list":
            return self.parse(value)
        if self.kind == "int" and numeric and float(value).is_integer():  # type: ignore[arg-type]
            return int(value)  # type: ignore[call-overload]
        if self.kind == "float" and numeric:
            return float(value)  # type: ignore[arg-type]
        if self.kind == "list":
            items = [value] if isinstance(value, str) else value
            if isinstance(items, list) and all(isinstance(x, str) for x in items):
                return [self.parse(x) for x in items]
            raise ValueError(f"expected a string or a list of strings, got {value!r}")
        want = {"int": "integer", "float": "a number", "str": "a string"}[self.kind]
        hint = " (quote it)" if self.kind == "str" and isinstance(value, int | float) else ""
        raise ValueError(f"expected {want}, got {value!r}{hint}")


def _unoptional(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return hint


def _specs(cls: type) -> tuple[dict[str, _Spec], dict[type, dict[str, type]]]:
    """The settings of ``cls`` (dataclass fields with a flag, nested ones flattened) and, per
    dataclass, the nested fields that are built from the same values."""
    specs: dict[str, _Spec] = {}
    nested: dict[type, dict[str, type]] = {}
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        hint = _unoptional(hints[f.name])
        s = setting_of(f)
        if s is None and is_dataclass(hint):
            sub, sub_nested = _specs(hint)  # type: ignore[arg-type]
            nested.setdefault(cls, {})[f.name] = hint  # type: ignore[assignment]
            nested.update(sub_nested)
            dup = specs.keys() & sub.keys()
            if dup:
                raise TypeError(f"{cls.__name__}: settings {sorted(dup)} are declared twice")
            specs.update(sub)
            continue
        if s is None:
            continue
        items: dict[str, _Spec] = {}
        if typing.get_origin(hint) is list:
            kind = "list"
            if typing.get_args(hint)[0] is not str and s.parse is None:
                raise TypeError(f"{cls.__name__}.{f.name}: a list of {hint!r} needs parse=")
        elif is_dataclass(hint):
            kind = "keyed"
            item_hints = typing.get_type_hints(hint)  # type: ignore[arg-type]
            for g in fields(hint):  # type: ignore[arg-type]
                item_kind = _unoptional(item_hints[g.name]).__name__
                items[g.name] = _Spec(g.name, setting_of(g) or Setting(), item_kind, g, {})
        elif hint in (bool, int, float, str):
            kind = hint.__name__
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: no setting kind for type {hint!r}")
        if s.flags or s.keys:
            specs[f.name] = _Spec(f.name, s, kind, f, items)
    return specs, nested


def load_config_file(path_text: str) -> dict[Any, Any]:
    """The mapping in a YAML (.yaml/.yml) or TOML (.toml) file: the one config-file reader of
    every command. ``ValueError`` names ``--config`` and the file."""
    path = Path(path_text).expanduser()
    suffix = path.suffix.lower()
    if suffix not in CONFIG_SUFFIXES:
        raise ValueError(
            f"--config: {path_text!r} must end in .yaml, .yml or .toml (got {suffix or 'none'!r})"
        )
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ValueError(f"--config: cannot read {path_text!r}: {reason}") from e
    try:
        if suffix == ".toml":
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # pragma: no cover - Python 3.10
                import tomli as tomllib
            data = tomllib.loads(raw)
        else:
            import yaml

            data = yaml.safe_load(raw)
    except Exception as e:  # tomllib.TOMLDecodeError / yaml.YAMLError: the parser's message
        kind = "TOML" if suffix == ".toml" else "YAML"
        raise ValueError(f"--config: {path_text!r} is not valid {kind}: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(
            f"--config: {path_text!r} must hold a mapping of flag names to values, "
            f"got {type(data).__name__}"
        )
    return data


@dataclass(frozen=True)
class FileWording:
    """How a command names a config-file key in its messages (``{key}``, ``{path}``)."""

    where: str = "key {key!r} in {path!r}"
    unknown: str = "unknown key {key!r} in config file {path!r}"


def _argparse_type(parse: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    """Wrap a value parser so argparse reports its message (exit code 2)."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = name
    return convert


class Settings:
    """The settings of one command, read from the dataclass ``root`` and the ones it nests.

    ``error`` is the command's exception type; ``wording`` how its messages name file keys;
    ``only`` (field names) keeps those settings alone, for a command that offers a few.
    """

    def __init__(
        self,
        root: type,
        *,
        error: type[Exception],
        wording: FileWording | None = None,
        other_key: Callable[[str, object], dict[str, Any] | None] | None = None,
        only: Collection[str] | None = None,
    ) -> None:
        self.root = root
        self.error = error
        self.wording = wording or FileWording()
        # a file key no setting declares: None = unknown; else the settings it stands for
        # (possibly none: accepted as is); a ValueError refuses it with its message
        self.other_key = other_key
        self.specs, self.nested = _specs(root)
        if only is not None:
            missing = sorted(set(only) - self.specs.keys())
            if missing:
                raise TypeError(f"{root.__name__}: no settings {missing}")
            self.specs = {n: s for n, s in self.specs.items() if n in only}
        self.keys: dict[str, _Spec] = {}
        for spec in self.specs.values():
            for key in (*(f.lstrip("-") for f in spec.setting.flags), *spec.setting.keys):
                norm = key.lower().replace("_", "-")
                if self.keys.setdefault(norm, spec) is not spec:
                    raise TypeError(f"{root.__name__}: key {norm!r} is declared twice")

    def add_arguments(
        self,
        parser: argparse.ArgumentParser,
        *,
        config_group: str | None = None,
        config_file: bool = True,
    ) -> None:
        """Add every setting's flag and (with ``config_file``) ``--config`` to ``parser`` (all
        default to SUPPRESS)."""
        groups: dict[str | None, Any] = {None: parser}
        for spec in self.specs.values():
            s = spec.setting
            if not s.flags:
                continue
            if s.group not in groups:
                groups[s.group] = parser.add_argument_group(s.group)
            kw: dict[str, Any] = {
                "dest": spec.name,
                "default": argparse.SUPPRESS,
                "help": spec.help(),
            }
            if spec.kind == "bool":
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw.update(type=_argparse_type(spec.parse, spec.name), metavar=s.metavar)
                if s.choices is not None:
                    kw["choices"] = s.choices
                if spec.kind in ("list", "keyed") and s.nargs is None:
                    kw["action"] = "append"  # one value per flag; repeat the flag for more
                elif spec.kind in ("list", "keyed"):
                    kw.update(nargs=s.nargs, action="extend")
            groups[s.group].add_argument(*s.flags, **kw)
        if not config_file:
            return
        if config_group not in groups:
            groups[config_group] = parser.add_argument_group(config_group)
        groups[config_group].add_argument(
            "--config",
            default=argparse.SUPPRESS,
            metavar="FILE",
            help="YAML (.yaml/.yml) or TOML (.toml) file of flag names to values "
            "(dashes or underscores); explicit flags override it",
        )

    def read_file(self, path_text: str) -> dict[str, tuple[Any, str]]:
        """setting -> (value, where) from a config file; raises ``error`` naming the key."""
        try:
            data = load_config_file(path_text)
        except ValueError as e:
            raise self.error(str(e)) from e
        out: dict[str, tuple[Any, str]] = {}
        seen: dict[str, str] = {}
        for key, value in data.items():
            norm = key.strip().lower().replace("_", "-") if isinstance(key, str) else None
            spec = self.keys.get(norm) if norm else None
            if spec is None and norm and self.other_key is not None:
                where = self.wording.where.format(key=key, path=path_text)
                try:
                    stands_for = self.other_key(norm, value)
                except ValueError as e:
                    raise self.error(f"{where}: {e}") from None
                if stands_for is not None:
                    for name, v in stands_for.items():
                        out[name] = (v, where)
                    continue
            if spec is None:
                near = difflib.get_close_matches(norm or "", list(self.keys), n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise self.error(self.wording.unknown.format(key=key, path=path_text) + hint)
            where = self.wording.where.format(key=key, path=path_text)
            if spec.name in seen:
                raise self.error(f"{where}: sets the same option as {seen[spec.name]}")
            seen[spec.name] = where
            if value is None:  # null: keep the default
                continue
            try:
                out[spec.name] = (spec.coerce(value), where)
            except ValueError as e:
                raise self.error(f"{where}: {e}") from None
        return out

    def resolve(self, args: argparse.Namespace, environ: Mapping[str, str]) -> Values:
        """Each setting from, in order, its flag, the ``--config`` file, its environment
        variables (first set wins) or the default."""
        config = getattr(args, "config", None)
        given = self.read_file(config) if config is not None else {}
        for name, spec in self.specs.items():
            flag = getattr(args, name, None)
            if spec.kind == "keyed" and (flag is not None or name in given):
                merged = {**(given[name][0] if name in given else {}), **dict(flag or [])}
                where = spec.flag if flag is not None else given[name][1]
                given[name] = (replace(spec.default(), **merged), where)
            elif flag is not None:
                off = spec.kind == "bool" and not flag  # --no-X
                given[name] = (flag, "--no-" + spec.flag[2:] if off else spec.flag)
            elif name not in given or given[name][0] == []:  # an empty list: the environment's
                for var in spec.setting.env:
                    if environ.get(var, "").strip():
                        try:
                            value = spec.parse(environ[var])
                        except ValueError as e:
                            raise self.error(f"${var}: {e}") from None
                        given[name] = ([value] if spec.kind == "list" else value, var)
                        break
        return Values(self, given)


class Values:
    """The resolved settings of one command line: each value and where it came from."""

    def __init__(self, settings: Settings, given: dict[str, tuple[Any, str]]) -> None:
        self.settings = settings
        self._given = given
        self._set: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        """The value: set by the command, else given, else the default (None where required)."""
        if name in self._set:
            return self._set[name]
        if name in self._given:
            return self._given[name][0]
        default = self.settings.specs[name].default()
        return None if default is MISSING else default

    def __setitem__(self, name: str, value: Any) -> None:
        """Replace a value (a command's own rule); where it came from stays."""
        self._set[name] = value

    def given(self, name: str) -> bool:
        """Whether a flag, the file or the environment set it."""
        return name in self._given

    def where(self, name: str) -> str:
        """The flag, 'key ... in FILE' or environment variable that set it, else its flag."""
        if name in self._given:
            return self._given[name][1]
        return self.flag(name)

    def flag(self, name: str) -> str:
        spec = self.settings.specs.get(name)
        return spec.flag if spec is not None else name

    def error(self, name: str, problem: str) -> Exception:
        """The command's error for ``problem`` with setting ``name``, naming where it was set."""
        return self.settings.error(f"{self.where(name)}: {problem}")

    def explain(self, e: FieldError) -> Exception:
        """A ``validate()`` error as the command's error, fields named by flag or key."""
        return self.error(e.name, e.problem(self.flag))

    def build(self, cls: type | None = None) -> Any:
        """The config object (``root`` by default) from these values, nested ones included."""
        cls = cls or self.settings.root
        nested = self.settings.nested.get(cls, {})
        kw: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in nested:
                kw[f.name] = self.build(nested[f.name])
            elif f.name in self.settings.specs:
                value = self[f.name]
                if value is not None or f.default is None:  # a required field stays missing
                    kw[f.name] = value
        return cls(**kw)
