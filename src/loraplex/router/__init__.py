"""Residency-aware router over many replicas (``loraplex route``). Never imports torch.

``scoring`` decides (pure functions), ``replicas`` knows the replicas (discovery, polls,
ejection), ``app`` proxies the OpenAI API, ``cli`` parses ``loraplex route``'s flags.
"""

from loraplex.router.scoring import POLICIES, Decision, ReplicaView, Thresholds, Weights, choose

__all__ = ["POLICIES", "Decision", "ReplicaView", "Thresholds", "Weights", "choose"]
