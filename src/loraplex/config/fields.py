"""How a config field declares its setting: ``field(default=..., metadata=setting("--flag", ...))``
names its flags, value parser, bounds, choices, environment fallback and help once; the
dataclass's ``validate()`` checks the declared syntax and bounds (``check_fields``) and raises
``FieldError``, which a command names by flag or key (:mod:`loraplex.config.settings` turns the
declarations into a command's parser, config-file keys and constructor call).

Also the scalar value parsers a declaration names (``integer``, ``seconds``, ``human_int``, ...).
Torch-free and importing nothing of loraplex: the config layer (the config objects, the router's
settings) builds on it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import Field, dataclass, fields
from decimal import Decimal
from typing import Any

__all__ = [
    "UNSET",
    "FieldError",
    "Setting",
    "check_fields",
    "human_int",
    "integer",
    "nonempty",
    "number",
    "seconds",
    "setting",
    "setting_of",
    "stripped",
]

_KEY = "loraplex.setting"  # the metadata key of a field's Setting


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


UNSET: Any = _Unset()  # no command default of its own: the field's

# --------------------------------------------------------------------------- value parsers
# Each takes the text of one flag value (or a string from a config file) and returns the typed
# value, or raises ValueError with a message that does not repeat the flag name.


def integer(text: str) -> int:
    """An integer: '8', ' -1 '."""
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"expected integer, got {text!r}") from None


def number(text: str) -> float:
    """A number: '0.5', '1e3'."""
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None


def nonempty(text: str) -> str:
    """Any text but blank, kept as typed."""
    if not text.strip():
        raise ValueError("must not be empty")
    return text


def stripped(text: str) -> str:
    """Non-blank text without surrounding whitespace."""
    return nonempty(text).strip()


def human_int(text: str) -> int:
    """vLLM's readable integers: '2048', '32k' (32000), '32K' (32768), '1.5m' (1500000)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtKMGT]?)\s*", text)
    if m is None:
        raise ValueError(f"expected an integer such as 4096, 32k or 32K, got {text!r}")
    num, unit = Decimal(m.group(1)), m.group(2)
    mult = 1
    if unit:
        power = "kmgt".index(unit.lower()) + 1
        mult = (1024 if unit.isupper() else 1000) ** power
    value = num * mult
    if value != value.to_integral_value():
        raise ValueError(f"{text!r} is not a whole number")
    return int(value)


def seconds(text: str) -> float:
    """A non-negative number of seconds: '0', '2.5', '30s'."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*s?\s*", text)
    if m is None:
        raise ValueError(f"expected a number of seconds such as 5 or 2.5, got {text!r}")
    return float(m.group(1))


# --------------------------------------------------------------------------- declaration


@dataclass(frozen=True)
class Setting:
    """How one config field is set from outside: flags (the first is named in errors), parser,
    bounds and help. Fields without flags declare bounds only (checked by ``validate()``)."""

    flags: tuple[str, ...] = ()
    help: str = ""  # {default}, {env} and {choices} are filled in
    parse: Callable[[str], Any] | None = None  # text -> value (one item of a list)
    coerce: Callable[[object], Any] | None = None  # a config-file value -> value (else by type)
    metavar: str | None = None
    choices: tuple[Any, ...] | None = None
    ge: float | None = None  # bounds of a number, inclusive (ge, le) or exclusive (gt)
    gt: float | None = None
    le: float | None = None
    env: tuple[str, ...] = ()  # environment variables read when neither flag nor file sets it
    nargs: str | None = "+"  # lists: '+' takes many values per flag; None one (repeat the flag)
    keys: tuple[str, ...] = ()  # config-file keys besides the flag names
    group: str | None = None  # argparse group in the help
    cli_default: Any = UNSET  # the commands' default where it differs from the field's

    def problem(self, value: object) -> str | None:
        """What is wrong with ``value`` by this declaration alone (syntax, choices, bounds)."""
        if value is None:
            return None
        if isinstance(value, str) and self.parse is not None:
            try:
                self.parse(value)
            except ValueError as e:
                return str(e)
        if self.choices is not None and value not in self.choices:
            return f"expected one of {', '.join(map(str, self.choices))}, got {value!r}"
        if isinstance(value, int | float) and not isinstance(value, bool):
            ok = (
                (self.ge is None or value >= self.ge)
                and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le)
            )
            if not ok:
                return f"must be {self.bounds()}, got {value!r}"
        return None

    def bounds(self) -> str:
        """'>= 1', '> 0', 'between 0 and 65535', '> 0 and <= 1'."""
        if self.ge is not None and self.le is not None:
            return f"between {self.ge} and {self.le}"
        limits = ((">=", self.ge), (">", self.gt), ("<=", self.le))
        return " and ".join(f"{op} {b}" for op, b in limits if b is not None)


def setting(*flags: str, **details: Any) -> dict[str, Setting]:
    """Field metadata declaring a setting: ``field(default=8, metadata=setting("--max-loras",
    ge=1, help="... (default: {default})"))``; ``details`` are ``Setting``'s fields."""
    return {_KEY: Setting(flags=flags, **details)}


def setting_of(f: Field[Any]) -> Setting | None:
    """The setting a dataclass field declares, if any."""
    s = f.metadata.get(_KEY)
    return s if isinstance(s, Setting) else None


class FieldError(ValueError):
    """Field ``name`` of a config object breaks a rule. ``problem`` may name other fields
    through the label function it is given, so the Python API names fields and a command line
    names flags (``Values.explain``)."""

    def __init__(
        self, owner: object, name: str, problem: str | Callable[[Callable[[str], str]], str]
    ) -> None:
        self.name = name
        self._problem = problem
        super().__init__(f"invalid {type(owner).__name__}.{name}: {self.problem(lambda n: n)}")

    def problem(self, label: Callable[[str], str]) -> str:
        """The problem with other fields named by ``label`` (field name -> text)."""
        return self._problem if isinstance(self._problem, str) else self._problem(label)


def check_fields(obj: object) -> None:
    """Raise FieldError for the first field of dataclass ``obj`` its declaration rejects."""
    for f in fields(obj):  # type: ignore[arg-type]
        s = setting_of(f)
        if s is not None and (problem := s.problem(getattr(obj, f.name))) is not None:
            raise FieldError(obj, f.name, problem)
