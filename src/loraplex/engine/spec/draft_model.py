"""Drafting with a small model that shares the target's tokenizer (vLLM's ``draft_model``), with
draft-model LoRAs for the adapters named in ``draft_lora_modules``.

The draft is built with loraplex's own machinery (:func:`~loraplex.engine.builder.build_parts` on
the target's config with ``model`` swapped: same device and dtype, no tensor parallelism, no
prefix caching, its own paged KV cache) and driven through its own
:class:`~loraplex.engine.runner.ModelRunner` with batches this module builds; the target's
scheduler never sees it.

Per target sequence the proposer keeps a *shadow*: a draft-pool
:class:`~loraplex.engine.sequence.Sequence` whose tokens are the target's tokens followed by the
last drafts, ``num_computed_tokens`` of them in the draft's KV. One :meth:`propose`::

    for each sequence: sync the shadow with seq.all_token_ids:
        d = first position where they differ (the target's tokens only ever grow, so the search
            starts at the tokens the shadow took from the target last time)
        computed = min(computed, d, len(real) - 1)   # rejected drafts are recomputed;
        tokens = real                                # accepted ones keep their KV
        blocks for len(real) + k - 1 positions       # else NO_DRAFT, shadow freed
    one forward: every shadow's catch-up chunk [computed, len(real)), at most
        max_num_batched_tokens tokens in all (shortest first; a sequence whose chunk does not
        finish drafts at a later step) -> the first draft token of every caught-up sequence
    k - 1 forwards: one decode row per sequence still drafting -> the next draft token

Each draft token is the argmax (greedy requests: ``Draft.probs`` None) or a draw from the draft
distribution under the request's temperature, min_p, top_k and top_p (the target sampler's
order), with the proposer's own generator; ``Draft.probs`` row ``j`` is that distribution, the
``q`` of rejection sampling. Penalties, logit bias and grammars are the target's business: the
verifier keeps the target's distribution whatever the draft proposes.

Adapters: a sequence whose (plain, not composed) adapter's name is a key of
``draft_lora_modules`` drafts with that draft LoRA, loaded and verified once at build and kept in
a device slot of the draft for the proposer's life; every other sequence drafts with the plain
draft model. A shadow's KV is its own (no prefix caching), so no tenant's context reaches
another's drafts.

Memory: the draft's KV cache holds :func:`draft_kv_blocks` blocks (what the target's sequences
can hold, bounded by :data:`DRAFT_KV_SHARE` of the target's KV bytes); a sequence that finds no
room gets no draft (idle shadows, of sequences not in the call, are freed first).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from loraplex.config import EngineConfig
from loraplex.config.speculative import SpeculativeConfig
from loraplex.engine.builder import EngineParts, build_parts, load_tokenizer
from loraplex.engine.runner import ModelRunner
from loraplex.engine.sampler import draw, sampling_probs
from loraplex.engine.scheduler import ScheduledBatch
from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.engine.spec.draft_budget import DRAFT_KV_SHARE
from loraplex.engine.spec.proposer import NO_DRAFT, Draft, Proposer
from loraplex.kv.cache import PagedKVCache
from loraplex.kv.groups import NULL_BLOCK
from loraplex.kv.manager import KVCacheManager
from loraplex.lora.adapter import LoRAAdapter
from loraplex.model.config import ModelConfig, load_model_config
from loraplex.requests import LoRARequest, SamplingParams
from loraplex.types import AdapterError, LoraplexError

log = logging.getLogger(__name__)

__all__ = ["DRAFT_KV_SHARE", "DraftModelProposer", "draft_kv_blocks"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_SHADOW_PARAMS = SamplingParams(max_tokens=1)  # shadows never sample through the engine


def draft_kv_blocks(
    draft: ModelConfig,
    dtype: torch.dtype,
    block_size: int,
    max_num_seqs: int,
    max_len: int,
    target_blocks: int,
    target_kv_bytes: int,
    k: int,
) -> int:
    """Blocks of the draft's KV cache::

        per_seq = ceil(max_len / block_size)                        # one full-length sequence
        want    = min(max_num_seqs * per_seq,                       # every sequence at full length
                      target_blocks + max_num_seqs * ceil(k / block_size))  # what the target holds, + drafts
        cap     = max(per_seq, DRAFT_KV_SHARE * target_kv_bytes // bytes per draft block)
        blocks  = max(per_seq, min(want, cap))

    A draft block's bytes are bounded above by every layer at the widest layer's width."""
    per_seq = -(-max_len // block_size)
    width = max(kvh * hd for kvh, hd in draft.kv_layer_shapes())
    per_block = PagedKVCache.bytes_per_block(draft.num_layers, block_size, 1, width, dtype)
    want = min(max_num_seqs * per_seq, target_blocks + max_num_seqs * -(-k // block_size))
    cap = max(per_seq, int(DRAFT_KV_SHARE * target_kv_bytes) // per_block)
    return max(per_seq, min(want, cap))


def _vocab_of(path: Path, tokenizer: Any | None, trust_remote_code: bool) -> dict[str, int] | None:
    """The token -> id map of ``tokenizer``, else of the tokenizer saved in ``path``; None when
    ``path`` holds none."""
    if tokenizer is None:
        if not any((path / f).is_file() for f in _TOKENIZER_FILES):
            return None
        tokenizer = load_tokenizer(path, trust_remote_code)
    return dict(tokenizer.get_vocab())


def check_same_tokenizer(
    name: str, draft: ModelConfig, config: EngineConfig, target: EngineParts
) -> None:
    """Raise ValueError naming the draft model ``name`` unless it shares the target's
    tokenizer: equal vocabulary sizes in the two model configs, and equal vocabularies where
    both sides have a tokenizer (the draft's directory, the target's loaded one or files)."""
    tv = target.model_config.vocab_size
    if draft.vocab_size != tv:
        raise ValueError(
            f"draft model {name!r} has a vocabulary of {draft.vocab_size} tokens, the target "
            f"{tv}: a draft model must share the target's tokenizer"
        )
    draft_vocab = _vocab_of(Path(name), None, config.trust_remote_code)
    if draft_vocab is None:
        log.info("draft model %s has no tokenizer files: only its vocabulary size is checked", name)
        return
    tok_dir = Path(config.tokenizer or config.model)
    target_vocab = _vocab_of(tok_dir, target.tokenizer, config.trust_remote_code)
    if target_vocab is not None and draft_vocab != target_vocab:
        diff = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()))
        raise ValueError(
            f"draft model {name!r} does not share the target's tokenizer: their vocabularies "
            f"differ ({len(diff)} (token, id) pairs, e.g. {diff[0]!r})"
        )


def draft_engine_config(
    config: EngineConfig,
    spec: SpeculativeConfig,
    target: EngineParts,
    num_blocks: int,
    max_len: int,
) -> EngineConfig:
    """The draft's engine config: the target's with ``model=spec.model``, the target's resolved
    device and dtype, one process, ``num_blocks`` KV blocks without prefix caching, no
    tokenizer (the target's serves), and LoRA only for ``draft_lora_modules`` (one slot each,
    never merged, local directories)."""
    loras = len(spec.draft_lora_modules)
    dtype = str(target.dtype).removeprefix("torch.")
    return replace(
        config,
        model=str(spec.model),
        tokenizer=None,
        revision=None,
        tokenizer_revision=None,
        skip_tokenizer_init=True,
        generation_config="vllm",
        override_generation_config=None,
        device=str(target.device),
        dtype=dtype,
        quantization=None,
        quantization_group_size=None,
        tensor_parallel_size=1,
        nnodes=1,
        node_rank=0,
        fully_sharded_loras=False,
        enable_lora=loras > 0,
        max_loras=max(1, loras),
        max_cpu_loras=max(1, loras),
        max_cpu_lora_bytes=None,
        max_lora_device_fraction=None,
        lora_rank_slot_budgets=None,
        lora_merge_after_steps=0,
        disk_cache_dir=None,
        disk_cache_bytes=None,
        adapter_store_url=None,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=None,
        num_kv_blocks=num_blocks,
        kv_cache_layer_groups=1,
        max_model_len=max_len,
        speculative_config=None,
    )


@dataclass
class _SlotBatch:
    """The :class:`~loraplex.cache.adapters.SlotBatch` of the draft LoRAs activated at build."""

    slots: dict[int, LoRAAdapter]
    slot_rows: dict[int, tuple[int, int]] = field(default_factory=dict)

    def slot_adapters(self) -> Mapping[int, LoRAAdapter]:
        return self.slots


@dataclass(eq=False)
class _Shadow:
    """One target sequence's twin in the draft's KV: ``seq.prompt_token_ids`` are the target's
    first ``real`` tokens followed by the last drafts; ``seq.num_computed_tokens`` of them are
    in the draft's KV."""

    seq: Sequence
    real: int = 0


class DraftModelProposer(Proposer):
    """Drafts from a small model of the target's tokenizer (see the module docstring)."""

    method = "draft_model"

    def __init__(
        self,
        name: str,
        parts: EngineParts,
        draft_loras: Mapping[str, tuple[LoRAAdapter, int]],
        token_budget: int,
        seed: int,
    ) -> None:
        self.name = name
        self.parts: EngineParts | None = parts
        self.runner: ModelRunner | None = ModelRunner(parts.model, parts.cache)
        self.kv = KVCacheManager(parts.pool, parts.cache.groups, parts.state_pool)
        self.block_size = parts.pool.block_size
        self.max_len = parts.max_model_len
        self.draft_loras = dict(draft_loras)
        """request adapter name -> (the draft LoRA, its draft slot), for the proposer's life."""
        self.token_budget = token_budget
        self.generator = torch.Generator().manual_seed(seed)
        self.shadows: dict[Sequence, _Shadow] = {}

    # -- building --------------------------------------------------------------------------------
    @classmethod
    def build(
        cls, config: EngineConfig, spec: SpeculativeConfig, target: EngineParts
    ) -> DraftModelProposer:
        """Load the draft model ``spec.model`` beside ``target`` (built from ``config``), its
        KV cache and its draft LoRAs. Raises ValueError naming the draft model when it is not a
        decoder loraplex runs, does not share the target's tokenizer, or a draft LoRA does not
        load or fit it (AdapterError, a ValueError; ranks are bounded by ``max_lora_rank``)."""
        name = str(spec.model)
        try:
            mc = load_model_config(name, "vllm")
        except LoraplexError as e:
            raise ValueError(f"draft model {name!r}: {e}") from e
        check_same_tokenizer(name, mc, config, target)
        max_len = min(target.max_model_len, mc.max_position_embeddings)
        k = spec.num_speculative_tokens
        blocks = draft_kv_blocks(
            mc, target.dtype, config.block_size, config.max_num_seqs, max_len,
            target.pool.num_blocks, target.cache.nbytes, k,
        )  # fmt: skip
        dcfg = draft_engine_config(config, spec, target, blocks, max_len)
        try:
            parts = build_parts(dcfg)
        except LoraplexError as e:
            raise ValueError(f"draft model {name!r}: {e}") from e
        if parts.state_pool is not None or any(g.state for g in parts.cache.groups):
            raise ValueError(
                f"draft model {name!r} has recurrent (linear-attention) layers: their state "
                "cannot be rolled back after rejected drafts; use an attention-only draft"
            )
        loras = cls._load_draft_loras(name, spec, parts)
        log.info(
            "draft model %s: %d KV blocks (%.1f MiB), %d draft LoRA(s)",
            name, blocks, parts.cache.nbytes / 2**20, len(loras),
        )  # fmt: skip
        return cls(name, parts, loras, dcfg.max_num_batched_tokens, config.seed)

    @staticmethod
    def _load_draft_loras(
        name: str, spec: SpeculativeConfig, parts: EngineParts
    ) -> dict[str, tuple[LoRAAdapter, int]]:
        """Load, verify and activate every draft LoRA, each in its own slot, held (a request
        reference, the slot reserved, a device pin) until :meth:`close`. All or nothing."""
        got: dict[str, tuple[LoRAAdapter, int]] = {}
        if not spec.draft_lora_modules:
            return got
        lora = parts.lora
        assert lora is not None
        cache = lora.adapters
        try:
            for req_name, path in spec.draft_lora_modules:
                what = f"draft model {name!r}: the draft LoRA for {req_name!r}"
                try:
                    aspec = lora.catalog.spec(LoRARequest(f"draft:{req_name}", path))
                    adapter, _ = cache.acquire(aspec, count=False)  # read, verified, checked
                except AdapterError as e:  # the rank bound is the target's --max-lora-rank
                    raise AdapterError(f"{what}: {e}") from e
                slot = cache.reserve_slot(adapter)
                if slot is None:  # one slot per draft LoRA: only a repeated digest shares
                    cache.release(adapter)
                    raise AdapterError(f"{what}: no free draft slot")
                got[req_name] = (adapter, slot)
                cache.pin(adapter.ref.sha256, device=True)
            cache.activate(_SlotBatch({slot: a for a, slot in got.values()}))
        except BaseException:
            _release_loras(parts, got)
            raise
        return got

    # -- drafting --------------------------------------------------------------------------------
    def propose(self, seqs: Seq[Sequence], limits: Seq[int]) -> list[Draft]:
        out = [NO_DRAFT] * len(seqs)
        if self.runner is None:  # closed
            return out
        here = set(seqs)
        todo: list[tuple[int, _Shadow, int]] = []  # (index in seqs, shadow, tokens to draft)
        for i, (seq, limit) in enumerate(zip(seqs, limits, strict=True)):
            if limit > 0:
                got = self._sync(seq, limit, here)
                if got is not None:
                    todo.append((i, *got))
        if not todo:
            return out
        owners = {sh.seq: seqs[i] for i, sh, _ in todo}  # shadow -> its target sequence
        drafts = {sh.seq: _Drafting(k) for _, sh, k in todo}
        rows = self._catch_up([sh for _, sh, _ in todo])
        while rows:
            self._pick(rows, drafts, owners)
            going = [(s, 1) for s, _ in rows if len(drafts[s].tokens) < drafts[s].k]
            rows = self._forward(going) if going else []
        for i, sh, _ in todo:
            d = drafts[sh.seq]
            if d.tokens:
                probs = None if d.probs is None else torch.stack(d.probs)  # [k, V]
                out[i] = Draft(d.tokens, probs)
        return out

    def _sync(self, seq: Sequence, limit: int, here: set[Sequence]) -> tuple[_Shadow, int] | None:
        """Bring ``seq``'s shadow in line with its tokens (rolled back to the first position
        where they differ) and give it blocks for ``limit`` drafts (fewer where the draft's
        length or KV run out); ``(shadow, k)``, or None (the shadow freed) when no draft fits."""
        real = seq.all_token_ids  # a fresh list: the shadow may keep it
        n = len(real)
        k = min(limit, self.max_len - n + 1)  # positions up to n + k - 2 get KV
        sh = self.shadows.get(seq)
        if k <= 0 or n == 0:
            if sh is not None:
                self.finish(seq)
            return None
        if sh is None:
            sh = _Shadow(self._new_shadow(seq))
            self.shadows[seq] = sh
        held = sh.seq.prompt_token_ids
        start = sh.real  # the target's tokens only grow: the ones taken last time still hold
        if start > n or (start and held[start - 1] != real[start - 1]):
            start = 0
        end = min(len(held), n)
        d = start
        while d < end and held[d] == real[d]:
            d += 1
        sh.seq.prompt_token_ids, sh.real = real, n
        sh.seq.num_computed_tokens = min(sh.seq.num_computed_tokens, d, n - 1)
        while k > 0 and not self._blocks_for(sh, n + k - 1, here):
            k -= 1
        if k == 0:
            self.finish(seq)
            return None
        return sh, k

    def _new_shadow(self, seq: Sequence) -> Sequence:
        """A draft-pool sequence for ``seq``, in the draft LoRA's slot where its adapter has
        one."""
        shadow = Sequence(f"draft:{seq.request_id}", None, [], _SHADOW_PARAMS, 1)
        shadow.status = SequenceStatus.RUNNING
        a = seq.adapter
        if a is not None and not seq.is_composed and seq.lora_start is not None:
            got = self.draft_loras.get(a.ref.name)
            if got is not None:
                shadow.slot, shadow.lora_start = got[1], 0
        return shadow

    def _blocks_for(self, sh: _Shadow, positions: int, here: set[Sequence]) -> bool:
        """Size ``sh``'s block tables to ``positions`` (blocks past them given back); False
        when the draft's KV cannot hold them even once idle shadows (of sequences not in
        ``here``) are freed."""
        tables = sh.seq.block_tables
        keep = -(-positions // self.block_size)
        for g, table in enumerate(tables):
            extra = [b for b in table[keep:] if b != NULL_BLOCK]
            if extra:
                self.kv.pools[g].release(extra)
                del table[keep:]
        if not self.kv.blocks_needed(tables, positions):
            return True
        while not self.kv.fits(tables, positions):
            idle = next((s for s in self.shadows if s not in here), None)
            if idle is None:
                return False
            self.finish(idle)
        sh.seq.block_tables = self.kv.allocate(tables, positions)
        return True

    def _catch_up(self, shadows: list[_Shadow]) -> list[tuple[Sequence, torch.Tensor]]:
        """One forward over every shadow's missing tokens (at most ``token_budget`` in all, the
        shortest first); the (shadow, logits [V]) of those it completed."""
        items: list[tuple[Sequence, int]] = []
        budget = self.token_budget
        for sh in sorted(shadows, key=lambda s: s.seq.num_tokens - s.seq.num_computed_tokens):
            take = min(sh.seq.num_tokens - sh.seq.num_computed_tokens, budget)
            if take <= 0:
                break
            items.append((sh.seq, take))
            budget -= take
        return self._forward(items)

    def _forward(self, items: list[tuple[Sequence, int]]) -> list[tuple[Sequence, torch.Tensor]]:
        """Run the draft once over ``items`` (shadow, new tokens) and advance their computed
        counts; (shadow, logits [V] float32) of the shadows whose tokens are all computed now."""
        assert self.runner is not None
        slots = {s.slot for s, _ in items if s.slot is not None}
        rows = {}
        if slots:
            assert self.parts is not None and self.parts.lora is not None
            bank = self.parts.lora.adapters.bank
            rows = {slot: bank.slot_rows(slot) for slot in slots}
        logits, samplers = self.runner.run(ScheduledBatch(items=items, slot_rows=rows))
        for s, n in items:
            s.num_computed_tokens += n
        return list(zip(samplers, logits, strict=True))

    def _pick(
        self,
        rows: list[tuple[Sequence, torch.Tensor]],
        drafts: Mapping[Sequence, _Drafting],
        owners: Mapping[Sequence, Sequence],
    ) -> None:
        """One draft token per ``(shadow, logits [V])``: appended to the shadow's tokens and to
        its draft (with the distribution it was drawn from, for a sampling request)."""
        logits = torch.stack([r for _, r in rows])  # [S, V]
        sampling = [not owners[s].params.greedy for s, _ in rows]
        greedy = logits.argmax(dim=-1).tolist()  # on the device: one [S] copy back
        cpu = logits.float().cpu() if any(sampling) else None  # [S, V]
        for j, (shadow, _) in enumerate(rows):
            d, token = drafts[shadow], greedy[j]
            if sampling[j]:
                assert cpu is not None
                token, probs = self._sample(cpu[j], owners[shadow].params)
                d.add_probs(probs)
            d.tokens.append(token)
            shadow.prompt_token_ids.append(token)

    def _sample(self, row: torch.Tensor, p: SamplingParams) -> tuple[int, torch.Tensor]:
        """A draw from ``row`` [V] under ``p``'s temperature, min_p, top_k and top_p (the
        sampler's order), and the distribution [V] float32 it was drawn from (one-hot on the
        argmax where the temperature overflows the row, as the sampler falls back to it)."""
        probs = sampling_probs(row, p)  # [V]
        if probs is None:
            token = int(row.nan_to_num(neginf=float("-inf")).argmax())
            probs = torch.zeros_like(row)
            probs[token] = 1.0
            return token, probs
        return draw(probs, self.generator), probs

    # -- hooks -----------------------------------------------------------------------------------
    def finish(self, seq: Sequence) -> None:
        sh = self.shadows.pop(seq, None)
        if sh is not None:
            self.kv.free(sh.seq.block_tables)
            sh.seq.block_tables = []

    def memory_bytes(self) -> int:
        """The draft's KV cache bytes (allocated at build, whatever the shadows use)."""
        return 0 if self.parts is None else self.parts.cache.nbytes

    def close(self) -> None:
        """Free every shadow, give back the draft LoRAs' slots, pins and references, and drop
        the draft model and its cache (idempotent; :meth:`propose` then drafts nothing)."""
        for seq in list(self.shadows):
            self.finish(seq)
        if self.parts is not None:
            _release_loras(self.parts, self.draft_loras)
        self.draft_loras = {}
        self.runner = None
        self.parts = None


@dataclass
class _Drafting:
    """One sequence's draft being built: up to ``k`` tokens, and for a sampling request the
    distribution [V] each was drawn from."""

    k: int
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] | None = None

    def add_probs(self, row: torch.Tensor) -> None:
        if self.probs is None:
            self.probs = []
        self.probs.append(row.float())


def _release_loras(parts: EngineParts, loras: Mapping[str, tuple[LoRAAdapter, int]]) -> None:
    """Give back what :meth:`DraftModelProposer._load_draft_loras` holds of ``loras``."""
    if parts.lora is None:
        return
    cache = parts.lora.adapters
    for adapter, slot in loras.values():
        cache.release_slot(slot)
        cache.unpin(adapter.ref.sha256)
        cache.release(adapter)
