"""Typed engine configuration, passed explicitly (no module-level singletons)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    """Settings of one engine; names follow vLLM's so users recognise them."""

    model: str
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    seed: int = 0
    # LoRA
    enable_lora: bool = True
    max_loras: int = 8
    max_cpu_loras: int = 32
    max_lora_rank: int = 64
    # KV cache and scheduling
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # None: a default sized from device memory
    num_kv_blocks: int | None = None  # explicit override of the block count (tests)
    max_model_len: int | None = None  # None: from the model config (capped)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    skip_tokenizer_init: bool = False
    num_threads: int | None = None  # CPU intra-op threads; None: torch's default

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        checks = [
            ("max_loras", self.max_loras >= 1),
            ("max_cpu_loras", self.max_cpu_loras >= self.max_loras),
            ("max_lora_rank", self.max_lora_rank >= 1),
            ("block_size", self.block_size >= 1),
            ("max_num_seqs", self.max_num_seqs >= 1),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 1),
            ("dtype", self.dtype in ("auto", "float32", "bfloat16", "float16")),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"invalid EngineConfig.{name}: {getattr(self, name)!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("invalid EngineConfig.kv_cache_memory_bytes: must be > 0")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("invalid EngineConfig.num_kv_blocks: must be >= 1")
