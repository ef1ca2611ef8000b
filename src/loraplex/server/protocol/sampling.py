"""Request bodies of the OpenAI-compatible API (pydantic), and their mapping to SamplingParams.

Field names, defaults and meanings follow vLLM's ``protocol.py`` (OpenAI's fields plus vLLM's
extensions). Every field of vLLM's completion and chat requests is either honoured or, where
we cannot honour a value (beam search, logits processors, ``allowed_token_ids``, ...), refused
with a 400 naming the field; no field is silently ignored. Fields neither OpenAI nor vLLM
define are accepted (clients send ``metadata``, ``store``, ...) and logged once per name
(:class:`UnknownFields`).

Structured outputs (``response_format``, ``guided_json`` / ``guided_regex`` / ``guided_choice``
/ ``guided_grammar``, ``structured_outputs``, and the JSON schemas that enforce ``tool_choice``
``required`` or a named tool) all become one :class:`~loraplex.requests.StructuredOutput`;
more than one source in one request is a 400.

Everything the engine would scan per token or keep per sequence is bounded per request, a 400
naming the field before anything is queued: ``n`` and ``best_of`` (:data:`MAX_N`), ``stop``
(:data:`MAX_STOP` strings of at most :data:`MAX_STOP_CHARS` characters), ``stop_token_ids``
(:data:`MAX_STOP_TOKEN_IDS`), ``logprobs`` / ``top_logprobs`` / ``prompt_logprobs``
(:data:`MAX_LOGPROBS`), ``guided_choice`` (:data:`MAX_CHOICES`). The number of prompts per call
is the server's ``--max-prompts-per-request``.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from loraplex.registry.records import MAX_CONCURRENT_REQUESTS
from loraplex.requests import SamplingParams, StructuredOutput
from loraplex.server.tools import named_tool_schema, required_tools_schema
from loraplex.types import InvalidRequestError
from loraplex.warm import WarmPolicy

log = logging.getLogger("loraplex.server.app")

MAX_N = 64  # completions per request; more is almost surely a mistake and costs KV cache
MAX_CACHE_SALT = 1024  # characters of cache_salt (vLLM suggests ~43: 256 random bits, base64)
MAX_STOP = 16  # stop strings per request (each is searched for after every token)
MAX_STOP_CHARS = 256  # characters of one stop string
MAX_STOP_TOKEN_IDS = 256  # stop token ids per request (checked after every token)
MAX_LOGPROBS = 20  # top alternatives per token (vLLM's default max_logprobs)
MAX_CHOICES = 1024  # guided_choice alternatives
MAX_TOOLS = 128  # tools offered in one request
# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): logits / 1e-300 overflow.
MIN_TEMPERATURE = 1e-5
# top_p below this keeps the same nucleus (the most likely token, whose mass is >= 1/vocab) but
# is not rounded to 0 when compared in float32.
MIN_TOP_P = 1e-6
# chat_template_kwargs may not override what the server itself passes to the renderer
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "return_dict", "return_tensors", "padding",
     "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"}
)  # fmt: skip


def _utf8(value: str) -> str:
    """JSON may carry lone surrogates (``"\\ud800"``); they cannot be tokenized or encoded."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError("text must be valid Unicode (it contains a lone surrogate)") from e
    return value


Text = Annotated[str, AfterValidator(_utf8)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)


def unknown_fields(body: BaseModel, prefix: str = "") -> Iterator[str]:
    """Dotted names of the fields in ``body`` (and its nested bodies) that no model defines."""
    for name in body.model_extra or {}:
        yield prefix + name
    for name in body.model_fields_set:
        value = getattr(body, name)
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, BaseModel):
                suffix = "[]." if isinstance(value, list) else "."
                yield from unknown_fields(item, f"{prefix}{name}{suffix}")


class UnknownFields:
    """Logs each unknown request field once per route (a warning), so a client relying on a
    field we do not define learns it from the log without the log growing per request."""

    def __init__(self, max_names: int = 1024) -> None:
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self.max_names = max_names  # distinct names remembered (bounded: names come from clients)

    def note(self, route: str, body: BaseModel) -> list[str]:
        """Log the unknown fields of ``body`` not logged before; returns those logged."""
        fresh = []
        with self._lock:
            for name in dict.fromkeys(unknown_fields(body)):
                key = (route, name[:100])
                if key in self._seen or len(self._seen) >= self.max_names:
                    continue
                self._seen.add(key)
                fresh.append(key[1])
        if fresh:
            log.warning(
                "%s: the request field(s) %s are not part of the API and were ignored "
                "(logged once per field name)",
                route,
                ", ".join(repr(n) for n in fresh),
            )
        return fresh


class StreamOptions(_Body):
    include_usage: bool = True  # vLLM's default once stream_options is sent
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Body):
    name: Text | None = None
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Body):
    """vLLM's ``structured_outputs`` (its ``StructuredOutputsParams``)."""

    json_: dict[str, Any] | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    structural_tag: Text | None = None
    disable_fallback: bool = False  # there is one grammar engine: nothing to fall back to
    # JSON constraints of the request (whatever field names them) are one compact line
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Text | None = None


def _json_schema(value: dict[str, Any] | str, param: str) -> dict[str, Any]:
    """A JSON schema given as an object or as JSON text (vLLM accepts both)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidRequestError(f"{param} is not valid JSON: {e}", param=param) from e
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{param} must be a JSON schema object", param=param)
    return value


def _choices(values: list[str], param: str) -> tuple[str, ...]:
    if not values:
        raise InvalidRequestError(f"{param} needs at least one choice", param=param)
    if len(values) > MAX_CHOICES:
        raise InvalidRequestError(
            f"{param} takes at most {MAX_CHOICES} choices (got {len(values)})", param=param
        )
    return tuple(values)


class _SamplingBody(_Body):
    """The fields completions and chat share (OpenAI's, then vLLM's sampling extensions)."""

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

        def refuse(name: str, why: str) -> None:
            raise InvalidRequestError(f"{name} is not supported: {why}", param=name)

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
        if self.guided_decoding_backend not in (None, "auto", "xgrammar"):
            refuse(
                "guided_decoding_backend",
                f"the server's grammar engine is xgrammar (got {self.guided_decoding_backend!r}; "
                "use 'auto', 'xgrammar' or omit it)",
            )
        if self.guided_whitespace_pattern is not None:
            refuse("guided_whitespace_pattern", "JSON whitespace follows the server's "
                   "--structured-outputs-whitespace (structured_outputs.disable_any_whitespace "
                   "asks for compact JSON)")  # fmt: skip
        so = self.structured_outputs
        if so is not None:
            if so.structural_tag is not None:
                refuse("structured_outputs", "structural_tag is not implemented")
            if so.disable_additional_properties:
                refuse("structured_outputs", "disable_additional_properties is not implemented")
            if so.whitespace_pattern is not None:
                refuse("structured_outputs", "whitespace_pattern is not implemented (JSON "
                       "whitespace is the server's --structured-outputs-whitespace, or compact "
                       "with disable_any_whitespace)")  # fmt: skip
        if self.response_format is not None and self.response_format.type == "structural_tag":
            refuse("response_format", "the 'structural_tag' type is not implemented")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError(
                "stream_options is only allowed when stream is true", param="stream_options"
            )

    def structured_field(self) -> str:
        """The request field its structured-output constraint came from (``tool_choice`` when
        a required or named tool choice made it), to name in a compile error."""
        for name, _ in self._structured_sources():
            return name
        return "tool_choice"

    def _structured_sources(self) -> Iterator[tuple[str, StructuredOutput]]:
        """Every structured-output constraint the body asks for, with the field naming it."""
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            yield "response_format", StructuredOutput(json_schema={"type": "object"})
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise InvalidRequestError(
                    "response_format of type 'json_schema' needs json_schema.schema",
                    param="response_format",
                )
            yield "response_format", StructuredOutput(json_schema=rf.json_schema.schema_)
        if self.guided_json is not None:
            schema = _json_schema(self.guided_json, "guided_json")
            yield "guided_json", StructuredOutput(json_schema=schema)
        if self.guided_regex is not None:
            yield "guided_regex", StructuredOutput(regex=self.guided_regex)
        if self.guided_choice is not None:
            yield (
                "guided_choice",
                StructuredOutput(choice=_choices(self.guided_choice, "guided_choice")),
            )
        if self.guided_grammar is not None:
            yield "guided_grammar", StructuredOutput(grammar=self.guided_grammar)
        so = self.structured_outputs
        if so is not None:
            p = "structured_outputs"
            found = [
                StructuredOutput(json_schema=_json_schema(so.json_, p)) if so.json_ is not None
                else None,
                StructuredOutput(regex=so.regex) if so.regex is not None else None,
                StructuredOutput(choice=_choices(so.choice, p)) if so.choice is not None
                else None,
                StructuredOutput(grammar=so.grammar) if so.grammar is not None else None,
                StructuredOutput(json_schema={"type": "object"}) if so.json_object else None,
            ]  # fmt: skip
            for s in found:
                if s is not None:
                    yield p, s

    def _structured(
        self, extra: tuple[str, StructuredOutput] | None = None
    ) -> StructuredOutput | None:
        """The one structured-output constraint of the request (None: unconstrained); a JSON
        one, from whichever field, is compact when ``structured_outputs.disable_any_whitespace``
        is set (as vLLM merges it with ``response_format``)."""
        sources = ([extra] if extra is not None else []) + list(self._structured_sources())
        if len(sources) > 1:
            names = ", ".join(dict.fromkeys(n for n, _ in sources))
            raise InvalidRequestError(
                f"only one structured-output constraint per request (got {len(sources)}: {names})",
                param=sources[1][0],
            )
        if not sources:
            return None
        found = sources[0][1]
        so = self.structured_outputs
        if so is not None and so.disable_any_whitespace and found.kind == "json_schema":
            found = StructuredOutput(json_schema=found.json_schema, disable_any_whitespace=True)
        return found

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


class CompletionRequest(_SamplingBody):
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
            structured=self._structured(),
            defaults=defaults or {},
        )


class ContentPart(_Body):
    type: str
    text: Text | None = None


class FunctionDefinition(_Body):
    name: Text = Field(min_length=1, max_length=256)
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Body):
    name: Text = Field(min_length=1)


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: Text | None = None
    reasoning_content: Text | None = None

    def text(self) -> str:
        """The message's text (its text parts joined); other content types are a 400."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise InvalidRequestError(
                        f"message content of type {part.type!r} is not supported (text only)",
                        param="messages",
                    )
                texts.append(part.text)
            return "".join(texts)
        return content or ""

    def as_template_message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = [_template_tool_call(c) for c in self.tool_calls]
        return msg


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call of an assistant message as chat templates expect it: ``arguments`` as an
    object (transformers' convention), not the JSON text OpenAI clients send."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequestError(
            "each tool call of an assistant message needs function.name", param="messages"
        )
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as e:
            raise InvalidRequestError(
                f"tool call {fn['name']!r}: arguments are not valid JSON", param="messages"
            ) from e
    return {**call, "type": call.get("type", "function"), "function": {**fn, "arguments": args}}


class ChatCompletionRequest(_SamplingBody):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Text | None = None
    include_reasoning: bool = True  # no reasoning parser: there is never reasoning to include
    # vLLM's chat extras
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, Any]] | None = None
    chat_template: Text | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    structural_tag: Text | None = None

    @property
    def special_tokens(self) -> bool:
        """Whether special tokens are added on top of the chat template's (vLLM: no)."""
        return bool(self.add_special_tokens)

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """``tool_choice`` as vLLM reads it: ``auto`` when tools come without one, ``none``
        without tools or when ``required`` comes with an empty list (OpenAI's behaviour)."""
        if not self.tools:
            return "none"
        return self.tool_choice if self.tool_choice is not None else "auto"

    @property
    def generation_prompt(self) -> bool:
        """Whether an assistant turn is opened: ``add_generation_prompt``, unless the final
        message is continued (then the default ``true`` does not apply)."""
        if self.continue_final_message and "add_generation_prompt" not in self.model_fields_set:
            return False
        return self.add_generation_prompt

    @property
    def response_role(self) -> str:
        """The role of the message generated (vLLM's: the last message's when no generation
        prompt is added)."""
        return "assistant" if self.generation_prompt else self.messages[-1].role

    def _check_chat(self) -> None:
        if self.reasoning_effort is not None:
            raise InvalidRequestError(
                "reasoning_effort is not supported: this server runs no reasoning parser",
                param="reasoning_effort",
            )
        if self.mm_processor_kwargs:
            raise InvalidRequestError(
                "mm_processor_kwargs is not supported: the models served here are text-only",
                param="mm_processor_kwargs",
            )
        if self.structural_tag is not None:
            raise InvalidRequestError("structural_tag is not supported", param="structural_tag")
        if self.continue_final_message and self.add_generation_prompt:
            if "add_generation_prompt" in self.model_fields_set:
                raise InvalidRequestError(
                    "continue_final_message and add_generation_prompt cannot both be true",
                    param="continue_final_message",
                )
        if self.tool_choice is not None and self.tool_choice != "none" and self.tools is None:
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        if self.tools is not None and len(self.tools) > MAX_TOOLS:
            raise InvalidRequestError(
                f"tools takes at most {MAX_TOOLS} tools (got {len(self.tools)})", param="tools"
            )
        choice = self.effective_tool_choice
        if isinstance(choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or []}
            if choice.function.name not in names:
                raise InvalidRequestError(
                    f"tool_choice names {choice.function.name!r}, which is not in tools",
                    param="tool_choice",
                )
        for key in self.chat_template_kwargs or {}:
            if key in RESERVED_TEMPLATE_KWARGS:
                raise InvalidRequestError(
                    f"chat_template_kwargs may not set {key!r} (use the request field)",
                    param="chat_template_kwargs",
                )

    def _tool_constraint(self) -> tuple[str, StructuredOutput] | None:
        """``required`` and a named tool choice are enforced by a JSON schema (as vLLM)."""
        choice = self.effective_tool_choice
        tools = [t.function.model_dump(by_alias=True, exclude_none=True)
                 for t in self.tools or []]  # fmt: skip
        if choice == "required":
            return "tool_choice", StructuredOutput(json_schema=required_tools_schema(tools))
        if isinstance(choice, NamedToolChoice):
            schema = named_tool_schema(tools, choice.function.name)
            return "tool_choice", StructuredOutput(json_schema=schema)
        return None

    def sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs must be in [0, {MAX_LOGPROBS}] (got {self.top_logprobs})",
                param="top_logprobs",
            )
        self._check_bounds()
        self._check_chat()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        given = self._given("max_completion_tokens") or self._given("max_tokens")
        max_tokens = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(
            max_tokens=max_tokens,
            max_tokens_given=given,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            structured=self._structured(self._tool_constraint()),
            defaults=defaults or {},
        )

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_message() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        return template_tools(self.tools)


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """Tools as chat templates take them (OpenAI's shape); None without any."""
    if not tools:
        return None
    return [t.model_dump(by_alias=True, exclude_none=True) for t in tools]


class TokenizeRequest(_Body):
    """vLLM's ``POST /tokenize`` body: a ``prompt`` (completion form) or ``messages`` (chat
    form, rendered with the chat template)."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: yes for a prompt, no for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template: Text | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None

    @property
    def generation_prompt(self) -> bool:
        if self.continue_final_message and "add_generation_prompt" not in self.model_fields_set:
            return False
        return self.add_generation_prompt

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
        if self.continue_final_message and self.add_generation_prompt:
            if "add_generation_prompt" in self.model_fields_set:
                raise InvalidRequestError(
                    "continue_final_message and add_generation_prompt cannot both be true",
                    param="continue_final_message",
                )
        for key in self.chat_template_kwargs or {}:
            if key in RESERVED_TEMPLATE_KWARGS:
                raise InvalidRequestError(
                    f"chat_template_kwargs may not set {key!r} (use the request field)",
                    param="chat_template_kwargs",
                )


class DetokenizeRequest(_Body):
    """vLLM's ``POST /detokenize`` body."""

    model: Text | None = None
    tokens: list[int]


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
    warm_policy: WarmPolicy = "on-demand"
    # a warm policy string or a window schedule ({"device": "Mon-Fri 08:00-18:00", "tz": ...})
    warm: Text | dict[str, Any] | None = None
    signature: Text | None = None
    stage: bool = False
    activate: bool = False
    max_concurrent_requests: int | None = Field(default=None, ge=1, le=MAX_CONCURRENT_REQUESTS)


class PromoteAdapterRequest(_AdminBody):
    """``POST /v1/admin/adapters/{name}/promote``: make ``revision`` (default: the canary) active."""

    revision: Text | None = None


class CanaryPolicyBody(_AdminBody):
    """A canary's health bounds and concurrency cap (see :class:`loraplex.registry.CanaryPolicy`;
    the registry checks the values)."""

    window_s: float = 300.0
    min_requests: int = 20
    max_error_rate: float | None = 0.05
    max_ttft_p95_s: float | None = None
    max_tpot_p95_s: float | None = None
    min_quality: float | None = None
    scorer: Text | None = None
    max_concurrent_requests: int | None = None


class CanaryAdapterRequest(_AdminBody):
    """``POST /v1/admin/adapters/{name}/canary``: send ``weight`` of the traffic to ``revision``."""

    revision: Text = Field(min_length=1)
    weight: float = Field(gt=0, le=1)
    policy: CanaryPolicyBody | None = None  # health bounds: rolled back automatically on a breach


class RollbackAdapterRequest(_AdminBody):
    """``POST /v1/admin/adapters/{name}/rollback``: why (recorded in the audit log)."""

    reason: Text = Field(default="manual", min_length=1, max_length=500)


class AdapterFeedbackRequest(_AdminBody):
    """``POST /v1/adapters/{name}/feedback``: a user's score in [0, 1] of a response served by
    ``revision`` (the ``x-loraplex-adapter`` header names it): the canary's quality signal."""

    revision: str = Field(min_length=1, max_length=100)
    score: float = Field(ge=0, le=1)


class DisableAdapterRequest(_AdminBody):
    """``POST /v1/admin/adapters/{name}/disable``: take ``revision`` (default: the active one) out
    of service."""

    revision: Text | None = None
