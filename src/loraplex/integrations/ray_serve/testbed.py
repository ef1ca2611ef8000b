"""A tiny fleet workload for the Ray Serve tests and benchmark: a random Llama, ``n`` random
PEFT adapters and a shared SQLite registry holding them (active, warmed on demand only, so
every replica starts with empty adapter tiers and a cold start is a real load).

Everything is generated in a directory the caller owns; nothing is downloaded. Needs the
``dev`` extra (transformers, peft).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.config import EngineConfig, ServerConfig
from loraplex.registry import Registry, RegistryPolicy, base_model_info
from loraplex.testing import make_random_adapter, make_random_model

__all__ = ["BASE_NAME", "TinyFleet", "make_tiny_fleet"]

BASE_NAME = "tiny"


@dataclass(frozen=True)
class TinyFleet:
    root: Path
    model: Path
    adapters: dict[str, Path]  # served name -> directory
    registry_url: str

    def server_config(
        self,
        *,
        max_loras: int = 1,
        max_cpu_loras: int = 2,
        max_model_len: int = 1024,
        **server: Any,
    ) -> ServerConfig:
        """A ``ServerConfig`` for one replica: small adapter tiers (``max_loras`` device
        slots, ``max_cpu_loras`` adapters in host memory), one engine thread, the registry."""
        engine = EngineConfig(
            model=str(self.model),
            enable_lora=True,
            max_loras=max_loras,
            max_cpu_loras=max_cpu_loras,
            max_lora_rank=16,
            num_threads=1,
            dtype="float32",
            max_model_len=max_model_len,
        )
        defaults: dict[str, Any] = {
            "served_model_name": [BASE_NAME],
            "registry_url": self.registry_url,
            "registry_poll_s": 0.5,
            "allowed_lora_roots": [str(self.root / "adapters")],
            "log_level": "warning",
            "disable_log_stats": True,
        }
        return ServerConfig(engine, **{**defaults, **server})


def make_tiny_fleet(root: str | Path, n_adapters: int = 4, *, rank: int = 8) -> TinyFleet:
    """Build (or reuse, when already built under ``root``) the model, adapters and registry."""
    root = Path(root)
    model = root / "model"
    if not (model / "config.json").exists():
        make_random_model(
            model, hidden_size=64, num_layers=2, intermediate_size=128, max_position_embeddings=2048
        )
    adapters: dict[str, Path] = {}
    for i in range(n_adapters):
        name = f"a{i}"
        path = root / "adapters" / name
        if not (path / "adapter_config.json").exists():
            make_random_adapter(model, path, r=rank, seed=100 + i)
        adapters[name] = path
    url = f"sqlite:///{root / 'registry.db'}"
    policy = RegistryPolicy(allowed_roots=(str(root / "adapters"),))
    with Registry.open(url, policy=policy) as reg:
        base = base_model_info(model, name=BASE_NAME)
        for name, path in adapters.items():
            m = reg.register(path, name, base=base, actor="testbed")
            if m.status != "active":
                reg.activate(name, m.revision, actor="testbed")
    return TinyFleet(root, model, adapters, url)
