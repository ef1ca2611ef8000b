"""Request-side value types: SamplingParams, StructuredOutput and LoRARequest (vLLM's offline API),
and GenerationRequest, the one request object every layer between a caller and the engine's
intake passes on unchanged."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraplex.types import (
    AdapterComposition,
    AdapterSpec,
    InvalidRequestError,
    check_adapter_scale,
)

_MAX_LOGPROBS = 20


def _is_number(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float))


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of these constrains the generated text (vLLM's ``structured_outputs``).

    ``json_schema``: a JSON Schema (OpenAI's ``json_object`` is ``{"type": "object"}``);
    ``regex``: a regular expression the whole output matches; ``choice``: the output is one of
    these strings; ``grammar``: an EBNF (GBNF) grammar whose ``root`` rule the output matches.
    ``disable_any_whitespace`` (vLLM's), for a JSON schema only: True, one line with ``", "``
    and ``": "`` separators; False, whitespace allowed (pretty printing: the engine's
    ``structured_outputs_whitespace`` if it allows whitespace, else at most 16 characters per
    gap); None, the engine's ``structured_outputs_whitespace`` (compact unless changed).
    """

    json_schema: dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in ("json_schema", "regex", "choice", "grammar") if getattr(self, k)]
        if len(given) != 1:
            raise InvalidRequestError(
                "structured output needs exactly one of json_schema, regex, choice, grammar "
                f"(got {', '.join(given) or 'none'})",
                param=given[1] if len(given) > 1 else "structured_outputs",
            )
        kind = given[0]
        if kind == "json_schema" and not isinstance(self.json_schema, dict):
            raise InvalidRequestError("json_schema must be a JSON object", param=kind)
        if kind in ("regex", "grammar") and not isinstance(getattr(self, kind), str):
            raise InvalidRequestError(f"{kind} must be a string", param=kind)
        if kind == "choice" and (
            not isinstance(self.choice, tuple)
            or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise InvalidRequestError("choice must be a list of non-empty strings", param=kind)
        if self.disable_any_whitespace is not None and not isinstance(
            self.disable_any_whitespace, bool
        ):
            raise InvalidRequestError(
                "disable_any_whitespace must be true or false", param="disable_any_whitespace"
            )

    @property
    def kind(self) -> str:
        """Which constraint this is: json_schema, regex, choice or grammar."""
        return next(k for k in ("json_schema", "regex", "choice", "grammar") if getattr(self, k))


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
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # divides (>0) / multiplies (<0) prompt and output tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability
    best_of: int | None = None  # sample best_of, return the n with the highest cumulative logprob
    prompt_logprobs: int | None = None  # top logprobs per prompt token (0: the token's only)
    structured: StructuredOutput | None = None  # constrains the output (JSON, regex, ...)
    # vLLM's request priority (lower is scheduled earlier; not 0 needs --scheduling-policy
    # priority or fair). vLLM passes it beside the params; here it travels with them
    priority: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first bad field."""

        def bad(name: str, why: str) -> None:
            shown = repr(getattr(self, name))
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise InvalidRequestError(
                f"invalid sampling parameter {name}={shown}: {why}", param=name
            )

        for name in ("temperature", "top_p"):
            if isinstance(getattr(self, name), bool) or not isinstance(
                getattr(self, name), (int, float)
            ):
                bad(name, "must be a number")
        for name in ("top_k", "min_tokens", "priority"):
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
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= _MAX_LOGPROBS
        ):
            bad("logprobs", f"must be an integer in [0, {_MAX_LOGPROBS}]")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "must be an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):  # type: ignore[union-attr]
            bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):  # type: ignore[union-attr]
            bad("stop_token_ids", "must be non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2.0 <= v <= 2.0:
                bad(name, "must be a number in [-2, 2]")
        rp = self.repetition_penalty
        if not _is_number(rp) or not (rp > 0 and math.isfinite(rp)):
            bad("repetition_penalty", "must be a finite number > 0")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be a number in [0, 1]")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", "must map token ids to numbers")
            for t, v in self.logit_bias.items():  # type: ignore[union-attr]
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    bad("logit_bias", f"key {t!r} is not a token id (an integer >= 0)")
                if not _is_number(v) or not -100.0 <= v <= 100.0:
                    bad("logit_bias", f"bias {v!r} of token {t} is not a number in [-100, 100]")
        if self.best_of is not None and (
            isinstance(self.best_of, bool)
            or not isinstance(self.best_of, int)
            or self.best_of < self.n
        ):
            bad("best_of", f"must be an integer >= n ({self.n})")
        if self.prompt_logprobs is not None and (
            isinstance(self.prompt_logprobs, bool)
            or not isinstance(self.prompt_logprobs, int)
            or not 0 <= self.prompt_logprobs <= _MAX_LOGPROBS
        ):
            bad("prompt_logprobs", f"must be an integer in [0, {_MAX_LOGPROBS}]")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            bad("structured", "must be a StructuredOutput")

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 sample the argmax (as vLLM); dividing by them overflows."""
        return self.temperature < 1e-5

    @property
    def num_seqs(self) -> int:
        """Sequences the engine runs for this request: ``best_of`` (when set), else ``n``."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


@dataclass(init=False)
class LoRARequest:
    """Which adapter serves an offline request: a name and a PEFT adapter directory (vLLM's shape),
    or a name and the adapter itself as tensors (verl's ``TensorLoRARequest``:
    ``lora_tensors``, a state dict with PEFT's key names, and ``peft_config``, the
    ``adapter_config.json`` dict), or a name alone: the revision last added under it with
    ``LLMEngine.add_lora``.

    The engine turns it into an :class:`~loraplex.types.AdapterSpec` once (its local catalog
    hashes the directory's files: the digest, never the name or the path, is the cache key).
    Accepts vLLM's form too: ``LoRARequest("sql", 1, "/path")`` (the integer id is ignored —
    loraplex identifies adapters by the sha256 of their contents, never by an id).

    ``lora_scale`` (vLLM PR #52757's name): the strength the adapter's delta is added with, on
    top of its own alpha / r; 1.0 is the adapter as trained, 0 the base model, a negative scale
    subtracts it. Finite and ``|lora_scale| <= MAX_ADAPTER_SCALE`` (100). Not part of the
    request's identity (``==``): a scale takes no adapter slot of its own. Several
    ``LoRARequest`` s for one prompt (``LLM.generate``'s per-prompt list) compose, each at its
    ``lora_scale``.
    """

    name: str
    path: str
    revision: str | None = None
    lora_scale: float = field(default=1.0, compare=False)
    # left out of == and repr (a state dict can be gigabytes; its digest is its identity)
    lora_tensors: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)
    peft_config: Mapping[str, Any] | None = field(default=None, compare=False)

    def __init__(
        self,
        name: str,
        path_or_id: str | Path | int | None = None,
        path: str | Path | None = None,
        *,
        revision: str | None = None,
        lora_path: str | Path | None = None,
        lora_scale: float = 1.0,
        lora_tensors: Mapping[str, Any] | None = None,
        peft_config: Mapping[str, Any] | None = None,
    ) -> None:
        if isinstance(path_or_id, int) and not isinstance(path_or_id, bool):
            path_or_id = None
        p = path_or_id if path_or_id is not None else (path if path is not None else lora_path)
        if not name or not isinstance(name, str):
            raise InvalidRequestError("LoRARequest needs a non-empty name")
        if (lora_tensors is None) != (peft_config is None):
            raise InvalidRequestError(
                f"LoRARequest {name!r}: lora_tensors and peft_config go together"
            )
        if lora_tensors is not None and p is not None:
            raise InvalidRequestError(f"LoRARequest {name!r}: give a path or tensors, not both")
        self.name = name
        self.path = "" if p is None else str(p)
        self.revision = revision
        self.lora_scale = check_adapter_scale(lora_scale, param="lora_scale")
        self.lora_tensors = lora_tensors
        self.peft_config = peft_config

    @property
    def lora_name(self) -> str:
        return self.name

    @property
    def lora_path(self) -> str:
        return self.path


@dataclass(frozen=True)
class GenerationRequest:
    """One request to prepare, as it travels unchanged from its caller (an HTTP route, the
    offline API) through the engine client and the engine loop to the engine's intake, which
    validates what needs the tokenizer or the engine and turns it into sequences.

    ``prompt``: text, or token ids. ``adapter``: the adapter as a spec (from a catalog, e.g. the
    server's registry view), an offline ``LoRARequest(name, path)`` that the engine's local
    catalog turns into one, several adapters with a scale each (an
    :class:`~loraplex.types.AdapterComposition`; a single adapter at a per-request scale is one
    of one component), or None for the base model. ``arrival``: ``time.monotonic()`` when
    the request arrived (None: when it is prepared). ``cache_salt`` (vLLM's field) salts its
    prefix-cache keys: its KV blocks are shared only with requests of the same adapter digest
    *and* the same salt (the server salts tenant traffic with the tenant), so a cache hit
    reveals nothing across salts.

    A new per-request field is one field here plus its consumers (whoever fills it, the intake
    that uses it); no layer in between names it.
    """

    request_id: str
    prompt: str | list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    adapter: AdapterSpec | LoRARequest | AdapterComposition | None = None
    arrival: float | None = None
    cache_salt: str | None = None
