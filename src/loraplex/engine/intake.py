"""Request intake: everything that can fail or take time before the engine loop sees a request
— validation, tokenization, chat templates, structured-output grammars, the adapter's host
reference, the scheduling priority — ending in a :class:`PreparedRequest` whose sequences the
loop queues as they are. Thread-safe with respect to the loop: servers call it from worker
threads.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from loraplex.cache.adapters import TieredAdapterCache
from loraplex.config import EngineConfig
from loraplex.engine.adapter_catalog import LocalAdapterCatalog
from loraplex.engine.chat import render_chat
from loraplex.engine.detokenizer import make_detokenizer
from loraplex.engine.push import PushedAdapters
from loraplex.engine.scheduling import SchedulingPolicy
from loraplex.engine.sequence import Sequence
from loraplex.engine.structured import GrammarState, StructuredOutputBackend
from loraplex.lora.adapter import LoRAAdapter
from loraplex.requests import GenerationRequest, LoRARequest, SamplingParams
from loraplex.types import (
    MAX_COMPOSED_ADAPTERS,
    AdapterComposition,
    AdapterError,
    AdapterRef,
    AdapterSpec,
    InvalidRequestError,
    ScaledAdapter,
    check_adapter_scale,
)


@dataclass
class EngineRequest:
    """One request in the engine: its sequences (one per completion) and what its outputs
    report."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    adapter_ref: AdapterRef | None
    arrival: float
    composition: AdapterComposition | None = None
    """The adapters it composes as asked (names, scales; zero scales included), if it does."""


@dataclass
class PreparedRequest:
    """A validated, tokenized request holding its adapter references, not yet queued."""

    request: EngineRequest
    adapter_warm: bool = True  # the adapter was in a device slot or host memory when asked for
    consumed: bool = False

    @property
    def alora_invoked(self) -> bool | None:
        """For an activated LoRA, whether the prompt holds its invocation (False: the base
        model serves the request); None for a standard LoRA or the base model."""
        seqs = self.request.seqs
        if not seqs or not seqs[0].is_alora:
            return None
        return seqs[0].lora_start is not None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def adapter(self) -> AdapterRef | None:
        return self.request.adapter_ref


@dataclass(frozen=True)
class PriorityRules:
    """How a request's scheduling priority is found: the policy (one without
    ``request_priorities``, fcfs, refuses request priorities), the SLO classes in order (their
    index is the priority), the default class and the tenants' classes."""

    policy: SchedulingPolicy
    class_index: dict[str, int]
    default_class: str
    tenant_classes: dict[str, str]

    @classmethod
    def from_config(cls, config: EngineConfig, policy: SchedulingPolicy) -> PriorityRules:
        index = {name: i for i, (name, _) in enumerate(config.slo_class_weights())}
        return cls(policy, index, config.default_slo_class, config.tenant_classes())

    @property
    def default_index(self) -> int:
        return self.class_index[self.default_class]

    def priority(self, params: SamplingParams, spec: AdapterSpec | None) -> int:
        """The request's scheduling priority (lower first), the class offset from
        ``--default-slo-class``: the request's own ``priority`` (vLLM's field; refused under
        fcfs, as vLLM does), else its adapter manifest's ``slo_class``, else its tenant's
        class (``--tenant-slo-classes``), else the manifest's ``priority`` (higher is more
        important there, as in the residency policy), else 0. A manifest class this server
        does not define counts as unset."""
        if params.priority != 0:
            if not self.policy.request_priorities:
                raise InvalidRequestError(
                    f"priority {params.priority} needs --scheduling-policy priority or fair "
                    f"(this server schedules by {self.policy.name}); use 0",
                    param="priority",
                )
            return params.priority
        if spec is None:
            return 0
        for name in (spec.slo_class, self.tenant_classes.get(spec.tenant or "")):
            if name is not None and name in self.class_index:
                return self.class_index[name] - self.default_index
        return -spec.priority


class RequestIntake:
    """Turns prompts, sampling parameters and adapters into prepared requests.

    ``eos_token_ids`` is the engine's own set (read when a request is prepared); ``adapters``
    and ``catalog`` are None without LoRA."""

    def __init__(
        self,
        *,
        tokenizer: Any | None,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: set[int],
        adapters: TieredAdapterCache | None,
        catalog: LocalAdapterCatalog | None,
        rules: PriorityRules,
        json_whitespace: str,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.adapters = adapters
        self.catalog = catalog
        # in-process pushes (LLMEngine.add_lora, LoRARequests with tensors); set by the engine
        self.pushed: PushedAdapters | None = None
        self.rules = rules
        self.json_whitespace = json_whitespace  # --structured-outputs-whitespace
        self.tokenizer_lock = threading.Lock()  # HF tokenizers are not safe to share for encode
        self._structured: StructuredOutputBackend | None = None  # made on first use
        self._structured_lock = threading.Lock()

    # -- text ----------------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        """Token ids of ``prompt`` (thread-safe)."""
        if self.tokenizer is None:
            raise InvalidRequestError(
                "text prompts need a tokenizer (skip_tokenizer_init=True was set)"
            )
        with self.tokenizer_lock:
            return list(self.tokenizer(prompt).input_ids)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Token ids of a conversation rendered with a chat template (the request's, else the
        model directory's): see :func:`loraplex.engine.chat.render_chat`. Thread-safe."""
        return render_chat(
            self.tokenizer,
            self.tokenizer_lock,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
            documents=documents,
            add_special_tokens=add_special_tokens,
        )

    @property
    def structured_outputs(self) -> StructuredOutputBackend:
        """The grammar compiler and cache (built on first use: it indexes the vocabulary)."""
        with self._structured_lock:
            if self._structured is None:
                if self.tokenizer is None:
                    raise InvalidRequestError(
                        "structured outputs need a tokenizer (skip_tokenizer_init=True was set)",
                        param="structured_outputs",
                    )
                with self.tokenizer_lock:  # it reads the whole vocabulary
                    self._structured = StructuredOutputBackend(
                        self.tokenizer,
                        self.vocab_size,
                        sorted(self.eos_token_ids),
                        whitespace=self.json_whitespace,
                    )
            return self._structured

    # -- validation ----------------------------------------------------------------------------
    def check_prompt(self, ids: list[int]) -> None:
        """Raise InvalidRequestError for an empty, out-of-vocabulary or too-long prompt."""
        if not ids:
            raise InvalidRequestError("prompt is empty")
        vocab = self.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"prompt token id {bad} is outside the vocabulary [0, {vocab})"
            )
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens, which leaves no room to generate within "
                f"max_model_len={self.max_model_len}"
            )

    def check_max_tokens(self, ids: list[int], max_tokens: int | None) -> int:
        """The completion's token budget: ``max_tokens``, or with None all the room left within
        ``max_model_len``. An explicit budget that does not fit raises InvalidRequestError
        (param ``max_tokens``), as OpenAI and vLLM do: lengths are never clamped silently."""
        n, limit = len(ids), self.max_model_len
        if max_tokens is None:
            return limit - n
        if n + max_tokens > limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {n + max_tokens} tokens ({n} in the prompt, {max_tokens} in the "
                "completion). Reduce the prompt or max_tokens.",
                param="max_tokens",
            )
        return max_tokens

    def _check_params(
        self, params: SamplingParams, adapter: AdapterSpec | LoRARequest | AdapterComposition | None
    ) -> None:
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError(
                "stop strings need a tokenizer (skip_tokenizer_init=True was set); "
                "use stop_token_ids"
            )
        if adapter is not None and not isinstance(
            adapter, (AdapterSpec, LoRARequest, AdapterComposition)
        ):
            raise InvalidRequestError(
                "lora_request must be a LoRARequest, a list of them (composed) or None, got "
                f"{type(adapter).__name__}",
                param="lora_request",
            )
        if adapter is not None and self.adapters is None:
            raise InvalidRequestError(
                f"adapter {adapter.name!r} requested but LoRA is disabled (enable_lora)"
            )
        vocab = self.vocab_size
        bad = next((t for t in params.stop_token_ids or () if t >= vocab), None)
        if bad is not None:  # the sampler masks stop ids by index (min_tokens)
            raise InvalidRequestError(
                f"stop_token_ids contains {bad}, which is outside the vocabulary [0, {vocab})"
            )
        bad = next((t for t in params.logit_bias or () if t >= vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"logit_bias names token {bad}, which is outside the vocabulary [0, {vocab})",
                param="logit_bias",
            )

    def adapter_spec(self, adapter: AdapterSpec | LoRARequest | None) -> AdapterSpec | None:
        """The spec of an offline LoRARequest (the local catalog hashes its files), or the spec."""
        if adapter is None or isinstance(adapter, AdapterSpec):
            return adapter
        if not adapter.path and self.pushed is not None:  # tensors, or a name added before
            return self.pushed.resolve(adapter)
        assert self.catalog is not None
        return self.catalog.spec(adapter)

    def composition(
        self, adapter: AdapterSpec | LoRARequest | AdapterComposition | None
    ) -> AdapterComposition | None:
        """The request's adapters as a composition when they are one: an
        :class:`AdapterComposition` (checked again here: at most ``MAX_COMPOSED_ADAPTERS``,
        distinct, finite bounded scales), or a ``LoRARequest`` whose ``lora_scale`` is not 1.0
        (a composition of one). None for a plain adapter or the base model."""
        if isinstance(adapter, LoRARequest) and adapter.lora_scale != 1.0:
            spec = self.adapter_spec(adapter)
            assert spec is not None
            return AdapterComposition((ScaledAdapter(spec, adapter.lora_scale),))
        if not isinstance(adapter, AdapterComposition):
            return None
        comps = adapter.components
        if not 1 <= len(comps) <= MAX_COMPOSED_ADAPTERS:
            raise InvalidRequestError(
                f"a request composes 1 to {MAX_COMPOSED_ADAPTERS} adapters, got {len(comps)}",
                param="lora_request",
            )
        for c in comps:
            check_adapter_scale(c.scale, param=f"scale of {c.spec.name!r}")
        if len({c.spec.sha256 for c in comps}) != len(comps):
            raise InvalidRequestError(
                "a request's composition names one adapter twice", param="lora_request"
            )
        return adapter

    def _acquire_components(
        self, comp: AdapterComposition
    ) -> tuple[list[LoRAAdapter], list[float], bool]:
        """Host copies (one request reference each) of ``comp``'s adapters with a non-zero
        scale, their scales, and whether all were warm. Zero-scale components are loaded too
        (a component that cannot serve fails the request whatever its scale), then let go.
        On error nothing is held."""
        assert self.adapters is not None
        held: list[LoRAAdapter] = []
        kept: list[tuple[LoRAAdapter, float]] = []
        warm = True
        try:
            for c in comp.components:
                try:
                    copy, was_warm = self.adapters.acquire(c.spec)
                except AdapterError as e:
                    if len(comp.components) > 1 and e.args:  # say which component failed
                        e.args = (f"component {c.spec.name!r} of {comp.name}: {e.args[0]}",)
                    raise
                held.append(copy)
                warm = warm and was_warm
                if c.scale != 0.0:
                    kept.append((copy, c.scale))
        except BaseException:
            for copy in held:
                self.adapters.release(copy)
            raise
        for copy in held:  # zero-scale components: checked, not kept
            if all(copy is not k for k, _ in kept):
                self.adapters.release(copy)
        return [k for k, _ in kept], [w for _, w in kept], warm

    # -- preparing -----------------------------------------------------------------------------
    def prepare(self, request: GenerationRequest) -> PreparedRequest:
        """Everything that can fail or take time, done before the engine loop sees the request:
        validation, tokenization, the grammar, the adapter's host copy (one reference per
        completion). On error nothing is held.

        ``request.cache_salt`` salts the sequences' prefix-cache keys; ``request.adapter``, an
        offline ``LoRARequest``, becomes a spec through the engine's local catalog (its digest,
        memoised): see :class:`~loraplex.requests.GenerationRequest`."""
        params = request.params
        params.validate()
        prompt = request.prompt
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = self.tokenize(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
        self.check_prompt(ids)
        self._check_params(params, request.adapter)
        max_tokens = self.check_max_tokens(ids, params.max_tokens)
        compiled = None  # compiled on the backend's pool; this (worker) thread waits
        if params.structured is not None:
            compiled = self.structured_outputs.compile(params.structured)
        comp = self.composition(request.adapter)
        if comp is not None:
            spec: AdapterSpec | None = comp.components[0].spec
        else:
            spec = self.adapter_spec(request.adapter)  # type: ignore[arg-type]
        priority = self.rules.priority(params, spec)
        tenant = (spec.tenant or spec.ref.name) if spec is not None else None
        copies: list[LoRAAdapter] = []
        scales: tuple[float, ...] | None = None
        warm = True
        if comp is not None and self.adapters is not None:
            copies, kept, warm = self._acquire_components(comp)
            if len(kept) > 1 or (kept and kept[0] != 1.0):
                scales = tuple(kept)  # else: the base model, or one adapter as it is
        elif spec is not None and self.adapters is not None:
            copy, warm = self.adapters.acquire(spec)
            copies = [copy]
        host_copy = copies[0] if copies else None
        # nothing below may leave a reference behind if it raises
        held = list(copies)
        eos_ids = tuple(self.eos_token_ids)
        seqs = []
        try:
            for _ in range(params.num_seqs - 1):
                for copy in copies:
                    self.adapters.retain(copy)  # type: ignore[union-attr]
                    held.append(copy)  # one host reference per completion and adapter
            for i in range(params.num_seqs):
                gen = None
                if params.seed is not None:  # torch seeds are 64-bit: wrap like torch does
                    gen = torch.Generator().manual_seed((params.seed + i) & 0xFFFF_FFFF_FFFF_FFFF)
                detok = None
                if self.tokenizer is not None:
                    detok = make_detokenizer(self.tokenizer, ids, params.skip_special_tokens)
                seq = Sequence(
                    request_id=request.request_id,
                    prompt=text,
                    prompt_token_ids=ids,
                    params=params,
                    max_tokens=max_tokens,
                    adapter=host_copy,
                    composed=tuple(copies[1:]),
                    scales=scales,
                    generator=gen,
                    eos_token_ids=eos_ids,
                    detokenizer=detok,
                    cache_salt=request.cache_salt,
                    priority=priority,
                    tenant=tenant,
                    grammar=GrammarState(compiled) if compiled is not None else None,
                    # the first sequence computes the request's prompt logprobs
                    prompt_logprobs=[None]
                    if i == 0 and params.prompt_logprobs is not None
                    else None,
                )
                seqs.append(seq)
        except BaseException:
            for copy in held:
                self.adapters.release(copy)  # type: ignore[union-attr]
            raise
        # the ref reports the name (and revision) the request used; caches key on the digest only
        # (a composition's: its first component that applies, none when every scale is 0 and
        # the base model ran; ``composition`` names them all)
        if comp is not None:
            spec = next((c.spec for c in comp.components if c.scale != 0.0), None)
        ref = spec.ref if spec is not None else None
        arrival = request.arrival if request.arrival is not None else time.monotonic()
        req = EngineRequest(request.request_id, text, ids, seqs, ref, arrival, comp)
        return PreparedRequest(req, adapter_warm=warm)

    def discard(self, prepared: PreparedRequest) -> None:
        """Give back the adapter references of a prepared request that will never run."""
        if prepared.consumed:
            return
        prepared.consumed = True
        for seq in prepared.request.seqs:
            if self.adapters is not None:
                for copy in seq.adapters:
                    self.adapters.release(copy)
