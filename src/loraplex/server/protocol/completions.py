"""``POST /v1/completions``: the prompt (text, token ids, or a batch of either), ``echo``, and
the completion form of ``logprobs``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loraplex.requests import SamplingParams
from loraplex.server.protocol.base import Text
from loraplex.server.protocol.sampling import MAX_LOGPROBS, SamplingBody
from loraplex.server.protocol.structured import one_constraint
from loraplex.types import InvalidRequestError


class CompletionRequest(SamplingBody):
    """``POST /v1/completions``."""

    prompt: Text | list[Text] | list[int] | list[list[int]] | None = None
    prompt_embeds: Any = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: Text | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        if self.prompt_embeds is not None:
            raise InvalidRequestError(
                "prompt_embeds is not supported: send text or token ids", param="prompt_embeds"
            )
        p = self.prompt
        if p is None:
            raise InvalidRequestError("prompt is required", param="prompt")
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        out: list[str | list[int]] = []
        for x in p:
            if isinstance(x, list) and not x:
                raise InvalidRequestError("prompt contains an empty token list", param="prompt")
            out.append(x)  # type: ignore[arg-type]
        return out

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens=0``: only the prompt (and its logprobs) comes back, as in
        vLLM (lm-eval's loglikelihood requests)."""
        return self.echo and self.max_tokens == 0

    @property
    def special_tokens(self) -> bool:
        """Whether prompt text is tokenized with the tokenizer's special tokens (BOS)."""
        return True if self.add_special_tokens is None else self.add_special_tokens

    def sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"logprobs must be in [0, {MAX_LOGPROBS}] (got {self.logprobs})", param="logprobs"
            )
        self._check_bounds()
        if self.suffix:
            raise InvalidRequestError(
                "suffix is not supported: this server has no fill-in-the-middle mode",
                param="suffix",
            )
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo and self.logprobs is not None:
            prompt_logprobs = self.logprobs  # echo + logprobs: the prompt tokens' logprobs too
        return self._params(
            # echo without generation still runs one step (vLLM): its token is not returned
            max_tokens=1 if self.echo_only else self.max_tokens,
            max_tokens_given="max_tokens" in self.model_fields_set,
            logprobs=self.logprobs,
            prompt_logprobs=prompt_logprobs,
            structured=one_constraint(self),
            defaults=defaults or {},
        )
