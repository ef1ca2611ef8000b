"""A pushed adapter under tensor parallelism: each rank serves its own cut of it.

Nothing about a push is TP-specific: rank 0's cache holds the pushed adapter whole (host tier),
and a device-slot fill goes through the mirrored slot bank (``lora.tensor_parallel``), which
sends every worker the whole weights; each worker cuts its shard (``TensorParallel.shard_lora``,
wired in ``engine.builder``) as for an adapter read from disk. So a push to a TP=2 server must
give PEFT's greedy tokens with the pushed weights, revision after revision.
"""

from __future__ import annotations

from pathlib import Path

from loraplex.client import push_adapter
from loraplex.config import EngineConfig, ServerConfig
from loraplex.server.app import create_app
from loraplex.testing import make_random_model, reference_greedy
from loraplex.testing.server import serve_in_thread
from loraplex.testing.sync import EVENT_TIMEOUT_S
from tests.router.push_double import (
    PROMPT,
    greedy_tokens,
    peft_trainee,
    reseed,
    served_revision,
)

ADMIN = "sk-admin-tp-push"


def test_each_rank_serves_its_cut_of_a_pushed_adapter(tmp_path: Path) -> None:
    # two KV heads, one per rank; float32 so greedy tokens match PEFT's exactly
    model = make_random_model(tmp_path / "model", num_kv_heads=2, num_layers=2, seed=4)
    config = ServerConfig(
        EngineConfig(model=str(model), tensor_parallel_size=2, dtype="float32", num_threads=1,
                     enable_lora=True, max_loras=1, max_cpu_loras=2),
        served_model_name=["tiny"], admin_api_key=ADMIN, log_level="warning",
    )  # fmt: skip
    trainee = peft_trainee(model, seed=31)
    with serve_in_thread(create_app(config), timeout=EVENT_TIMEOUT_S) as url:
        for step in (1, 2):
            if step == 2:
                reseed(trainee, seed=32)
            push_adapter(url, "trainee", trainee, api_key=ADMIN, revision=f"step-{step}")
            want, _ = reference_greedy(trainee, PROMPT, 6)
            tokens, headers = greedy_tokens(url, "trainee", ADMIN)
            assert tokens == want and served_revision(headers) == f"step-{step}", step
