"""The engine: add requests, then ``step()`` until done. schedule → activate → run → postprocess."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil
import torch

from loraplex.cache.adapters import TieredAdapterCache
from loraplex.config import EngineConfig
from loraplex.engine.adapter_catalog import LocalAdapterCatalog
from loraplex.engine.chat import render_chat
from loraplex.engine.detokenizer import make_detokenizer
from loraplex.engine.merge import AdapterMerger
from loraplex.engine.runner import ModelRunner
from loraplex.engine.sampler import Sampler
from loraplex.engine.scheduler import ScheduledBatch, Scheduler
from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.engine.structured import GrammarState, StructuredOutputBackend
from loraplex.kv.block_pool import BlockPool
from loraplex.kv.cache import PagedKVCache
from loraplex.lora.adapter import BaseModelSpec
from loraplex.lora.backends import select_lora_ops
from loraplex.lora.slots import LoRASlotBank
from loraplex.model.config import ModelConfig, load_model_config
from loraplex.model.linear import cpu_has_fast_bf16, select_linear_factory
from loraplex.model.llama import LlamaForCausalLM, LoRABinding
from loraplex.outputs import CompletionOutput, RequestOutput
from loraplex.requests import LoRARequest, SamplingParams
from loraplex.types import (
    AdapterRef,
    AdapterSpec,
    FinishReason,
    InvalidRequestError,
    ModelLoadError,
)

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CPU_DEFAULT_KV_BYTES = 2 << 30
_STAGING_WAIT_S = 0.05  # longest an engine with only loading sequences sleeps before rescheduling


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return dev


def resolve_dtype(requested: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """``auto``: the checkpoint's half type where the hardware runs it fast, else float32."""
    if requested != "auto":
        return _DTYPES[requested]
    saved = (cfg.torch_dtype or "float32").replace("torch.", "")
    if device.type == "cuda":
        return torch.float16 if saved == "float16" else torch.bfloat16
    if saved in ("bfloat16", "float16") and cpu_has_fast_bf16():
        return torch.bfloat16
    return torch.float32


def _snapshot(
    prompt_logprobs: list[dict[int, float] | None] | None,
) -> list[dict[int, float] | None] | None:
    """A copy of the prompt logprobs for an output (the dicts are never changed once made)."""
    return None if prompt_logprobs is None else list(prompt_logprobs)


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    adapter_ref: AdapterRef | None
    arrival: float


@dataclass(frozen=True)
class StepStats:
    """What the last step computed (for metrics)."""

    num_seqs: int = 0
    num_tokens: int = 0
    distinct_adapters: int = 0


@dataclass
class PreparedRequest:
    """A validated, tokenized request holding its adapter references, not yet queued."""

    request: _Request
    adapter_warm: bool = True  # the adapter was in a device slot or host memory when asked for
    consumed: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def adapter(self) -> AdapterRef | None:
        return self.request.adapter_ref


class LLMEngine:
    """One base model, many adapters, continuous batching over a paged KV cache."""

    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        model_dir = Path(config.model)
        self.model_config = load_model_config(
            model_dir, config.generation_config, config.generation_overrides
        )
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.model_config, self.device)
        tok_dir = Path(config.tokenizer) if config.tokenizer else model_dir
        self.tokenizer = (
            None
            if config.skip_tokenizer_init
            else self._load_tokenizer(tok_dir, config.trust_remote_code)
        )
        mc = self.model_config
        self.model = LlamaForCausalLM.from_pretrained(model_dir, mc, self.dtype, self.device)
        if self.model.linear_impl == "upcast-f32":
            log.warning(
                "this CPU has no native bfloat16 (no AVX512_BF16 or AMX): bfloat16 GEMMs run "
                "2-4x slower than float32 here; prompt GEMMs are computed in float32 from the "
                "bfloat16 weights, decode steps stay bfloat16 (--dtype float32 is faster on "
                "this CPU if memory allows)"
            )
        self.eos_token_ids = set(mc.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(self.tokenizer.eos_token_id))

        self.adapters: TieredAdapterCache | None = None
        self.adapter_catalog: LocalAdapterCatalog | None = None  # LoRARequest -> AdapterSpec
        if config.enable_lora:
            shapes = {
                (layer, proj): dims
                for layer in range(mc.num_layers)
                for proj, dims in mc.module_shapes.items()
            }
            ops = select_lora_ops(self.device)  # backend chosen once, here
            table_dtype = ops.table_dtype(self.dtype)
            slots = self._lora_slot_count(shapes, table_dtype)  # --max-lora-device-fraction
            bank = LoRASlotBank(shapes, slots, config.max_lora_rank, table_dtype, self.device)
            self.model.lora = LoRABinding(bank, ops)
            spec = BaseModelSpec(mc.num_layers, mc.module_shapes, mc.model_type)
            cache_config = config if slots == config.max_loras else replace(config, max_loras=slots)
            self.adapters = TieredAdapterCache.from_config(
                bank, spec, cache_config, dtype=table_dtype
            )
            self.adapter_catalog = LocalAdapterCatalog(self.adapters.store)
        self.merger: AdapterMerger | None = None  # one adapter merged into the base weights
        if config.enable_lora and config.lora_merge_after_steps:
            _, make = select_linear_factory(self.device, self.dtype)
            self.merger = AdapterMerger(self.model, make, config.lora_merge_after_steps)

        num_blocks = self._num_kv_blocks()
        self.cache = PagedKVCache(
            mc.num_layers,
            num_blocks,
            config.block_size,
            mc.num_kv_heads,
            mc.head_dim,
            self.dtype,
            self.device,
        )
        self.max_model_len = self._max_model_len(num_blocks)
        self.pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching)
        classes = config.slo_class_weights()
        self._class_index = {name: i for i, (name, _) in enumerate(classes)}
        self._tenant_classes = config.tenant_classes()
        self.scheduler = Scheduler(
            self.pool,
            self.adapters,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            policy=config.scheduling_policy,
            class_weights=tuple(w for _, w in classes),
            default_class=self._class_index[config.default_slo_class],
            rank_slot_budgets=config.rank_slot_budgets(),
        )
        self.runner = ModelRunner(self.model, self.cache)
        self.sampler = Sampler(config.seed)
        self.requests: dict[str, _Request] = {}
        self.num_steps = 0
        self.last_step = StepStats()
        self._tokenizer_lock = threading.Lock()  # HF tokenizers are not safe to share for encode
        self._structured: StructuredOutputBackend | None = None  # made on first use
        self._structured_lock = threading.Lock()

    # -- set-up helpers --------------------------------------------------------------------------
    @staticmethod
    def _load_tokenizer(model_dir: Path, trust_remote_code: bool = False) -> Any:
        if not any(
            (model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")
        ):
            raise ModelLoadError(
                f"{model_dir}: no tokenizer files (tokenizer.json / tokenizer.model / vocab.json); "
                "pass skip_tokenizer_init=True and give prompts as token ids"
            )
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(
                str(model_dir), trust_remote_code=trust_remote_code
            )
        except Exception as e:  # transformers raises many types here
            raise ModelLoadError(f"{model_dir}: cannot load tokenizer ({e})") from e

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
                with self._tokenizer_lock:  # it reads the whole vocabulary
                    self._structured = StructuredOutputBackend(
                        self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids)
                    )
            return self._structured

    def _memory_after_weights(self) -> int:
        """Bytes this engine may give the KV cache and adapter slots together: by
        ``--kv-cache-memory`` if set, on CUDA what ``--gpu-memory-utilization`` leaves after
        what the device holds now, on CPU a quarter of the available memory (at most 2 GiB)."""
        c = self.config
        if c.kv_cache_memory_bytes is not None:
            return c.kv_cache_memory_bytes
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return c.device_kv_budget(free, total)  # --gpu-memory-utilization
        return min(_CPU_DEFAULT_KV_BYTES, psutil.virtual_memory().available // 4)

    def _lora_slot_count(
        self, shapes: dict[tuple[int, str], tuple[int, int]], dtype: torch.dtype
    ) -> int:
        """The slot bank's slots: ``--max-loras``, capped so the bank's bytes stay within
        ``--max-lora-device-fraction`` of the memory left after the weights. One slot holds
        ``max_lora_rank`` rows of A ``[r, d_in]`` and of B^T ``[r, d_out]`` for every module."""
        c = self.config
        if c.max_lora_device_fraction is None:
            return c.max_loras
        row_bytes = sum(d_in + d_out for d_in, d_out in shapes.values()) * dtype.itemsize
        return c.lora_slot_count(c.max_lora_rank * row_bytes, self._memory_after_weights())

    def _num_kv_blocks(self) -> int:
        c, mc = self.config, self.model_config
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        per_block = PagedKVCache.bytes_per_block(
            mc.num_layers, c.block_size, mc.num_kv_heads, mc.head_dim, self.dtype
        )
        budget = c.kv_cache_memory_bytes
        if budget is None:
            budget = self._memory_after_weights()  # on CUDA the slot bank is out of it already
            if c.max_lora_device_fraction is not None and self.device.type != "cuda":
                # the slot bank's capped share comes out of the same memory
                budget = max(budget - (self.adapters.bank.nbytes if self.adapters else 0), 0)
            # never more than max_num_seqs full-length sequences can use
            longest = c.max_model_len or mc.max_position_embeddings
            budget = min(budget, c.max_num_seqs * -(-longest // c.block_size) * per_block)
        blocks = budget // per_block
        if blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} is smaller than one KV block ({per_block} bytes)"
            )
        return int(blocks)

    def _max_model_len(self, num_blocks: int) -> int:
        mc = self.model_config
        limit = mc.max_position_embeddings
        if mc.sliding_window:
            limit = min(limit, mc.sliding_window)  # full attention within the window is exact
        capacity = num_blocks * self.config.block_size
        want = self.config.max_model_len
        if want is None:
            return min(limit, capacity)
        if want > limit:
            raise ValueError(
                f"max_model_len={want} exceeds the model's limit {limit} "
                f"(max_position_embeddings / sliding_window in config.json)"
            )
        if want > capacity:
            raise ValueError(
                f"max_model_len={want} needs more KV cache than configured ({capacity} tokens); "
                "raise kv_cache_memory_bytes or lower max_model_len"
            )
        return want

    # -- requests --------------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        """Token ids of ``prompt`` (thread-safe)."""
        if self.tokenizer is None:
            raise InvalidRequestError(
                "text prompts need a tokenizer (skip_tokenizer_init=True was set)"
            )
        with self._tokenizer_lock:
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
            self._tokenizer_lock,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
            documents=documents,
            add_special_tokens=add_special_tokens,
        )

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        lora_request: AdapterSpec | LoRARequest | None = None,
    ) -> None:
        """Validate and queue a request. Raises InvalidRequestError / AdapterError; on error
        nothing is queued and no resource is held."""
        self.add_prepared(self.prepare_request(request_id, prompt, params, lora_request))

    def prepare_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        lora_request: AdapterSpec | LoRARequest | None = None,
        *,
        arrival: float | None = None,
        cache_salt: str | None = None,
    ) -> PreparedRequest:
        """Everything that can fail or take time, done before the engine loop sees the request:
        validation, tokenization, the adapter's host copy (one reference per completion).

        ``cache_salt`` (vLLM's field) salts the request's prefix-cache keys: its KV blocks are
        shared only with requests of the same adapter digest *and* the same salt (the server
        salts tenant traffic with the tenant), so a cache hit reveals nothing across salts.

        ``lora_request``: the adapter as a spec (from a catalog, e.g. the server's registry
        view), or an offline ``LoRARequest(name, path)`` that the engine's local catalog turns
        into one (its digest, memoised). Thread-safe with respect to the loop, so servers call
        it from worker threads. The result must be passed to :meth:`add_prepared` or
        :meth:`discard_prepared` exactly once."""
        params = params or SamplingParams()
        params.validate()
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = self.tokenize(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
        self.check_prompt(ids)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError(
                "stop strings need a tokenizer (skip_tokenizer_init=True was set); "
                "use stop_token_ids"
            )
        if lora_request is not None and self.adapters is None:
            raise InvalidRequestError(
                f"adapter {lora_request.name!r} requested but LoRA is disabled (enable_lora)"
            )
        vocab = self.model_config.vocab_size
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
        max_tokens = self.check_max_tokens(ids, params.max_tokens)
        eos_ids = tuple(self.eos_token_ids)
        compiled = None  # compiled on the backend's pool; this (worker) thread waits
        if params.structured is not None:
            compiled = self.structured_outputs.compile(params.structured)
        spec = self._adapter_spec(lora_request)
        priority = self._priority(params, spec)
        tenant = (spec.tenant or spec.ref.name) if spec is not None else None
        adapter = None
        if spec is not None and self.adapters is not None:
            adapter, warm = self.adapters.acquire(spec)
        else:
            warm = True
        # nothing below may leave a reference behind if it raises
        held = 1 if adapter is not None else 0
        seqs = []
        try:
            for _ in range(params.num_seqs - 1 if adapter is not None else 0):
                self.adapters.retain(adapter)  # type: ignore[union-attr, arg-type]
                held += 1  # one host reference per completion
            for i in range(params.num_seqs):
                gen = None
                if params.seed is not None:  # torch seeds are 64-bit: wrap like torch does
                    gen = torch.Generator().manual_seed((params.seed + i) & 0xFFFF_FFFF_FFFF_FFFF)
                detok = None
                if self.tokenizer is not None:
                    detok = make_detokenizer(self.tokenizer, ids, params.skip_special_tokens)
                seq = Sequence(
                    request_id=request_id,
                    prompt=text,
                    prompt_token_ids=ids,
                    params=params,
                    max_tokens=max_tokens,
                    adapter=adapter,
                    generator=gen,
                    eos_token_ids=eos_ids,
                    detokenizer=detok,
                    cache_salt=cache_salt,
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
            for _ in range(held):
                self.adapters.release(adapter)  # type: ignore[union-attr, arg-type]
            raise
        # the ref reports the name (and revision) the request used; caches key on the digest only
        ref = spec.ref if spec is not None else None
        now = time.monotonic()
        return PreparedRequest(
            _Request(request_id, text, ids, seqs, ref, arrival if arrival is not None else now),
            adapter_warm=warm,
        )

    def _priority(self, params: SamplingParams, spec: AdapterSpec | None) -> int:
        """The request's scheduling priority (lower first), the class offset from
        ``--default-slo-class``: the request's own ``priority`` (vLLM's field; refused under
        fcfs, as vLLM does), else its adapter manifest's ``slo_class``, else its tenant's
        class (``--tenant-slo-classes``), else the manifest's ``priority`` (higher is more
        important there, as in the residency policy), else 0. A manifest class this server
        does not define counts as unset."""
        if params.priority != 0:
            if self.config.scheduling_policy == "fcfs":
                raise InvalidRequestError(
                    f"priority {params.priority} needs --scheduling-policy priority or fair "
                    "(this server schedules first come, first served); use 0",
                    param="priority",
                )
            return params.priority
        if spec is None:
            return 0
        default = self._class_index[self.config.default_slo_class]
        for name in (spec.slo_class, self._tenant_classes.get(spec.tenant or "")):
            if name is not None and name in self._class_index:
                return self._class_index[name] - default
        return -spec.priority

    def _adapter_spec(self, lora_request: AdapterSpec | LoRARequest | None) -> AdapterSpec | None:
        """The spec of an offline LoRARequest (the local catalog hashes its files), or the spec."""
        if lora_request is None or isinstance(lora_request, AdapterSpec):
            return lora_request
        assert self.adapter_catalog is not None
        return self.adapter_catalog.spec(lora_request)

    def add_prepared(self, prepared: PreparedRequest) -> None:
        """Queue a prepared request (loop thread only). Cheap; raises only for a reused id,
        in which case the prepared request is discarded."""
        req = prepared.request
        if prepared.consumed:
            raise RuntimeError(f"prepared request {req.request_id!r} was already consumed")
        if req.request_id in self.requests:
            self.discard_prepared(prepared)
            raise InvalidRequestError(f"request id {req.request_id!r} is already in use")
        prepared.consumed = True
        for seq in req.seqs:
            self.scheduler.add(seq)
        self.requests[req.request_id] = req

    def discard_prepared(self, prepared: PreparedRequest) -> None:
        """Give back the adapter references of a prepared request that will never run."""
        if prepared.consumed:
            return
        prepared.consumed = True
        for seq in prepared.request.seqs:
            if seq.adapter is not None and self.adapters is not None:
                self.adapters.release(seq.adapter)

    def check_prompt(self, ids: list[int]) -> None:
        """Raise InvalidRequestError for an empty, out-of-vocabulary or too-long prompt."""
        if not ids:
            raise InvalidRequestError("prompt is empty")
        vocab = self.model_config.vocab_size
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
        """One iteration: schedule → stage the batch's adapters (sequences whose adapter is still
        being copied into its slot wait; the copy runs on a background thread) → merge or
        unmerge a lone adapter (``lora_merge_after_steps``) → run the model → sample and update.
        Returns the requests that progressed."""
        batch = self.scheduler.schedule()
        if self.adapters is not None and not batch.empty:
            self._stage_adapters(batch)
        if batch.empty:
            self.last_step = StepStats()  # nothing ran: observers must not see the last step again
            return []
        if self.merger is not None:
            self.runner.merged_slot = self._merge_for(batch)
        logits, samplers = self.runner.run(batch)
        # sample before advancing: if sampling raises, the step is simply redone next time
        tokens = self.sampler(logits, samplers) if samplers else []
        self.scheduler.after_step(batch)
        self.num_steps += 1
        self.last_step = StepStats(
            num_seqs=len(batch.items),
            num_tokens=sum(n for _, n in batch.items),
            distinct_adapters=len({s.adapter.ref.sha256 for s, _ in batch.items if s.adapter}),
        )
        touched: dict[str, None] = {}
        now = time.monotonic()
        for seq, tok in zip(samplers, tokens, strict=True):
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.output_token_ids.append(tok)
            self._check_stop(seq, tok)
            touched[seq.request_id] = None
        return [self._output(rid) for rid in touched if self._reports(rid)]

    def _stage_adapters(self, batch: ScheduledBatch) -> None:
        """Newly reserved slots get their weights on a background thread: the sequences whose
        adapter is still loading sit this step out (they keep their slot and KV blocks and run
        once its rows are complete); the rest run now. With nothing left to run, wait for a load
        rather than spin."""
        assert self.adapters is not None
        loading = self.adapters.stage(batch)
        if not loading:
            return
        batch.items = [(s, n) for s, n in batch.items if s.slot not in loading]
        if not batch.items:
            self.adapters.wait_staging(_STAGING_WAIT_S)

    def _merge_for(self, batch: ScheduledBatch) -> int | None:
        """The slot whose adapter runs merged into the base weights this step (every sequence
        uses it), else None: the merger unmerges first when a second adapter or a base
        sequence is in the step (a reference swap, never a wait)."""
        assert self.merger is not None
        digests = {s.adapter.ref.sha256 if s.adapter else None for s, _ in batch.items}
        seq = batch.items[0][0]
        if len(digests) == 1 and seq.adapter is not None:
            if self.merger.before_step(seq.adapter.ref.sha256, seq.adapter.weights):
                return seq.slot
            return None
        self.merger.before_step(None, None)
        return None

    def _reports(self, request_id: str) -> bool:
        """Whether the request has an output to report now: a best_of request (which picks
        its n completions when all are done) only once finished."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        p = req.seqs[0].params
        return p.num_seqs == p.n or all(s.is_finished for s in req.seqs)

    def _check_stop(self, seq: Sequence, tok: int) -> None:
        p = seq.params
        n_out = len(seq.output_token_ids)
        reason: str | None = None
        if tok in (p.stop_token_ids or ()) and n_out >= p.min_tokens:
            reason, seq.stop_reason = FinishReason.STOP.value, tok
        elif not p.ignore_eos and tok in self.eos_token_ids and n_out >= p.min_tokens:
            reason = FinishReason.STOP.value
        if seq.grammar is not None and reason is None:
            if not seq.grammar.accept(tok):  # the mask allows only accepted tokens
                log.warning("request %s: token %d rejected by its grammar", seq.request_id, tok)
                reason = FinishReason.STOP.value
            elif seq.grammar.terminated:  # complete, and its stop token came
                reason = FinishReason.STOP.value
        if reason is None and n_out >= seq.max_tokens:
            reason = FinishReason.LENGTH.value
        if seq.detokenizer is not None:
            before = len(seq.text)  # text of the first n_out - 1 tokens
            seq.detokenizer.add([tok])
            if reason is not None:
                seq.detokenizer.flush()
            seq.text = seq.detokenizer.text
            if p.stop and n_out == p.min_tokens:  # stop strings must end after this offset
                seq.stop_search_from = before
            if p.stop and n_out >= p.min_tokens and (reason is None or reason == "length"):
                for s in p.stop:  # type: ignore[union-attr]
                    at = seq.text.find(s, max(0, max(before, seq.stop_search_from) - len(s) + 1))
                    if at >= 0:
                        seq.text = seq.text[: at + (len(s) if p.include_stop_str_in_output else 0)]
                        reason, seq.stop_reason = FinishReason.STOP.value, s
                        break
        seq.token_text_ends.append(len(seq.text))
        if reason is not None:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        if seq.adapter is not None and self.adapters is not None:
            self.adapters.release(seq.adapter)

    def _output(self, request_id: str) -> RequestOutput:
        req = self.requests[request_id]
        finished = all(s.is_finished for s in req.seqs)
        seqs = req.seqs
        p = seqs[0].params
        if p.num_seqs > p.n:  # best_of: the n with the highest cumulative logprob, as vLLM
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: p.n]
        outs = []
        for i, s in enumerate(seqs):
            text = s.text
            if s.params.stop and not s.is_finished:  # hold back what may start a stop string
                hold = max(len(x) for x in s.params.stop) - 1  # type: ignore[union-attr]
                text = text[: max(0, len(text) - hold)]
            outs.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=list(s.output_token_ids),
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                    logprobs=list(s.logprobs) if s.logprobs is not None else None,
                    cumulative_logprob=s.cumulative_logprob if s.tracks_logprobs else None,
                    token_text_ends=[min(e, len(text)) for e in s.token_text_ends],
                )
            )
        if finished:
            del self.requests[request_id]
        return RequestOutput(
            request_id=request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=outs,
            finished=finished,
            adapter=req.adapter_ref,
            num_cached_tokens=req.seqs[0].num_cached_tokens,
            prompt_logprobs=_snapshot(req.seqs[0].prompt_logprobs),
        )

    # -- introspection ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def is_idle(self) -> bool:
        """No request queued or running, every KV block free, every slot without users."""
        return (
            not self.scheduler.has_unfinished()
            and self.pool.num_free == self.pool.num_blocks
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
        return {s.adapter.ref.sha256 for s in self.scheduler.waiting_sequences() if s.adapter}

    def running_sequences(self) -> list[Sequence]:
        return [s for s in self.scheduler.running if s.status is SequenceStatus.RUNNING]
