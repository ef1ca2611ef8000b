"""``ResidencyRequestRouter``: a Ray Serve request router fed by the replicas' own residency.

Ray Serve builds one in every process holding a handle to the engine deployment (the
ingress); it reads the adapter a request names from its multiplexed model id (the ingress sets
it to the request's ``model``), each replica's residency from its routing stats
(:meth:`~loraplex.integrations.ray_serve.deployments.LoraplexEngine.record_routing_stats`,
refreshed every ``request_routing_stats_period_s``) and the ongoing requests from Ray's
queue-length cache, and ranks replicas by :func:`~.routing.rank_replicas`. Requests without
an adapter (the base model, ``GET`` routes) go to the shorter queue of two random replicas, as
Ray's default router does.

Unlike Ray's default router it keeps no FIFO matching: a replica chosen for a request serves
that request (a replica picked because it holds adapter A is never handed to a request for B).
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from loraplex.integrations.ray_serve.routing import WARM_TIERS, ReplicaView, rank_replicas

__all__ = ["ResidencyRequestRouter"]


class ResidencyRequestRouter(RequestRouter):
    """Affinity to the replicas that hold the adapter, a stable home for a cold one, the
    least-loaded replica once those are saturated (see :mod:`.routing`)."""

    def initialize_state(
        self, saturation: int = 16, pending_s: float = 0.5, max_tracked: int = 4096, **_: Any
    ) -> None:
        """``saturation``: ongoing requests at which a replica takes no more affinity traffic;
        ``pending_s``: how long before a residency report a send still counts as a load the
        report may not show;
        ``max_tracked``: adapters whose last sends are remembered (least recently sent
        forgotten first, so a flood of names bounds this router's memory)."""
        self.saturation = saturation
        self.pending_s = pending_s
        self.max_tracked = max_tracked
        self._sent: OrderedDict[str, dict[str, float]] = OrderedDict()

    def _view(self, r: RunningReplica) -> ReplicaView:
        stats = r.routing_stats or {}
        return ReplicaView(
            id=r.replica_id.unique_id,
            ongoing=self._replica_queue_len_cache.get(r.replica_id),
            max_ongoing=r.max_ongoing_requests,
            adapters=stats.get("adapters", {}),
            host_capacity=int(stats.get("host_capacity", 0)),
            reported_at=float(stats.get("time", 0.0)),
        )

    def _unreported(self, views: list[ReplicaView]) -> dict[str, int]:
        """Per replica: adapters pending there (sent, not yet in its report)."""
        at = {v.id: v for v in views}
        out: dict[str, int] = {}
        for adapter, sends in self._sent.items():
            for rid, t in sends.items():
                v = at.get(rid)
                if (
                    v is not None
                    and t + self.pending_s > v.reported_at
                    and v.adapters.get(adapter) not in WARM_TIERS
                ):
                    out[rid] = out.get(rid, 0) + 1
        return out

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # back off between rounds
        adapter = pending_request.metadata.multiplexed_model_id if pending_request else ""
        if not candidate_replicas:
            return []
        if not adapter:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        views = [self._view(r) for r in candidate_replicas]
        ranking = rank_replicas(
            adapter,
            views,
            self._sent.get(adapter, {}),
            self._unreported(views),
            saturation=self.saturation,
            pending_s=self.pending_s,
        )
        if ranking.home is not None:  # a cold load: its home counts as pending from now on
            self._note_sent(adapter, ranking.home)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[i] for i in rank] for rank in ranking.ranks]

    def _note_sent(self, adapter: str, replica: str) -> None:
        sends = self._sent.pop(adapter, {})
        sends[replica] = time.time()
        self._sent[adapter] = sends
        while len(self._sent) > self.max_tracked:
            self._sent.popitem(last=False)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        adapter = pending_request.metadata.multiplexed_model_id
        if adapter:
            self._note_sent(adapter, replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for sends in self._sent.values():  # forget replicas that left
            for rid in [rid for rid in sends if rid not in live]:
                del sends[rid]
