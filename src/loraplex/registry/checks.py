"""Argument checks shared by the registry's stores: names, revisions, tenant limits.

Each check returns the value it accepted (normalised where said) or raises
:class:`RegistryError` with a message naming the argument and what is allowed.
"""

from __future__ import annotations

import math
import re
from typing import Any

from loraplex.registry.errors import RegistryError

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
REVISION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_name(kind: str, value: Any, pattern: re.Pattern[str]) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value) or ".." in value:
        raise RegistryError(
            f"invalid {kind} {value!r}: use letters, digits and . _ - "
            f"(starting with a letter or digit){', : and /' if kind == 'adapter name' else ''}"
        )
    return value


def check_limit(key: str, value: Any) -> Any:
    """A tenant limit: None (no limit), ``rate_limit_rps`` a positive number (as float), the
    others a non-negative integer."""
    if value is None:
        return None
    if key == "rate_limit_rps":
        if (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or not math.isfinite(value)
            or value <= 0
        ):
            raise RegistryError(f"rate_limit_rps must be a positive number, got {value!r}")
        return float(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RegistryError(f"{key} must be a non-negative integer, got {value!r}")
    return value
