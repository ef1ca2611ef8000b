"""Result types returned by the engine and the offline ``LLM`` API."""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.types import AdapterRef


@dataclass
class TokenLogprob:
    """Log-probability of the sampled token and the top alternatives at one position."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    adapter: AdapterRef | None = None
    num_cached_tokens: int = 0
    error: str | None = None
