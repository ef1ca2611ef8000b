"""The offline optimum, Belady's MIN, on a request trace: what the policies are compared with."""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence


def belady_hits(
    keys: Sequence[Hashable],
    capacity_count: int | None = None,
    *,
    sizes: Sequence[int] | None = None,
    capacity_bytes: int | None = None,
) -> list[bool]:
    """Per request: was it a hit under Belady's MIN (evict the farthest next use) on this trace?

    Demand paging: every miss is admitted (as a request needs its adapter resident), so this is
    the exact offline optimum for a count capacity. With ``capacity_bytes`` (and ``sizes``) the
    same rule is applied until the newcomer fits; with variable sizes that is a heuristic, neither
    optimal nor a bound (exact byte-capacity caching is NP-hard). A key larger than the byte
    capacity is a miss and is not admitted.
    """
    if capacity_count is None and capacity_bytes is None:
        raise ValueError("belady: give capacity_count and/or capacity_bytes")
    if capacity_count is not None and capacity_count < 1:
        raise ValueError(f"belady: capacity_count must be >= 1, got {capacity_count}")
    if capacity_bytes is not None and sizes is None:
        raise ValueError("belady: capacity_bytes needs sizes")
    if sizes is not None and len(sizes) != len(keys):
        raise ValueError("belady: sizes and keys differ in length")
    n = len(keys)
    never = n + 1
    next_use = [never] * n
    seen: dict[Hashable, int] = {}
    for i in range(n - 1, -1, -1):
        next_use[i] = seen.get(keys[i], never)
        seen[keys[i]] = i
    resident: dict[Hashable, int] = {}  # key -> its next use
    size_of: dict[Hashable, int] = {}
    used = 0
    heap: list[tuple[int, int, Hashable]] = []  # (-next use, tiebreak, key), lazily invalidated
    hits: list[bool] = []
    for i, k in enumerate(keys):
        size = sizes[i] if sizes is not None else 0
        if k in resident:
            hits.append(True)
        else:
            hits.append(False)
            if capacity_bytes is not None and size > capacity_bytes:
                continue
            while resident and (
                (capacity_count is not None and len(resident) >= capacity_count)
                or (capacity_bytes is not None and used + size > capacity_bytes)
            ):
                nu, _, victim = heapq.heappop(heap)
                if resident.get(victim) == -nu:
                    del resident[victim]
                    used -= size_of.pop(victim)
            size_of[k] = size
            used += size
        resident[k] = next_use[i]
        heapq.heappush(heap, (-next_use[i], i, k))
    return hits


def belady_hit_ratio(
    keys: Sequence[Hashable],
    capacity_count: int | None = None,
    *,
    sizes: Sequence[int] | None = None,
    capacity_bytes: int | None = None,
) -> float:
    """Belady's MIN hit ratio on ``keys``; see :func:`belady_hits`. 0.0 for an empty trace."""
    if not keys:
        return 0.0
    hits = belady_hits(keys, capacity_count, sizes=sizes, capacity_bytes=capacity_bytes)
    return sum(hits) / len(hits)
