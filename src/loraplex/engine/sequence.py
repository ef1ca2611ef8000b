"""One request's state inside the engine."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from loraplex.kv.block_pool import alora_namespace, composition_namespace, salted_namespace
from loraplex.kv.groups import NULL_BLOCK
from loraplex.lora.peft.activation import activation_start
from loraplex.outputs import TokenLogprob
from loraplex.requests import SamplingParams
from loraplex.types import BASE_NAMESPACE

if TYPE_CHECKING:
    from loraplex.engine.detokenizer import Detokenizer
    from loraplex.engine.structured import GrammarState
    from loraplex.lora.adapter import LoRAAdapter


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Tokens, KV blocks, adapter slot and outputs of one request (one completion)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # checked against max_model_len (None: all the room left)
    adapter: LoRAAdapter | None = None
    arrival: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    block_tables: list[list[int]] = field(default_factory=list)
    """One block table per KV-cache group (``loraplex.kv.groups``; entry ``b`` holds positions
    ``[b * block_size, (b + 1) * block_size)``, ``NULL_BLOCK`` once released); empty: none."""
    block_hashes: list[bytes] = field(default_factory=list)
    base_block_hashes: list[bytes] = field(default_factory=list)
    """The chain under the (salted) base namespace, for the KV-cache groups below the adapter's
    first KV layer (their blocks are keyed as base blocks); empty when none is."""
    kv_shared: list[int] = field(default_factory=list)
    """Per KV-cache group: leading blocks taken from the prefix cache at admission; positions
    in them are never written (a group may hit further than the tokens the sequence skips)."""
    num_published_blocks: int = 0
    slot: int | None = None  # device LoRA slot while running
    composed: tuple[LoRAAdapter, ...] = ()
    """A composed request's other adapters (host copies, one request reference each), after
    ``adapter``, its first; empty for a plain adapter."""
    scales: tuple[float, ...] | None = None
    """Per component (``adapter`` first, then ``composed``), the scale its delta is added with;
    None: a plain adapter at 1.0. Zero scales never get here (the intake drops them)."""
    composed_slots: list[int] = field(default_factory=list)
    """The device slots of ``composed``, in order, while running (reserved with ``slot``)."""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: str = ""
    stop_search_from: int = 0  # stop strings ending inside the min_tokens text are ignored
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float = 0.0
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    eos_token_ids: tuple[int, ...] = ()  # the model's EOS ids (stop ids: params)
    detokenizer: Detokenizer | None = None  # None without a tokenizer
    token_text_ends: list[int] = field(default_factory=list)  # len(text) after each output token
    cache_salt: str | None = None  # prefix-cache salt: KV shared only with the same salt
    grammar: GrammarState | None = None  # structured output: what may come next
    # prompt token logprobs (the request's first sequence only): [None, {tok: lp, ...}, ...]
    # filled as prefill chunks run; None when not asked for
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # scheduling: lower runs first (vLLM's request priority; the engine folds the adapter's or
    # tenant's SLO class into it), and the key whose served tokens the fair policy balances
    priority: int = 0
    tenant: str | None = None
    preempted_at_step: int | None = None  # the scheduler step that last preempted it
    spec_tokens: list[int] = field(default_factory=list)
    """Draft tokens proposed to follow ``all_token_ids`` (speculative decoding): the next step
    runs them after the last token and verifies them; empty: none. The scheduler drops them
    when the sequence is not decoding or its step cannot hold them."""
    spec_probs: torch.Tensor | None = None  # [len(spec_tokens), V] the draft's distributions
    spec_kept: bool = False  # its last verified draft was kept whole (adaptive k keys on it)
    # the first position the adapter applies to (0: a standard LoRA; an aLoRA's activation
    # point; None: no adapter, or an aLoRA whose invocation the prompt lacks: base throughout)
    lora_start: int | None = field(init=False, default=None)
    component_starts: tuple[int | None, ...] = field(init=False, default=())
    """A composition's first position per component (``adapters`` order): 0 for a standard
    LoRA, an aLoRA's activation point, None for an aLoRA not invoked (it adds nothing); empty
    for a plain adapter (``lora_start`` says it)."""
    _namespace: bytes = field(init=False, repr=False, default=b"")
    _base_namespace: bytes = field(init=False, repr=False, default=b"")

    @property
    def block_ids(self) -> list[int]:
        """Every block the sequence holds, over all its KV-cache groups."""
        return [b for table in self.block_tables for b in table if b != NULL_BLOCK]

    def __post_init__(self) -> None:
        self._base_namespace = salted_namespace(BASE_NAMESPACE, self.cache_salt)
        self._namespace = self._base_namespace
        if self.adapter is None:
            return
        if self.scales is not None:  # a composition: each component from its own start
            self.component_starts = tuple(self._start_of(a) for a in self.adapters)
            present = [st for st in self.component_starts if st is not None]
            self.lora_start = min(present, default=None)  # None: no component applies
            ns = composition_namespace(self._composition_parts())
            self._namespace = salted_namespace(ns, self.cache_salt)
            return
        self.lora_start = self._start_of(self.adapter)
        if self.lora_start is None:
            return  # an aLoRA not invoked: the base model throughout, base KV, base keys
        ns = self.adapter.ref.namespace
        if self.adapter.alora_invocation_tokens is not None:
            ns = alora_namespace(ns, self.lora_start)
        self._namespace = salted_namespace(ns, self.cache_salt)

    def _start_of(self, adapter: LoRAAdapter) -> int | None:
        """The first position ``adapter`` applies to in this prompt: 0 for a standard LoRA,
        an aLoRA's activation point, None for an aLoRA whose invocation the prompt lacks."""
        invocation = adapter.alora_invocation_tokens
        if invocation is None:
            return 0
        return activation_start(self.prompt_token_ids, invocation)

    def _composition_parts(self) -> list[tuple[str, float]]:
        """``(key, scale)`` of the components that apply, as :func:`composition_namespace`
        takes them: a standard adapter by its digest, an aLoRA by its namespace at its start
        (the KV depends on where it starts); an aLoRA not invoked adds nothing, as a zero
        scale does."""
        assert self.scales is not None
        parts = []
        for a, w, st in zip(self.adapters, self.scales, self.component_starts, strict=True):
            if st is None:
                continue
            key = a.ref.sha256
            if a.alora_invocation_tokens is not None:
                key = alora_namespace(a.ref.namespace, st).hex()
            parts.append((key, w))
        return parts

    @property
    def adapters(self) -> tuple[LoRAAdapter, ...]:
        """Every adapter of the request (one request reference each): ``adapter``, then
        ``composed``; empty for the base model."""
        return () if self.adapter is None else (self.adapter, *self.composed)

    @property
    def is_composed(self) -> bool:
        """Several adapters, or one at a scale other than 1.0: the plan weighs them."""
        return self.scales is not None

    @property
    def slots(self) -> list[int]:
        """The device slots the sequence holds (``slot``, then ``composed_slots``)."""
        return ([] if self.slot is None else [self.slot]) + self.composed_slots

    @property
    def adapter_key(self) -> str | None:
        """What the sequence's LoRA work is keyed by: its adapter's digest, or for a
        composition ``"composed:"`` and its namespace's hex (never a plain digest); None for
        the base model."""
        if self.adapter is None:
            return None
        if self.scales is None:
            return self.adapter.ref.sha256
        return "composed:" + composition_namespace(self._composition_parts()).hex()

    @property
    def is_alora(self) -> bool:
        """Its one adapter (not a composition) is an activated LoRA (applied from its
        invocation on, if found)."""
        a = self.adapter
        return a is not None and self.scales is None and a.alora_invocation_tokens is not None

    def namespaces(self, block_size: int) -> Callable[[int], bytes]:
        """``block -> `` the prefix-cache namespace of that KV block: the base model's (salted)
        when the adapter touches none of its tokens (a block wholly before an aLoRA's
        activation point; every block of a request that runs the base model), else
        :attr:`namespace`."""
        start, base, own = self.lora_start, self._base_namespace, self._namespace
        if start is None:
            return lambda block: base
        return lambda block: base if (block + 1) * block_size <= start else own

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, i: int) -> int:
        """``all_token_ids[i]`` without building the list (a decode row's one token)."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def namespace(self) -> bytes:
        """Prefix-cache namespace of the blocks the adapter shapes: the adapter's digest (with
        an aLoRA's activation point), or the base's; salted with ``cache_salt`` when there is
        one. Blocks the adapter leaves alone: :meth:`block_namespace`."""
        return self._namespace

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt logprobs are asked for and not all computed yet: every prompt position must
        run through the model (no prefix-cache hits)."""
        pl = self.prompt_logprobs
        return pl is not None and len(pl) < len(self.prompt_token_ids)

    @property
    def tracks_logprobs(self) -> bool:
        """The sampler records this sequence's chosen-token logprobs: asked for, or needed to
        rank ``best_of`` candidates."""
        p = self.params
        return p.logprobs is not None or p.num_seqs > p.n

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
