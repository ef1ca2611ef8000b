"""Request bodies of the OpenAI-compatible API (pydantic), and their mapping to SamplingParams.

Field names and defaults follow OpenAI's API; vLLM's extensions (``top_k``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ...) are accepted too. Unknown fields are ignored, as OpenAI
clients send fields we have no use for (``user``, ``metadata``). Parameters we cannot honour
(penalties, ``logit_bias``, tools, non-text content) are refused with a 400 naming them rather
than silently ignored.

Everything the engine would scan per token or keep per sequence is bounded per request, a 400
naming the field before anything is queued: ``n`` and ``best_of`` (:data:`MAX_N`), ``stop``
(:data:`MAX_STOP` strings of at most :data:`MAX_STOP_CHARS` characters), ``stop_token_ids``
(:data:`MAX_STOP_TOKEN_IDS`), ``logprobs`` / ``top_logprobs`` (:data:`MAX_LOGPROBS`). The
number of prompts per call is the server's ``--max-prompts-per-request``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from loraplex.requests import SamplingParams
from loraplex.types import InvalidRequestError

MAX_N = 64  # completions per request; more is almost surely a mistake and costs KV cache
MAX_CACHE_SALT = 1024  # characters of cache_salt (vLLM suggests ~43: 256 random bits, base64)
MAX_STOP = 16  # stop strings per request (each is searched for after every token)
MAX_STOP_CHARS = 256  # characters of one stop string
MAX_STOP_TOKEN_IDS = 256  # stop token ids per request (checked after every token)
MAX_LOGPROBS = 20  # top alternatives per token (vLLM's default max_logprobs)
# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): logits / 1e-300 overflow.
MIN_TEMPERATURE = 1e-5
# top_p below this keeps the same nucleus (the most likely token, whose mass is >= 1/vocab) but
# is not rounded to 0 when compared in float32.
MIN_TOP_P = 1e-6


def _utf8(value: str) -> str:
    """JSON may carry lone surrogates (``"\\ud800"``); they cannot be tokenized or encoded."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError("text must be valid Unicode (it contains a lone surrogate)") from e
    return value


Text = Annotated[str, AfterValidator(_utf8)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # no "2" -> 2, no true -> 1


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingBody(_Body):
    model: Text
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extensions
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's prefix-cache salt: KV is shared only between requests with the same salt
    cache_salt: Text | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT)

    def _check_bounds(self) -> None:
        """The per-request caps of the fields the engine scans every token."""
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n must be in [1, {MAX_N}] (got {self.n})", param="n")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP:
            raise InvalidRequestError(
                f"stop takes at most {MAX_STOP} strings (got {len(stops)})", param="stop"
            )
        long = next((x for x in stops if len(x) > MAX_STOP_CHARS), None)
        if long is not None:
            raise InvalidRequestError(
                f"each stop string has at most {MAX_STOP_CHARS} characters (got {len(long)})",
                param="stop",
            )
        ids = self.stop_token_ids or []
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(
                f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids (got {len(ids)})",
                param="stop_token_ids",
            )

    def _check_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if v not in (None, 0, 0.0):
                raise InvalidRequestError(f"{name} is not supported (got {v}); omit it or use 0")
        if self.repetition_penalty not in (None, 1, 1.0):
            raise InvalidRequestError(
                f"repetition_penalty is not supported (got {self.repetition_penalty}); use 1"
            )
        if self.logit_bias:
            raise InvalidRequestError("logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true")

    def _params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        self._check_unsupported()
        temperature = 1.0 if self.temperature is None else self.temperature
        if 0 < temperature < MIN_TEMPERATURE:
            temperature = 0.0
        top_p = 1.0 if self.top_p is None else self.top_p
        if 0 < top_p < MIN_TOP_P:
            top_p = MIN_TOP_P
        return SamplingParams(
            n=self.n,
            temperature=temperature,
            top_p=top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


class CompletionRequest(_SamplingBody):
    """``POST /v1/completions``."""

    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("prompt is empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        out: list[str | list[int]] = []
        for x in p:
            if isinstance(x, list) and not x:
                raise InvalidRequestError("prompt contains an empty token list")
            out.append(x)  # type: ignore[arg-type]
        return out

    def sampling_params(self) -> SamplingParams:
        if self.best_of is not None and not 1 <= self.best_of <= MAX_N:
            raise InvalidRequestError(
                f"best_of must be in [1, {MAX_N}] (got {self.best_of})", param="best_of"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"logprobs must be in [0, {MAX_LOGPROBS}] (got {self.logprobs})", param="logprobs"
            )
        self._check_bounds()
        if self.suffix:
            raise InvalidRequestError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of is not supported (it must equal n or be omitted)")
        if self.echo and self.logprobs is not None:
            raise InvalidRequestError("echo together with logprobs is not supported")
        return self._params(self.max_tokens, self.logprobs)


class ContentPart(_Body):
    type: str
    text: Text | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None

    def as_template_message(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise InvalidRequestError(
                        f"message content of type {part.type!r} is not supported (text only)"
                    )
                texts.append(part.text)
            content = "".join(texts)
        msg: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            msg["name"] = self.name
        return msg


class ChatCompletionRequest(_SamplingBody):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs must be in [0, {MAX_LOGPROBS}] (got {self.top_logprobs})",
                param="top_logprobs",
            )
        self._check_bounds()
        if self.tools:
            raise InvalidRequestError("tools are not supported")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise InvalidRequestError(
                f"response_format {self.response_format.get('type')!r} is not supported "
                "(only 'text')"
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true")
        max_tokens = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(max_tokens, logprobs)

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_message() for m in self.messages]


class LoadLoRAAdapterRequest(_Body):
    """vLLM's ``POST /v1/load_lora_adapter`` body."""

    lora_name: Text = Field(min_length=1)
    lora_path: Text = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(_Body):
    """vLLM's ``POST /v1/unload_lora_adapter`` body."""

    lora_name: Text = Field(min_length=1)
    lora_int_id: int | None = None


class PinLoRAAdapterRequest(_Body):
    """``POST /v1/pin_lora_adapter``: never evict the adapter (``device``: keep its slot too)."""

    lora_name: str = Field(min_length=1)
    device: bool = False


class EvictLoRAAdapterRequest(_Body):
    """``POST /v1/evict_lora_adapter``: drop the adapter's copies from ``tiers`` (default all)."""

    lora_name: str = Field(min_length=1)
    tiers: list[Literal["device", "host", "disk"]] | None = None


class _AdminBody(BaseModel):
    """Admin bodies refuse unknown fields: a typo must not silently change what is registered."""

    model_config = ConfigDict(extra="forbid", strict=True)


class RegisterAdapterRequest(_AdminBody):
    """``POST /v1/admin/adapters``: register (validate) a revision; optionally stage or activate."""

    name: Text = Field(min_length=1, max_length=200)
    path: Text = Field(min_length=1)
    revision: Text | None = Field(default=None, min_length=1, max_length=100)
    tenant: Text | None = None
    source_uri: Text | None = None
    priority: int = 0
    slo_class: Text | None = None
    warm_policy: Literal["device-preferred", "host", "on-demand"] = "on-demand"
    signature: Text | None = None
    stage: bool = False
    activate: bool = False


class PromoteAdapterRequest(_AdminBody):
    """``POST /v1/admin/adapters/{name}/promote``: make ``revision`` (default: the canary) active."""

    revision: Text | None = None


class CanaryAdapterRequest(_AdminBody):
    """``POST /v1/admin/adapters/{name}/canary``: send ``weight`` of the traffic to ``revision``."""

    revision: Text = Field(min_length=1)
    weight: float = Field(gt=0, le=1)


class DisableAdapterRequest(_AdminBody):
    """``POST /v1/admin/adapters/{name}/disable``: take ``revision`` (default: the active one) out
    of service."""

    revision: Text | None = None
