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
    # text offset after each generated token: text[ends[i-1]:ends[i]] is token i's text (empty
    # while a character is incomplete or text is held back), so a server can send one chunk per
    # token; len(token_text_ends) == len(token_ids), every end <= len(text)
    token_text_ends: list[int] = field(default_factory=list)


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
    # per prompt token: {token id: logprob} with the prompt token and the top-k alternatives
    # given its prefix; None for the first token (no prefix), as vLLM
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def lora_revision(self) -> str | None:
        """The adapter revision this request was served with, from admission to its last
        token (a later push under the same name does not change it); None: the base model."""
        return None if self.adapter is None else self.adapter.revision
