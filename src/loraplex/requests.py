"""Request-side value types mirroring vLLM's offline API: SamplingParams and LoRARequest."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from loraplex.types import InvalidRequestError


@dataclass
class SamplingParams:
    """How to sample one completion. ``temperature == 0`` (below 1e-5) means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (0: chosen only)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first bad field."""

        def bad(name: str, why: str) -> None:
            raise InvalidRequestError(
                f"invalid sampling parameter {name}={getattr(self, name)!r}: {why}"
            )

        for name in ("temperature", "top_p"):
            if isinstance(getattr(self, name), bool) or not isinstance(
                getattr(self, name), (int, float)
            ):
                bad(name, "must be a number")
        for name in ("top_k", "min_tokens"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                bad(name, "must be an integer")
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            bad("temperature", "must be a finite number >= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or (self.top_k < -1):
            bad("top_k", "must be -1 (disabled) or >= 0")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            bad("max_tokens", "must be an integer >= 1")
        if self.min_tokens < 0 or (
            self.max_tokens is not None and self.min_tokens > self.max_tokens
        ):
            bad("min_tokens", "must be in [0, max_tokens]")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20
        ):
            bad("logprobs", "must be an integer in [0, 20]")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "must be an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):  # type: ignore[union-attr]
            bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):  # type: ignore[union-attr]
            bad("stop_token_ids", "must be non-negative integers")

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 sample the argmax (as vLLM); dividing by them overflows."""
        return self.temperature < 1e-5


@dataclass(init=False)
class LoRARequest:
    """Which adapter serves an offline request: a name and a PEFT adapter directory (vLLM's shape).

    The engine turns it into an :class:`~loraplex.types.AdapterSpec` once (its local catalog
    hashes the directory's files: the digest, never the name or the path, is the cache key).
    Accepts vLLM's form too: ``LoRARequest("sql", 1, "/path")`` (the integer id is ignored —
    loraplex identifies adapters by the sha256 of their contents, never by an id).
    """

    name: str
    path: str
    revision: str | None = None

    def __init__(
        self,
        name: str,
        path_or_id: str | Path | int | None = None,
        path: str | Path | None = None,
        *,
        revision: str | None = None,
        lora_path: str | Path | None = None,
    ) -> None:
        if isinstance(path_or_id, int) and not isinstance(path_or_id, bool):
            path_or_id = None
        p = path_or_id if path_or_id is not None else (path if path is not None else lora_path)
        if not name or not isinstance(name, str):
            raise InvalidRequestError("LoRARequest needs a non-empty name")
        if p is None:
            raise InvalidRequestError(
                f"LoRARequest {name!r} needs a path to a PEFT adapter directory"
            )
        self.name = name
        self.path = str(p)
        self.revision = revision

    @property
    def lora_name(self) -> str:
        return self.name

    @property
    def lora_path(self) -> str:
        return self.path
