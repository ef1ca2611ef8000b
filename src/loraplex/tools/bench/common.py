"""What every benchmark client shares: the percentile and the SSE stream reader.

No torch and no httpx at import time: the router's benchmarks use it too.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from typing import Any


def percentile(xs: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no data.

    ``sorted(xs)[clamp(ceil(q / 100 * n) - 1, 0, n - 1)]``: always one of the samples."""
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


class SSEDecodeError(ValueError):
    """A ``data:`` line of an event stream that is not JSON; ``data`` holds the line's payload."""

    def __init__(self, data: str) -> None:
        super().__init__(f"bad SSE data: {data[:120]!r}")
        self.data = data


async def sse_json(lines: AsyncIterable[str]) -> AsyncIterator[Any]:
    """The JSON value of each ``data:`` line of an OpenAI-style event stream, up to ``[DONE]``.

    Other lines (blank separators, comments, ``event:``) are skipped; a payload that is not JSON
    raises :class:`SSEDecodeError`. Use it under ``contextlib.aclosing`` when breaking out early.
    """
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            raise SSEDecodeError(data) from None
        yield obj
