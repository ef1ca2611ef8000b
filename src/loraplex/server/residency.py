"""``GET /v1/adapters``: where each adapter the caller may use lives now (device, host, disk or
absent), with its counters, and, for operators, every other adapter still in memory.

Adapters with a warm window schedule (``--lora-modules`` ``warm`` objects) also show it as
``warm_window``, with ``prewarmed``: the tier the prewarm scheduler holds them pinned in now.

A caller sees only what ``/v1/models`` shows it; adapters resident in memory but no longer
registered are listed for operator keys only (their names could belong to any tenant). For a
tenant key the ``tiers`` totals count only the adapters it sees, and ``path`` (a server path)
is shown to operator keys only.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from loraplex.engine.client import AdapterResidency
from loraplex.registry import Manifest, Principal
from loraplex.server.auth import inference_principal
from loraplex.server.catalog import registration_order, release_view
from loraplex.server.state import ServerState, get_state

router = APIRouter()


@router.get("/v1/adapters")
def list_adapters(
    principal: Principal = Depends(inference_principal),
    state: ServerState = Depends(get_state),
) -> dict[str, Any]:
    return residency_view(state, principal)


def residency_view(state: ServerState, principal: Principal) -> dict[str, Any]:
    """Every servable name the caller may see (its active revision's tiers, and its canary's),
    plus, for operators, every other adapter still in memory."""
    client = state.client
    rows: list[dict[str, Any]] = []
    if not client.lora_enabled:
        return {"object": "list", "data": rows, "max_loras": 0}
    snapshot = {r.ref.sha256: r for r in client.residency()}
    seen: set[str] = set()

    def row_of(m: Manifest) -> dict[str, Any]:
        r = snapshot.get(m.sha256)
        seen.add(m.sha256)
        local = client.is_local_source(state.adapter_spec(m))
        if r is None:
            row: dict[str, Any] = {
                **_EMPTY_ROW,
                "sha256": m.sha256[:16],
                "tier": "disk" if local else "absent",
                "rank": m.rank,
                "bytes": None,
                "warm_policy": m.warm_policy,
            }
        else:
            row = _row(r)
            if r.tier == "absent" and local:
                row["tier"] = "disk"  # evicted from memory, its directory is on local disk
        row["revision"] = m.revision
        return row

    operator = principal.tenant is None
    held = state.prewarm.held() if state.prewarm is not None else {}
    for sv in sorted(state.catalog.visible(principal), key=registration_order):
        path = sv.active.source_uri if operator else None
        row = {"name": sv.name, "path": path, "registered": True,
               "tenant": sv.active.tenant, **row_of(sv.active)}  # fmt: skip
        if sv.canary is not None:
            row["canary"] = {**row_of(sv.canary), "weight": sv.canary_weight}
        row.update(release_view(sv, principal, state.canary))  # canary health, last rollback
        schedule = state.warm_windows.get(sv.name)
        if schedule is not None:
            row["warm_window"] = schedule.to_dict()
            row["prewarmed"] = held.get(sv.name)
        rows.append(row)
    if operator:
        for d, r in snapshot.items():
            if d in seen or r.tier == "absent":
                continue
            names = state.catalog.names_of(d)
            rows.append(
                {
                    "name": names[0] if names else r.ref.name,
                    "path": None,
                    "registered": False,
                    **_row(r),
                }
            )
    # a tenant's totals count only the adapters it sees
    counts = client.resident_bytes() if operator else client.resident_bytes_of(seen)
    return {
        "object": "list",
        "data": rows,
        "max_loras": client.max_loras,
        "max_cpu_loras": client.max_cpu_loras,
        "tiers": {t: {"count": n, "bytes": b} for t, (n, b) in counts.items()},
        "policy": client.policy_name,
    }


_EMPTY_ROW: dict[str, Any] = {
    "hits": 0, "loads": 0, "evictions": 0, "last_access": None, "pinned": False,
    "in_flight": 0, "slot": None,
}  # fmt: skip


def _row(r: AdapterResidency) -> dict[str, Any]:
    return {
        "revision": r.ref.revision,
        "sha256": r.ref.sha256[:16],
        "tier": r.tier,
        "rank": r.rank,
        "bytes": r.nbytes,
        "hits": r.hits,
        "loads": r.loads,
        "evictions": r.evictions,
        "last_access": r.last_access or None,
        "pinned": r.pinned,
        "warm_policy": r.warm_policy,
        "in_flight": r.in_flight,
        "slot": r.slot,
    }
