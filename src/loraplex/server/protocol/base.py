"""What every request body shares: strict pydantic bodies that keep unknown fields (to log them
once per name, :class:`UnknownFields`), text that must be valid Unicode, and the 400 of a
field whose value we cannot honour (:func:`refuse`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Annotated, NoReturn

from pydantic import AfterValidator, BaseModel, ConfigDict

from loraplex.types import InvalidRequestError

log = logging.getLogger("loraplex.server.app")


def _utf8(value: str) -> str:
    """JSON may carry lone surrogates (``"\\ud800"``); they cannot be tokenized or encoded."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError("text must be valid Unicode (it contains a lone surrogate)") from e
    return value


Text = Annotated[str, AfterValidator(_utf8)]


class Body(BaseModel):
    """A request body: strict types, unknown fields kept (and logged, never an error)."""

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)


def refuse(name: str, why: str) -> NoReturn:
    """A 400 naming field ``name``: a value of it we cannot honour."""
    raise InvalidRequestError(f"{name} is not supported: {why}", param=name)


def unknown_fields(body: BaseModel, prefix: str = "") -> Iterator[str]:
    """Dotted names of the fields in ``body`` (and its nested bodies) that no model defines."""
    for name in body.model_extra or {}:
        yield prefix + name
    for name in body.model_fields_set:
        value = getattr(body, name)
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, BaseModel):
                suffix = "[]." if isinstance(value, list) else "."
                yield from unknown_fields(item, f"{prefix}{name}{suffix}")


class UnknownFields:
    """Logs each unknown request field once per route (a warning), so a client relying on a
    field we do not define learns it from the log without the log growing per request."""

    def __init__(self, max_names: int = 1024) -> None:
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self.max_names = max_names  # distinct names remembered (bounded: names come from clients)

    def note(self, route: str, body: BaseModel) -> list[str]:
        """Log the unknown fields of ``body`` not logged before; returns those logged."""
        fresh = []
        with self._lock:
            for name in dict.fromkeys(unknown_fields(body)):
                key = (route, name[:100])
                if key in self._seen or len(self._seen) >= self.max_names:
                    continue
                self._seen.add(key)
                fresh.append(key[1])
        if fresh:
            log.warning(
                "%s: the request field(s) %s are not part of the API and were ignored "
                "(logged once per field name)",
                route,
                ", ".join(repr(n) for n in fresh),
            )
        return fresh
