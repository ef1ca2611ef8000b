"""An adapter's ``warm`` setting: a warm policy, or a schedule of warm windows.

The one declaration of the warm policies (:data:`WarmPolicy`) and of the window schedule's
syntax (:func:`parse_warm`), for every layer that reads a ``warm``: ``--lora-modules``
(``loraplex.config``), registry manifests, the admin API, and the cache's prewarm scheduler,
which turns a :class:`WarmSchedule` into times (``loraplex.cache.prewarm.windows``).

Torch-free and importing nothing of loraplex (the standard library only).
"""

from __future__ import annotations

import re
import typing
from dataclasses import dataclass
from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

__all__ = [
    "MAX_WARM_LEAD_S",
    "MAX_WARM_TEXT",
    "MAX_WARM_WINDOWS",
    "WARM_POLICIES",
    "WEEKDAYS",
    "WarmPolicy",
    "WarmSchedule",
    "WarmWindow",
    "parse_warm",
    "parse_warm_windows",
]

WarmPolicy = Literal["device-preferred", "host", "on-demand"]
"""How an adapter is warmed at start-up: pinned in its device slot, pinned in host memory, or
loaded on first use."""
WARM_POLICIES: tuple[WarmPolicy, ...] = typing.get_args(WarmPolicy)

WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
MAX_WARM_WINDOWS = 16  # per tier of one adapter
MAX_WARM_TEXT = 256  # characters of one tier's window list
MAX_WARM_LEAD_S = 86400.0
_WINDOW = re.compile(
    r"\s*(?P<days>[a-z]{3}(?:\s*-\s*[a-z]{3})?|daily)\s+"
    r"(?P<h0>\d{2}):(?P<m0>\d{2})\s*-\s*(?P<h1>\d{2}):(?P<m1>\d{2})\s*",
    re.IGNORECASE,
)
_SCHEDULE_EXAMPLE = '{"device": "Mon-Fri 08:00-18:00", "tz": "Europe/Berlin"}'


@dataclass(frozen=True)
class WarmWindow:
    """Local ``[start, end)`` minutes of the day on the weekdays ``first`` to ``last``
    (0 = Monday; wrapping: Fri-Mon is 4 to 0)."""

    first: int
    last: int
    start_min: int
    end_min: int  # <= 24 * 60; > start_min (a window never crosses midnight)

    @property
    def days(self) -> frozenset[int]:
        return frozenset((self.first + k) % 7 for k in range((self.last - self.first) % 7 + 1))

    def __str__(self) -> str:
        """The manifest form: 'Mon-Fri 08:00-18:00', 'daily 00:00-01:00'."""
        if (self.first, self.last) == (0, 6):
            text = "daily"
        elif self.first == self.last:
            text = WEEKDAYS[self.first].title()
        else:
            text = f"{WEEKDAYS[self.first].title()}-{WEEKDAYS[self.last].title()}"
        h0, m0, h1, m1 = *divmod(self.start_min, 60), *divmod(self.end_min, 60)
        return f"{text} {h0:02d}:{m0:02d}-{h1:02d}:{m1:02d}"


@dataclass(frozen=True)
class WarmSchedule:
    """When an adapter should be warm: windows per tier in the time zone ``tz``.

    ``device`` windows load it and pin it in host memory and its device slot, ``host`` windows
    pin it in host memory; ahead of each opening by the prewarm scheduler's lead (``lead_s``
    when given), released after the close. Outside them the adapter is ``on-demand``.
    """

    tz: str
    device: tuple[WarmWindow, ...] = ()
    host: tuple[WarmWindow, ...] = ()
    lead_s: float | None = None

    def to_dict(self) -> dict[str, object]:
        """The manifest form (what :func:`parse_warm` reads back)."""
        out: dict[str, object] = {"tz": self.tz}
        for tier in ("device", "host"):
            wins = getattr(self, tier)
            if wins:
                out[tier] = ", ".join(map(str, wins))
        if self.lead_s is not None:
            out["lead_s"] = self.lead_s
        return out


def parse_warm_windows(text: object, field_name: str) -> tuple[WarmWindow, ...]:
    """``"Mon-Fri 08:00-18:00, Sat 09:00-12:00"`` (or a list of such strings) -> windows.

    Days: ``Mon``, a range ``Mon-Fri`` (wrapping: ``Fri-Mon``) or ``daily``; times ``HH:MM``,
    the end after the start (``24:00`` allowed; no window crosses midnight: write two)."""
    items = text if isinstance(text, list) else [text]
    if len(items) > MAX_WARM_WINDOWS:
        raise ValueError(f"{field_name!r} has more than {MAX_WARM_WINDOWS} windows")
    parts: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"{field_name!r} must be a string like 'Mon-Fri 08:00-18:00'")
        if len(item) > MAX_WARM_TEXT:
            raise ValueError(f"{field_name!r} is longer than {MAX_WARM_TEXT} characters")
        parts += [p for p in item.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"{field_name!r} names no window (e.g. 'Mon-Fri 08:00-18:00')")
    if len(parts) > MAX_WARM_WINDOWS:
        raise ValueError(f"{field_name!r} has more than {MAX_WARM_WINDOWS} windows")
    out = []
    for part in parts:
        m = _WINDOW.fullmatch(part)
        if m is None:
            raise ValueError(
                f"{field_name!r}: bad window {part.strip()!r} (expected e.g. 'Mon-Fri 08:00-18:00')"
            )
        days_text = m["days"].lower().replace(" ", "")
        if days_text == "daily":
            i, j = 0, 6
        else:
            first, _, last = days_text.partition("-")
            try:
                i = WEEKDAYS.index(first)
                j = WEEKDAYS.index(last) if last else i
            except ValueError:
                raise ValueError(
                    f"{field_name!r}: bad day in {part.strip()!r} (use {', '.join(WEEKDAYS)})"
                ) from None
        h0, m0, h1, m1 = (int(m[g]) for g in ("h0", "m0", "h1", "m1"))
        if h0 > 23 or m0 > 59 or m1 > 59 or h1 > 24 or (h1 == 24 and m1):
            raise ValueError(f"{field_name!r}: bad time in {part.strip()!r}")
        start, end = h0 * 60 + m0, h1 * 60 + m1
        if end <= start:
            raise ValueError(
                f"{field_name!r}: window {part.strip()!r} must end after it starts "
                "(a window across midnight is two windows)"
            )
        out.append(WarmWindow(i, j, start, end))
    return tuple(out)


def parse_warm(value: object, field_name: str = "warm") -> WarmPolicy | WarmSchedule:
    """A ``warm`` value: one of :data:`WARM_POLICIES`, or a schedule
    ``{"device": "Mon-Fri 08:00-18:00", "host": ..., "tz": "Europe/Berlin", "lead_s": 600}``
    (``tz`` required, a ``zoneinfo`` name; at least one of ``device`` / ``host``; ``lead_s``
    optional, 0 to 86400). ValueError naming the field otherwise."""
    if isinstance(value, str):
        if value not in WARM_POLICIES:
            raise ValueError(
                f"{field_name!r} must be one of {', '.join(WARM_POLICIES)} or a window "
                f"schedule like {_SCHEDULE_EXAMPLE}, got {value!r}"
            )
        return typing.cast(WarmPolicy, value)
    if isinstance(value, WarmSchedule):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"{field_name!r} must be a warm policy string or an object")
    allowed = ("device", "host", "tz", "lead_s")
    unknown = [k for k in value if k not in allowed]
    if unknown:
        raise ValueError(
            f"unknown field {field_name}.{unknown[0]!s:.40} (allowed: {', '.join(allowed)})"
        )
    tz = value.get("tz")
    if not isinstance(tz, str) or not tz.strip() or len(tz) > 64:
        raise ValueError(f"'{field_name}.tz' must be a time zone name like 'Europe/Berlin'")
    try:
        ZoneInfo(tz.strip())
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"'{field_name}.tz': unknown time zone {tz!r:.70}") from None
    if "device" not in value and "host" not in value:
        raise ValueError(f"{field_name!r} needs 'device' and/or 'host' windows")
    device = (
        parse_warm_windows(value["device"], f"{field_name}.device") if "device" in value else ()
    )
    host = parse_warm_windows(value["host"], f"{field_name}.host") if "host" in value else ()
    lead = value.get("lead_s")
    if lead is not None:
        if isinstance(lead, bool) or not isinstance(lead, (int, float)):
            raise ValueError(f"'{field_name}.lead_s' must be a number of seconds")
        if not 0 <= lead <= MAX_WARM_LEAD_S:
            raise ValueError(f"'{field_name}.lead_s' must be in [0, {MAX_WARM_LEAD_S:g}]")
        lead = float(lead)
    return WarmSchedule(tz.strip(), device, host, lead)
