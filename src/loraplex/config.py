"""Typed engine configuration, passed explicitly (no module-level singletons)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import Decimal

ADAPTER_EVICTION_POLICIES = ("hybrid", "lru", "lfu", "fifo")
"""Names of ``loraplex.cache.policy.POLICIES`` (checked by a test; config imports nothing)."""


_BYTE_SIZE = re.compile(
    r"\s*((?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)\s*(?:([kmgtp])(i)?)?b?\s*", re.IGNORECASE
)


def parse_byte_size(text: str) -> int:
    """Bytes from '4096', '1e9', '512MiB', '2GiB', '1.5Gi' (powers of 1024) or '1G', '1GB',
    '500M' (powers of 1000); case-insensitive; a trailing 'B' is optional. The one byte-size
    syntax of every flag, config file and workload spec; ``ValueError`` names the problem."""
    m = _BYTE_SIZE.fullmatch(text)
    if m is None:
        raise ValueError(
            f"expected a byte size such as 2GiB, 512MiB, 1G or 1073741824, got {text!r}"
        )
    power = "kmgtp".index(m.group(2).lower()) + 1 if m.group(2) else 0
    return int(Decimal(m.group(1)) * (1024 if m.group(3) else 1000) ** power)


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
    # adapter cache tiers (see loraplex.cache.adapters)
    max_cpu_lora_bytes: int | None = None  # L1 byte budget (with the max_cpu_loras count)
    adapter_eviction_policy: str = "hybrid"  # one of ADAPTER_EVICTION_POLICIES
    disk_cache_dir: str | None = None  # L2 directory (object-store adapters); None: no L2
    disk_cache_bytes: int | None = None  # L2 byte budget (required with disk_cache_dir)
    adapter_min_residency_s: float = 0.0  # a newly loaded adapter is not evicted before this
    adapter_load_timeout_s: float = 10.0  # max wait for room in host memory, then an error
    adapter_store_url: str | None = None  # L3: s3://bucket/prefix, file:///dir or a directory
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
        self._validate_adapter_cache()

    def _validate_adapter_cache(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"invalid EngineConfig.{name}: {getattr(self, name)!r} ({why})")

        if self.max_cpu_lora_bytes is not None and self.max_cpu_lora_bytes <= 0:
            raise bad("max_cpu_lora_bytes", "must be > 0 bytes")
        if self.adapter_eviction_policy.strip().lower() not in ADAPTER_EVICTION_POLICIES:
            raise bad("adapter_eviction_policy", f"one of {', '.join(ADAPTER_EVICTION_POLICIES)}")
        if self.disk_cache_bytes is not None and self.disk_cache_bytes <= 0:
            raise bad("disk_cache_bytes", "must be > 0 bytes")
        if self.disk_cache_dir is not None and self.disk_cache_bytes is None:
            raise bad("disk_cache_bytes", "required with disk_cache_dir")
        if self.disk_cache_bytes is not None and self.disk_cache_dir is None:
            raise bad("disk_cache_dir", "required with disk_cache_bytes")
        if not self.adapter_min_residency_s >= 0:
            raise bad("adapter_min_residency_s", "must be >= 0 seconds")
        if not self.adapter_load_timeout_s > 0:
            raise bad("adapter_load_timeout_s", "must be > 0 seconds")
        url = self.adapter_store_url
        if url is not None:
            scheme, sep, rest = url.partition("://")
            if not url or (sep and scheme.lower() not in ("s3", "file")):
                raise bad("adapter_store_url", "expected s3://bucket/prefix, file:///dir or a path")
            if sep and scheme.lower() == "s3" and not rest.split("/", 1)[0]:
                raise bad("adapter_store_url", "s3:// URL without a bucket")


WARM_POLICIES = ("device-preferred", "host", "on-demand")  # how an adapter is pre-warmed


@dataclass
class LoRAModule:
    """An adapter served under ``name`` from ``path`` (vLLM's ``--lora-modules``)."""

    name: str
    path: str  # a local PEFT directory, or an object-store URI (s3://bucket/prefix/name)
    base_model_name: str | None = None
    warm: str = "on-demand"  # device-preferred | host | on-demand (start-up pre-warming)


@dataclass
class ServerConfig:
    """Settings of ``loraplex serve``: the engine's plus the HTTP layer's (vLLM flag names)."""

    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: list[str] = field(default_factory=list)  # empty: the model path
    lora_modules: list[LoRAModule] = field(default_factory=list)
    api_keys: list[str] = field(default_factory=list)  # inference keys; empty: no auth
    admin_api_key: str | None = None  # admin routes are off unless set
    allowed_lora_roots: list[str] = field(default_factory=list)
    max_waiting: int = 256  # queue depth above which new requests get 503 + Retry-After
    retry_after_seconds: int = 1
    log_level: str = "info"
    # adapter registry: None = $LORAPLEX_REGISTRY_URL, else an in-memory one seeded from
    # --lora-modules; "sqlite:///path.db" or "postgresql+psycopg://..." for a shared one
    registry_url: str | None = None
    registry_poll_s: float = 1.0  # how often the registry is checked for changes
    require_signatures: bool = False
    trusted_keys: list[str] = field(default_factory=list)  # ed25519 public key files
    allowed_store_prefixes: list[str] = field(default_factory=list)  # s3://bucket/prefix/
    swap_eviction_delay_s: float = 30.0  # a replaced revision's cached copies go after this

    @property
    def model_names(self) -> list[str]:
        """Names the base model answers to; the first is reported in responses."""
        return self.served_model_name or [self.engine.model]

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        self.engine.validate()
        if not 0 <= self.port <= 65535:
            raise ValueError(f"invalid port: {self.port!r} (0-65535)")
        if self.max_waiting < 0:
            raise ValueError(f"invalid max_waiting: {self.max_waiting!r} (>= 0)")
        if self.registry_poll_s <= 0:
            raise ValueError(f"invalid registry_poll_s: {self.registry_poll_s!r} (> 0)")
        if self.swap_eviction_delay_s < 0:
            raise ValueError(
                f"invalid swap_eviction_delay_s: {self.swap_eviction_delay_s!r} (>= 0)"
            )
        if self.retry_after_seconds < 0:
            raise ValueError(f"invalid retry_after_seconds: {self.retry_after_seconds!r} (>= 0)")
        seen: set[str] = set(self.model_names)
        for m in self.lora_modules:
            if not m.name or not m.path:
                raise ValueError(f"invalid lora module {m!r}: name and path are required")
            if m.name in seen:
                raise ValueError(f"lora module name {m.name!r} is used twice")
            seen.add(m.name)
        if self.lora_modules and not self.engine.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
