"""The engine's configuration: its declared settings (:mod:`loraplex.config.engine_fields`, the
flag table), the rules between them (``validate``) and the values derived from them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from loraplex.config.engine_fields import DEFAULT_MAX_CPU_LORAS, EngineFields
from loraplex.config.fields import FieldError, check_fields
from loraplex.config.parallel import Rendezvous
from loraplex.config.speculative import SpeculativeConfig, parse_speculative_config
from loraplex.config.values import rank_budget_map, slo_class_table, tenant_class_map


@dataclass(frozen=True)
class EngineConfig(EngineFields):
    """Settings of one engine; names follow vLLM's so users recognise them. Frozen: derive a
    changed one with ``dataclasses.replace``."""

    def __post_init__(self) -> None:
        """The one default that depends on another field: ``max_cpu_loras`` not given is
        ``max(max_loras, DEFAULT_MAX_CPU_LORAS)`` (a value given below ``max_loras`` is
        :meth:`validate`'s error)."""
        if self.max_cpu_loras is None and isinstance(self.max_loras, int):
            object.__setattr__(self, "max_cpu_loras", max(self.max_loras, DEFAULT_MAX_CPU_LORAS))

    @property
    def generation_overrides(self) -> dict[str, object]:
        """``override_generation_config`` as a mapping (empty when not set)."""
        if self.override_generation_config is None:
            return {}
        value = json.loads(self.override_generation_config)
        return dict(value) if isinstance(value, dict) else {}

    def speculative(self) -> SpeculativeConfig | None:
        """``speculative_config`` parsed (None: no speculative decoding)."""
        if self.speculative_config is None:
            return None
        return parse_speculative_config(self.speculative_config)

    def slo_class_weights(self) -> tuple[tuple[str, float], ...]:
        """``slo_classes`` as ((name, weight), ...), most important first."""
        return slo_class_table(self.slo_classes)

    def tenant_classes(self) -> dict[str, str]:
        """``tenant_slo_classes`` as {tenant: class name} (empty when not set)."""
        return tenant_class_map(self.tenant_slo_classes) if self.tenant_slo_classes else {}

    def rank_slot_budgets(self) -> dict[int, int]:
        """``lora_rank_slot_budgets`` as {bucket's largest rank: slots} (empty when not set)."""
        return rank_budget_map(self.lora_rank_slot_budgets) if self.lora_rank_slot_budgets else {}

    def lora_slot_count(self, bytes_per_slot: int, available_bytes: int) -> int:
        """Device slots the bank gets: ``max_loras``, fewer when ``max_lora_device_fraction``
        of ``available_bytes`` (the memory left after the weights) cannot hold that many slots
        of ``bytes_per_slot`` (a slot is sized for ``max_lora_rank``). Raises ValueError naming
        the flag when not even one fits."""
        if self.max_lora_device_fraction is None:
            return self.max_loras
        cap = int(available_bytes * self.max_lora_device_fraction)
        fits = cap // bytes_per_slot
        if fits < 1:
            raise ValueError(
                f"--max-lora-device-fraction {self.max_lora_device_fraction:g} of "
                f"{available_bytes} bytes ({cap}) cannot hold one adapter slot of rank "
                f"{self.max_lora_rank} ({bytes_per_slot} bytes): raise it or lower "
                "--max-lora-rank"
            )
        return min(self.max_loras, fits)

    def device_kv_budget(self, free_bytes: int, total_bytes: int) -> int:
        """KV-cache bytes on a CUDA device, by vLLM's ``--gpu-memory-utilization``: this server
        may use ``total x utilization`` in all, and what the device already holds (the weights
        just loaded, other processes) comes out of it; activations use the rest of the device.
        Raises ValueError naming the flag when nothing is left."""
        used = total_bytes - free_bytes
        budget = int(total_bytes * self.gpu_memory_utilization) - used
        if budget <= 0:
            gib = 1 << 30
            raise ValueError(
                f"--gpu-memory-utilization {self.gpu_memory_utilization:g} leaves no memory for "
                f"the KV cache: {used / gib:.1f} GiB of the device's {total_bytes / gib:.1f} GiB "
                "are in use already (raise it, or set --kv-cache-memory)"
            )
        return budget

    def rendezvous(self) -> Rendezvous:
        """Where this node's tensor-parallel ranks meet the others, and which are its own."""
        local = self.tensor_parallel_size // self.nnodes
        return Rendezvous(
            self.tensor_parallel_size,
            self.master_addr,
            self.master_port,
            self.node_rank * local,
            local,
        )

    def validate(self) -> None:
        """Raise FieldError (a ValueError) naming the first invalid field."""
        check_fields(self)  # the declared syntax, choices and bounds of every field
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise FieldError(
                self,
                "max_cpu_loras",
                lambda n: (
                    f"must be >= {n('max_loras')} ({self.max_loras}), got {self.max_cpu_loras}"
                ),
            )
        names = [n for n, _ in self.slo_class_weights()]
        if self.default_slo_class not in names:
            raise FieldError(
                self,
                "default_slo_class",
                lambda n: (
                    f"{self.default_slo_class!r} is not one of {n('slo_classes')} "
                    f"({', '.join(names)})"
                ),
            )
        unknown = sorted(set(self.tenant_classes().values()) - set(names))
        if unknown:
            raise FieldError(
                self,
                "tenant_slo_classes",
                lambda n: (
                    f"class {unknown[0]!r} is not one of {n('slo_classes')} ({', '.join(names)})"
                ),
            )
        budgets = self.rank_slot_budgets()
        if budgets and max(budgets) < self.max_lora_rank:
            raise FieldError(
                self,
                "lora_rank_slot_budgets",
                lambda n: (
                    f"the largest bucket (rank {max(budgets)}) must be >= "
                    f"{n('max_lora_rank')} ({self.max_lora_rank}) so every adapter has a bucket"
                ),
            )
        over = next((r for r, k in budgets.items() if k > self.max_loras), None)
        if over is not None:
            raise FieldError(
                self,
                "lora_rank_slot_budgets",
                lambda n: (
                    f"rank {over}: {budgets[over]} slots exceed {n('max_loras')} ({self.max_loras})"
                ),
            )
        if self.disk_cache_dir is not None and self.disk_cache_bytes is None:
            raise FieldError(
                self,
                "disk_cache_dir",
                lambda n: f"needs {n('disk_cache_bytes')} (the disk tier's byte budget)",
            )
        if self.disk_cache_bytes is not None and self.disk_cache_dir is None:
            raise FieldError(self, "disk_cache_bytes", lambda n: f"needs {n('disk_cache_dir')}")
        tp = self.tensor_parallel_size
        if tp % self.nnodes:
            raise FieldError(
                self,
                "tensor_parallel_size",
                lambda n: f"{tp} ranks do not split evenly over {n('nnodes')} ({self.nnodes})",
            )
        if self.node_rank >= self.nnodes:
            raise FieldError(
                self, "node_rank", lambda n: f"must be < {n('nnodes')} ({self.nnodes})"
            )
        if self.nnodes > 1 and not self.master_port:
            raise FieldError(self, "master_port", lambda n: f"must be set with {n('nnodes')} > 1")
        if tp > 1 and self.device.startswith("cuda"):
            raise FieldError(
                self,
                "tensor_parallel_size",
                lambda n: f"{tp} runs on CPU (gloo) in this version; on CUDA use 1",
            )
