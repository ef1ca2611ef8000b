"""The engine: add requests, then ``step()`` until done. One step (:meth:`LLMEngine.step`):

1. **schedule** — the scheduler picks the sequences, how many tokens each runs (prompt chunks,
   one token when decoding) and reserves their KV blocks and adapter slots;
2. **stage adapters** — slots new to the batch get their weights on a background thread; the
   sequences whose adapter is still being copied sit this step out;
3. **run** — the runner lets its merger merge (or unmerge) a lone adapter, then runs the model
   once over the batch;
4. **sample** — one token for each sequence whose prompt is complete; the scheduler then
   advances the sequences' computed counts (publishing full blocks to the prefix cache), and
   :attr:`LLMEngine.last_step` records what the step computed (:class:`StepStats`);
5. **postprocess** — the tokens join their sequences (text, stop checks, finishes) and the
   requests that progressed become outputs.

Building the parts (:mod:`~loraplex.engine.builder`) and preparing requests
(:mod:`~loraplex.engine.intake`) happen outside the loop; stop detection and output assembly
live in :mod:`~loraplex.engine.postprocess`.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch

from loraplex.config import EngineConfig
from loraplex.engine.builder import build_parts
from loraplex.engine.intake import EngineRequest, PreparedRequest, PriorityRules, RequestIntake
from loraplex.engine.postprocess import append_token, take_outputs
from loraplex.engine.push import PushedAdapters
from loraplex.engine.runner import ModelRunner
from loraplex.engine.sampler import Sampler
from loraplex.engine.scheduler import ScheduledBatch, Scheduler
from loraplex.engine.scheduling import make_policy
from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.engine.spec.speculator import build_speculator
from loraplex.engine.spec.stats import SpecStepStats
from loraplex.engine.structured import StructuredOutputBackend
from loraplex.outputs import RequestOutput
from loraplex.requests import GenerationRequest, LoRARequest, SamplingParams
from loraplex.types import (
    AdapterComposition,
    AdapterRef,
    AdapterSpec,
    FinishReason,
    InvalidRequestError,
)

_STAGING_WAIT_S = 0.05  # longest an engine with only loading sequences sleeps before rescheduling


@dataclass(frozen=True)
class StepStats:
    """What the last step computed (for metrics): sequences and tokens run, distinct adapters,
    and, as vLLM counts them, the prompt tokens of the sequences whose prefill completed (cached
    tokens included) and the tokens generated."""

    num_seqs: int = 0
    num_tokens: int = 0
    distinct_adapters: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    spec: SpecStepStats | None = None  # drafts verified this step (None: none carried)

    @classmethod
    def of(cls, batch: ScheduledBatch, samplers: list[Sequence]) -> StepStats:
        """The stats of ``batch`` once run, before its sampled tokens are appended."""
        return cls(
            num_seqs=len(batch.items),
            num_tokens=sum(n for _, n in batch.items),
            distinct_adapters=len({a.ref.sha256 for s, _ in batch.items for a in s.adapters}),
            num_prompt_tokens=sum(
                len(s.prompt_token_ids) for s in samplers if not s.output_token_ids
            ),
            num_generation_tokens=len(samplers),
        )


class LLMEngine:
    """One base model, many adapters, continuous batching over a paged KV cache."""

    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        parts = build_parts(config)
        self.model_config = parts.model_config
        self.device, self.dtype = parts.device, parts.dtype
        self.tokenizer = parts.tokenizer
        self.model = parts.model
        self.eos_token_ids = parts.eos_token_ids  # one set: intake and postprocess read it
        lora = parts.lora
        self.adapters = lora.adapters if lora is not None else None
        self.adapter_catalog = lora.catalog if lora is not None else None
        self.merger = lora.merger if lora is not None else None
        self.cache, self.pool = parts.cache, parts.pool
        self.max_model_len = parts.max_model_len
        self.workers = parts.workers  # the tensor-parallel group (None: one process)
        if self.workers is not None:  # the workers go when this engine does, at the latest
            weakref.finalize(self, self.workers.close)
        policy = make_policy(config.scheduling_policy)
        rules = PriorityRules.from_config(config, policy)
        self.scheduler = Scheduler(
            self.pool,
            self.adapters,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            policy=policy,
            class_weights=tuple(w for _, w in config.slo_class_weights()),
            default_class=rules.default_index,
            rank_slot_budgets=config.rank_slot_budgets(),
            kv_groups=self.cache.groups,
            state_pool=parts.state_pool,
        )
        self.intake = RequestIntake(
            tokenizer=self.tokenizer,
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            adapters=self.adapters,
            catalog=self.adapter_catalog,
            rules=rules,
            json_whitespace=config.structured_outputs_whitespace,
        )
        self.pushed = PushedAdapters(self.adapters) if self.adapters is not None else None
        self.intake.pushed = self.pushed
        self.runner = ModelRunner(self.model, self.cache, self.merger)
        self.sampler = Sampler(config.seed)
        self.spec = build_speculator(config, parts)  # speculative decoding (None: off)
        if self.spec is not None and self.adapters is not None:
            # what a drafter learned from an adapter goes when the adapter leaves host memory
            self.adapters.add_eviction_listener(self.spec.proposer.forget_adapter)
        self.requests: dict[str, EngineRequest] = {}
        self.num_steps = 0
        self.last_step = StepStats()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any, and release the drafting method's
        resources (idempotent)."""
        if self.workers is not None:
            self.workers.close()
        if self.spec is not None:
            self.spec.proposer.close()

    @property
    def failure(self) -> str | None:
        """Why this engine can no longer step (a tensor-parallel rank died), else None."""
        return self.workers.failure if self.workers is not None else None

    # -- requests (intake: any thread) -----------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.intake.tokenize(prompt)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **options: Any
    ) -> list[int]:
        """See :meth:`RequestIntake.apply_chat_template` (its keyword options)."""
        return self.intake.apply_chat_template(messages, add_generation_prompt, **options)

    @property
    def structured_outputs(self) -> StructuredOutputBackend:
        return self.intake.structured_outputs

    def prepare_request(self, request: GenerationRequest) -> PreparedRequest:
        """Validate, tokenize and take the adapter's references, on any thread: see
        :meth:`RequestIntake.prepare`. The result must be passed to :meth:`add_prepared` or
        :meth:`discard_prepared` exactly once."""
        return self.intake.prepare(request)

    def discard_prepared(self, prepared: PreparedRequest) -> None:
        """Give back the adapter references of a prepared request that will never run."""
        self.intake.discard(prepared)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        lora_request: AdapterSpec | LoRARequest | AdapterComposition | None = None,
    ) -> None:
        """Validate and queue a request (vLLM's signature: the :class:`GenerationRequest` is
        built here). Raises InvalidRequestError / AdapterError; on error nothing is queued and
        no resource is held."""
        params = params or SamplingParams()
        request = GenerationRequest(request_id, prompt, params, adapter=lora_request)
        self.add_prepared(self.prepare_request(request))

    def add_lora(self, lora_request: LoRARequest, *, persist_disk: bool = False) -> AdapterRef:
        """vLLM's ``add_lora``: load (a path) or push (``lora_tensors`` + ``peft_config``) an
        adapter, verified and in host memory (and the disk tier with ``persist_disk``), and make
        it the active revision of its name: a later ``LoRARequest(name)`` (no path) gets it;
        requests already added finish on the revision they had. Returns its ref (vLLM returns
        True). Raises AdapterError / InvalidRequestError; bad input changes nothing."""
        if self.pushed is None or self.adapters is None:
            raise InvalidRequestError("add_lora needs LoRA enabled (enable_lora)")
        if not isinstance(lora_request, LoRARequest):
            raise InvalidRequestError("add_lora takes a LoRARequest")
        if lora_request.lora_tensors is not None:
            return self.pushed.push_request(lora_request, persist_disk=persist_disk).ref
        if not lora_request.path:
            raise InvalidRequestError(f"LoRARequest {lora_request.name!r} has no path or tensors")
        if persist_disk:
            raise InvalidRequestError("persist_disk is for pushed tensors; a path is on disk")
        assert self.adapter_catalog is not None
        spec = self.adapter_catalog.spec(lora_request)
        adapter, _ = self.adapters.acquire(spec, count=False)  # load and verify now
        self.adapters.release(adapter)
        self.pushed.activate(spec)
        return spec.ref

    # -- requests (loop thread) ------------------------------------------------------------------
    def add_prepared(self, prepared: PreparedRequest) -> None:
        """Queue a prepared request. Cheap; raises only for a reused id, in which case the
        prepared request is discarded."""
        req = prepared.request
        if prepared.consumed:
            raise RuntimeError(f"prepared request {req.request_id!r} was already consumed")
        if req.request_id in self.requests:
            self.discard_prepared(prepared)
            raise InvalidRequestError(f"request id {req.request_id!r} is already in use")
        prepared.consumed = True
        if req.seqs and req.seqs[0].is_alora:
            self.scheduler.sharing.record_alora(req.seqs[0].lora_start is not None)
        for seq in req.seqs:
            self.scheduler.add(seq)
        self.requests[req.request_id] = req

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks and slot. False if unknown or done."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.seqs:
            if not seq.is_finished:
                self._finish(seq, FinishReason.ABORT.value)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """schedule → stage adapters → run → sample → postprocess (see the module docstring).
        Returns the requests that progressed."""
        batch = self.scheduler.schedule()
        if self.adapters is not None and not batch.empty:
            self._stage_adapters(batch)
        if batch.empty:
            self.last_step = StepStats()  # nothing ran: observers must not see the last step again
            return []
        t0 = time.perf_counter()
        logits, samplers = self.runner.run(batch)
        if self.spec is not None and any(s.spec_tokens for s in samplers):
            outputs = self._verify(batch, logits, samplers)
        else:
            # sample before advancing: if sampling raises, the step is simply redone next time
            tokens = self.sampler(logits, samplers) if samplers else []
            self.scheduler.after_step(batch)
            self.num_steps += 1
            self.last_step = StepStats.of(batch, samplers)
            outputs = self._postprocess(samplers, tokens)
        if self.spec is not None:  # measure the step, then draft for the next one
            self.spec.observe_step(self.last_step.num_tokens, time.perf_counter() - t0)
            self.spec.propose(self.scheduler.running, self.config.max_num_batched_tokens)
        return outputs

    def _verify(
        self, batch: ScheduledBatch, logits: torch.Tensor, samplers: list[Sequence]
    ) -> list[RequestOutput]:
        """A step that carried drafts: verify them (appending what the target keeps), advance
        without counting rejected draft positions as computed, apply the finishes."""
        assert self.spec is not None
        finishes, rejected, appended, spec = self.spec.verify(
            logits, samplers, self.sampler.generator, self.eos_token_ids
        )
        self.scheduler.after_step(batch, rejected)
        self.num_steps += 1
        self.last_step = replace(
            StepStats.of(batch, samplers), num_generation_tokens=appended, spec=spec
        )
        for seq, reason in finishes:
            self._finish(seq, reason)
        return take_outputs(self.requests, dict.fromkeys(s.request_id for s in samplers))

    def _stage_adapters(self, batch: ScheduledBatch) -> None:
        """Newly reserved slots get their weights on a background thread: the sequences whose
        adapter is still loading sit this step out (they keep their slot and KV blocks and run
        once its rows are complete); the rest run now. With nothing left to run, wait for a load
        rather than spin."""
        assert self.adapters is not None
        loading = self.adapters.stage(batch)
        if not loading:
            return
        batch.items = [(s, n) for s, n in batch.items if loading.isdisjoint(s.slots)]
        if not batch.items:
            self.adapters.wait_staging(_STAGING_WAIT_S)

    def _postprocess(self, samplers: list[Sequence], tokens: list[int]) -> list[RequestOutput]:
        """Append each sampled token and finish what it ends; the outputs of the requests that
        progressed."""
        now = time.monotonic()
        for seq, tok in zip(samplers, tokens, strict=True):
            reason = append_token(seq, tok, now, self.eos_token_ids)
            if reason is not None:
                self._finish(seq, reason)
        return take_outputs(self.requests, dict.fromkeys(s.request_id for s in samplers))

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        if self.spec is not None:
            self.spec.finish(seq)
        if self.adapters is not None:
            for copy in seq.adapters:  # a composition's every component
                self.adapters.release(copy)
            if self.pushed is not None and self.pushed.retiring:  # a replaced revision's last?
                self.pushed.retire()

    # -- introspection ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def is_idle(self) -> bool:
        """No request queued or running, every KV block and state page free, every slot
        without users."""
        state = self.scheduler.kv.state_pool
        return (
            not self.scheduler.has_unfinished()
            and self.pool.num_free == self.pool.num_blocks
            and (state is None or state.num_free == state.num_blocks)
            and (self.adapters is None or self.adapters.is_idle())
        )

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use by requests (cached-but-free prefix blocks count free)."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def waiting_adapter_digests(self) -> set[str]:
        return {a.ref.sha256 for s in self.scheduler.waiting_sequences() for a in s.adapters}

    def running_sequences(self) -> list[Sequence]:
        return [s for s in self.scheduler.running if s.status is SequenceStatus.RUNNING]
