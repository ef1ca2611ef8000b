"""The fields completions and chat share (OpenAI's, then vLLM's sampling extensions), their
per-request bounds, and their mapping to :class:`~loraplex.requests.SamplingParams`.

Everything the engine would scan per token or keep per sequence is bounded per request, a 400
naming the field before anything is queued: ``n`` and ``best_of`` (:data:`MAX_N`), ``stop``
(:data:`MAX_STOP` strings of at most :data:`MAX_STOP_CHARS` characters), ``stop_token_ids``
(:data:`MAX_STOP_TOKEN_IDS`), ``logprobs`` / ``top_logprobs`` / ``prompt_logprobs``
(:data:`MAX_LOGPROBS`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field

from loraplex.requests import SamplingParams, StructuredOutput
from loraplex.server.protocol.base import Body, Text, refuse
from loraplex.server.protocol.composition import AdapterFields
from loraplex.server.protocol.structured import (
    ResponseFormat,
    StructuredOutputsBody,
    check_structured_fields,
    structured_sources,
)
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


class StreamOptions(Body):
    include_usage: bool = True  # vLLM's default once stream_options is sent
    continuous_usage_stats: bool = False


class SamplingBody(AdapterFields):
    """The fields completions and chat share (OpenAI's, then vLLM's sampling extensions, and
    the adapters a call composes: :class:`AdapterFields`)."""

    model: Text
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: Text | None = None  # OpenAI's end-user id: accepted, used for nothing
    best_of: int | None = None
    # vLLM's sampling parameters
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    allowed_token_ids: list[int] | None = None
    bad_words: list[Text] | None = None
    prompt_logprobs: int | None = None
    # vLLM's extra parameters
    add_special_tokens: bool | None = None  # None: the route's default (completions yes, chat no)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    guided_decoding_backend: Text | None = None
    guided_whitespace_pattern: Text | None = None
    structured_outputs: StructuredOutputsBody | None = None
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)  # lower is scheduled earlier
    request_id: Text | None = Field(default=None, min_length=1, max_length=256)
    logits_processors: list[Any] | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    # vLLM's prefix-cache salt: KV is shared only between requests with the same salt
    cache_salt: Text | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT)

    def _check_bounds(self) -> None:
        """The per-request caps of the fields the engine scans every token."""
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n must be in [1, {MAX_N}] (got {self.n})", param="n")
        if self.best_of is not None and not 1 <= self.best_of <= MAX_N:
            raise InvalidRequestError(
                f"best_of must be in [1, {MAX_N}] (got {self.best_of})", param="best_of"
            )
        if self.best_of is not None and self.best_of < self.n:
            raise InvalidRequestError(
                f"best_of ({self.best_of}) must be >= n ({self.n})", param="best_of"
            )
        if self.stream and self.best_of is not None and self.best_of > self.n:
            # the n best are known only once all best_of sequences finished (as vLLM refuses)
            raise InvalidRequestError(
                "best_of > n cannot be streamed: the best sequences are known only at the end",
                param="best_of",
            )
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
        if self.prompt_logprobs is not None:
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise InvalidRequestError(
                    f"prompt_logprobs must be in [0, {MAX_LOGPROBS}] (got {self.prompt_logprobs})",
                    param="prompt_logprobs",
                )
            if self.stream and self.prompt_logprobs > 0:
                raise InvalidRequestError(
                    "prompt_logprobs are not available when stream is true (as in vLLM)",
                    param="prompt_logprobs",
                )

    def _check_unsupported(self) -> None:
        """Refuse, naming the field, every value we cannot honour."""
        if self.use_beam_search:
            refuse("use_beam_search", "beam search is not implemented; omit it or use false")
        if self.length_penalty != 1.0:
            refuse("length_penalty", "it applies to beam search only; omit it or use 1")
        if not self.spaces_between_special_tokens:
            refuse("spaces_between_special_tokens", "only true (the default) is implemented")
        if self.allowed_token_ids:
            refuse("allowed_token_ids", "omit it (logit_bias can favour tokens)")
        if self.bad_words:
            refuse("bad_words", "omit it (logit_bias can suppress single tokens)")
        if self.logits_processors:
            refuse("logits_processors", "this server loads no custom logits processors")
        if self.kv_transfer_params:
            refuse("kv_transfer_params", "there is no disaggregated serving here")
        if self.vllm_xargs:
            refuse("vllm_xargs", "this server has no custom extensions")
        check_structured_fields(self)
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError(
                "stream_options is only allowed when stream is true", param="stream_options"
            )

    def structured_field(self) -> str:
        """The request field its structured-output constraint came from (``tool_choice`` when
        a required or named tool choice made it), to name in a compile error."""
        for name, _ in structured_sources(self):
            return name
        return "tool_choice"

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI sends token ids as JSON object keys (strings)."""
        if not self.logit_bias:
            return None
        out = {}
        for k, v in self.logit_bias.items():
            try:
                tid = int(k)
            except ValueError as e:
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids (got {k!r})", param="logit_bias"
                ) from e
            out[tid] = v
        return out

    def _given(self, name: str) -> bool:
        return name in self.model_fields_set and getattr(self, name) is not None

    def _params(
        self,
        *,
        max_tokens: int | None,
        max_tokens_given: bool,
        logprobs: int | None,
        prompt_logprobs: int | None,
        structured: StructuredOutput | None,
        defaults: Mapping[str, Any],
    ) -> SamplingParams:
        """SamplingParams of the body; ``defaults`` (the model's generation_config, as
        SamplingParams field names) fill the fields the request omits."""
        self._check_unsupported()

        def pick(name: str, fallback: Any) -> Any:
            if self._given(name):
                return getattr(self, name)
            return defaults.get(name, fallback)

        temperature = pick("temperature", 1.0)
        if 0 < temperature < MIN_TEMPERATURE:
            temperature = 0.0
        top_p = pick("top_p", 1.0)
        if 0 < top_p < MIN_TOP_P:
            top_p = MIN_TOP_P
        top_k = pick("top_k", -1)
        if not max_tokens_given and "max_tokens" in defaults:
            max_tokens = defaults["max_tokens"]
        stop_token_ids = self.stop_token_ids if self.stop_token_ids else defaults.get(
            "stop_token_ids"
        )  # fmt: skip
        return SamplingParams(
            n=self.n,
            best_of=self.best_of,
            temperature=temperature,
            top_p=top_p,
            top_k=-1 if top_k == 0 else top_k,
            min_p=pick("min_p", 0.0),
            presence_penalty=pick("presence_penalty", 0.0),
            frequency_penalty=pick("frequency_penalty", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            logit_bias=self._logit_bias(),
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured=structured,
            priority=self.priority,  # the engine refuses it unless its policy honours it
        )
