"""Building an engine's parts from its config, once, at start-up: the device and dtype, the model
and its tokenizer, the LoRA wiring (slot bank, backend, tiered adapter cache, merger) and the
memory budget that sizes the slot bank, the KV cache and ``max_model_len``.

:func:`build_parts` does it all and returns :class:`EngineParts`; nothing here runs per step.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil
import torch

from loraplex.cache.adapters import TieredAdapterCache
from loraplex.checkpoint.modules import LM_HEAD, VOCAB_LAYER, BaseModelSpec
from loraplex.config import DTYPES, EngineConfig
from loraplex.engine.adapter_catalog import LocalAdapterCatalog
from loraplex.engine.merge import AdapterMerger
from loraplex.engine.spec.draft_budget import draft_weight_bytes, target_kv_budget
from loraplex.engine.tensor_parallel.driver import DriverModel, TPWorkers
from loraplex.engine.tensor_parallel.group import (
    Group,
    WorkerLayout,
    model_shard,
    on_every_rank,
    rank_threads,
)
from loraplex.kv.block_pool import BlockPool
from loraplex.kv.cache import PagedKVCache, StateShape
from loraplex.kv.groups import (
    KVCacheGroup,
    blocks_per_sequence,
    kv_cache_groups,
    layers_per_group,
    layers_per_state_group,
    max_tokens,
)
from loraplex.lora.backends import select_lora_ops
from loraplex.lora.ops import LoRAOps
from loraplex.lora.slots import LoRASlotBank
from loraplex.lora.tensor_parallel import MirroredSlotBank
from loraplex.model.config import ModelConfig, load_model_config
from loraplex.model.decoder import DecoderForCausalLM
from loraplex.model.linear import cpu_has_fast_bf16
from loraplex.model.loading import load_model
from loraplex.model.lora_binding import LoRABinding
from loraplex.model.quant.formats import parse_quantization
from loraplex.model.registry import model_class
from loraplex.model.tensor_parallel.lora_binding import FullyShardedLoRABinding
from loraplex.types import ModelLoadError

log = logging.getLogger(__name__)

_DTYPES = {name: getattr(torch, name) for name in DTYPES if name != "auto"}
_CPU_DEFAULT_KV_BYTES = 2 << 30


def release_freed_memory() -> None:
    """Return the C heap's free pages to the OS (glibc ``malloc_trim``): after a load that
    read float tensors and kept only their quantized forms, glibc keeps the freed small
    allocations mapped, and the resident set would count bytes the model no longer holds.
    A no-op where the C library has no ``malloc_trim``."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = getattr(libc, "malloc_trim", None)
    except OSError:
        return
    if trim is not None:
        trim(0)


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


def load_tokenizer(model_dir: Path, trust_remote_code: bool = False) -> Any:
    if not any(
        (model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")
    ):
        raise ModelLoadError(
            f"{model_dir}: no tokenizer files (tokenizer.json / tokenizer.model / vocab.json); "
            "pass skip_tokenizer_init=True and give prompts as token ids"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises many types here
        raise ModelLoadError(f"{model_dir}: cannot load tokenizer ({e})") from e


def model_kv_groups(model: DecoderForCausalLM, config: EngineConfig) -> tuple[KVCacheGroup, ...]:
    """The KV-cache groups of ``model``'s layers: by their windows, cut into
    ``--kv-cache-layer-groups`` groups of consecutive layers."""
    return tuple(
        kv_cache_groups(model.layer_windows(), config.kv_cache_layer_groups, model.state_layers())
    )


@dataclass(frozen=True)
class MemoryBudget:
    """What the KV cache and the adapter slots may use, and the lengths that follow from it."""

    config: EngineConfig
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    kv_groups: tuple[KVCacheGroup, ...] = ()
    """The model's KV-cache groups (empty: one group of every layer)."""
    state: StateShape | None = None
    """One recurrent layer's state, when the model has state groups (linear attention)."""

    @property
    def groups(self) -> tuple[KVCacheGroup, ...]:
        return self.kv_groups or (KVCacheGroup(tuple(range(self.model_config.num_layers))),)

    def after_weights(self) -> int:
        """Bytes this engine may give the KV cache and adapter slots together: by
        ``--kv-cache-memory`` if set, on CUDA what ``--gpu-memory-utilization`` leaves after
        what the device holds now (and after a draft model's weights and KV share:
        ``engine/spec/draft_budget.py``), on CPU a quarter of the available memory (at most
        2 GiB)."""
        c = self.config
        if c.kv_cache_memory_bytes is not None:
            return c.kv_cache_memory_bytes
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = c.device_kv_budget(free, total)  # --gpu-memory-utilization
            spec = c.speculative()
            if spec is not None and spec.method == "draft_model":  # loaded after us, same budget
                budget = target_kv_budget(budget, draft_weight_bytes(str(spec.model), self.dtype))
            return budget
        return min(_CPU_DEFAULT_KV_BYTES, psutil.virtual_memory().available // 4)

    def lora_slots(
        self,
        shapes: dict[tuple[int, str], tuple[int, int]],
        dtype: torch.dtype,
        experts: Mapping[tuple[int, str], int] | None = None,
    ) -> int:
        """The slot bank's slots: ``--max-loras``, capped so the bank's bytes stay within
        ``--max-lora-device-fraction`` of the memory left after the weights. One slot holds
        ``max_lora_rank`` rows of A ``[r, d_in]`` and of B^T ``[r, d_out]`` for every module
        (``embed_tokens`` and ``lm_head`` included: ``2 * (vocab + hidden)`` per rank row; an
        expert module's once per expert, ``experts``)."""
        c = self.config
        if c.max_lora_device_fraction is None:
            return c.max_loras
        n = experts or {}
        row_bytes = sum((i + o) * n.get(k, 1) for k, (i, o) in shapes.items()) * dtype.itemsize
        return c.lora_slot_count(c.max_lora_rank * row_bytes, self.after_weights())

    def state_page_bytes(self) -> int:
        """Bytes of one state page: a state group's layers' states (0 without state groups)."""
        if self.state is None:
            return 0
        return layers_per_state_group(self.groups) * self.state.nbytes(self.dtype)

    def state_pages(self) -> int:
        """Pages of the state pool (0 without state groups): two per state group for every
        sequence that may run (the page read and the page written at a block end) and as many
        again for the snapshots prefix hits resume from, at most half the memory left after
        the weights, at least two sequences' worth."""
        n = sum(g.state for g in self.groups)
        if not n:
            return 0
        want = 2 * n * (2 * self.config.max_num_seqs + 1)
        cap = self.after_weights() // 2 // self.state_page_bytes()
        return max(4 * n, min(want, cap))

    def state_bytes(self) -> int:
        """Bytes of the state pool (0 without state groups)."""
        return self.state_pages() * self.state_page_bytes()

    def kv_blocks(self, bank_bytes: int) -> int:
        """KV blocks: ``--num-kv-blocks``, else what the budget holds (less ``bank_bytes``, the
        slot bank's, when its capped share comes out of the same CPU memory), never more than
        ``max_num_seqs`` full-length sequences can use. A block is one page of a KV-cache
        group's layers (windowed groups hold only their window's blocks)."""
        c, mc = self.config, self.model_config
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        width = max(kvh * hd for kvh, hd in mc.kv_layer_shapes())  # a page row's (the widest)
        per_block = PagedKVCache.bytes_per_block(
            layers_per_group(self.groups), c.block_size, 1, width, self.dtype
        )
        budget = c.kv_cache_memory_bytes
        if budget is None:
            budget = self.after_weights()  # on CUDA the slot bank is out of it already
            if c.max_lora_device_fraction is not None and self.device.type != "cuda":
                budget = max(budget - bank_bytes, 0)
            budget = max(budget - self.state_bytes(), 0)
            longest = c.max_model_len or mc.max_position_embeddings
            per_seq = blocks_per_sequence(
                self.groups, longest, c.block_size, min(longest, c.max_num_batched_tokens)
            )
            budget = min(budget, c.max_num_seqs * per_seq * per_block)
        else:
            budget -= self.state_bytes()  # the recurrent layers' states come out of it first
        blocks = budget // per_block - (len(self.groups) > 1)  # the cache's trash page
        if blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} is smaller than one KV block ({per_block} bytes)"
            )
        return int(blocks)

    def max_model_len(self, num_blocks: int) -> int:
        mc = self.model_config
        limit = mc.max_position_embeddings  # sliding windows are masked: they cap nothing
        c = self.config
        capacity = max_tokens(
            self.groups, num_blocks, c.block_size, c.max_num_batched_tokens, limit
        )
        want = self.config.max_model_len
        if want is None:
            return min(limit, capacity)
        if want > limit:
            raise ValueError(
                f"max_model_len={want} exceeds the model's limit {limit} "
                f"(max_position_embeddings in config.json)"
            )
        if want > capacity:
            raise ValueError(
                f"max_model_len={want} needs more KV cache than configured (one sequence of "
                f"{capacity} tokens fits); "
                "raise kv_cache_memory_bytes or lower max_model_len"
            )
        return want


@dataclass(frozen=True)
class LoRAParts:
    """The adapter side of an engine with ``enable_lora``."""

    adapters: TieredAdapterCache
    catalog: LocalAdapterCatalog  # offline LoRARequest -> AdapterSpec
    merger: AdapterMerger | None  # one adapter merged into the base (lora_merge_after_steps)


def slot_bank(
    config: EngineConfig,
    model: DecoderForCausalLM,
    budget: MemoryBudget,
    slots: int | None = None,
    bank_class: type[LoRASlotBank] = LoRASlotBank,
) -> LoRASlotBank:
    """Bind a slot bank (on the backend chosen once, here) to ``model``: ``slots`` of them, or
    as many as ``--max-loras`` and the memory budget allow. Its tables have the shapes of
    ``model.cfg`` (a tensor-parallel rank's: its cut of every module, which it keeps of each
    adapter written; the embedding's A is whole on every rank)."""
    mc, device = model.cfg, budget.device
    vocab_shapes = mc.outer_module_shapes()
    shapes = {
        (layer, proj): dims
        for layer in range(mc.num_layers)
        for proj, dims in mc.layer_module_shapes(layer).items()
    }
    experts = {key: n for key in shapes if (n := mc.module_experts(key[1]))}  # a MoE's experts
    shard = None
    binding: Callable[[LoRASlotBank, LoRAOps], LoRABinding] = LoRABinding
    if model.tp is not None:
        tp, full = model.tp, model.full_cfg
        lo, hi = tp.layout.vocab_rows
        vocab_shapes[LM_HEAD] = (mc.hidden_size, hi - lo)  # the rank's vocabulary rows
        shapes = {key: model.lora_shard_shape(key, dims) for key, dims in shapes.items()}

        def shard(key: tuple[int, str], a: torch.Tensor, b: torch.Tensor) -> tuple:
            if key[0] == VOCAB_LAYER:
                return tp.shard_lora(key[1], a, b, full)
            return model.shard_lora(key, a, b)

        if tp.fully_sharded:
            binding = functools.partial(FullyShardedLoRABinding, tp=tp, cfg=full)

    # embed_tokens / lm_head rows for every slot, as vLLM: an adapter may target them whenever
    # it arrives, and the bank's tables are fixed for its life (counted by lora_slots and
    # kv_blocks like the projections' rows)
    shapes.update({(VOCAB_LAYER, name): dims for name, dims in vocab_shapes.items()})
    ops = select_lora_ops(device)
    table_dtype = ops.table_dtype(budget.dtype)
    if slots is None:
        slots = budget.lora_slots(shapes, table_dtype, experts)  # --max-lora-device-fraction
    bank = bank_class(
        shapes, slots, config.max_lora_rank, table_dtype, device, experts, shard=shard
    )
    model.lora = binding(bank, ops)
    return bank


def wire_lora(
    config: EngineConfig,
    model: DecoderForCausalLM,
    budget: MemoryBudget,
    workers: TPWorkers | None = None,
) -> LoRAParts:
    """Bind a slot bank to ``model`` and build the tiered adapter cache over it; the cache is
    told the bank's slot count, which the memory budget may have capped below ``--max-loras``.
    ``workers``: a tensor-parallel group whose banks repeat this one's every write."""
    if workers is None:
        bank = slot_bank(config, model, budget)
    else:
        bank = slot_bank(config, model, budget, bank_class=MirroredSlotBank)
        bank.workers = workers  # type: ignore[attr-defined]
    mc = model.full_cfg  # adapters are checked against the whole model's shapes
    slots = bank.max_loras
    text_only = isinstance(mc.raw.get("text_config"), dict)  # a multimodal checkpoint's text
    spec = BaseModelSpec(
        mc.num_layers,
        mc.module_shapes,
        mc.model_type,
        mc.outer_module_shapes(),
        text_only,
        mc.moe_spec(),
        mc.linear_spec(),
        mc.layer_modules(),
    )
    cache_config = config if slots == config.max_loras else replace(config, max_loras=slots)
    adapters = TieredAdapterCache.from_config(bank, spec, cache_config, dtype=bank.dtype)
    merger = None
    if config.lora_merge_after_steps and model.quant is not None:
        # merging would write a float copy of each targeted projection: more bytes than the
        # quantized base holds, and not the weights the adapter runs against elsewhere
        log.info("lora merge fast path off: the base is quantized (%s)", model.quant.label)
    elif config.lora_merge_after_steps and model.tp is not None:
        log.info("lora merge fast path off: tensor parallel (each rank would merge its cut)")
    elif config.lora_merge_after_steps:
        assert model.make_linear is not None
        merger = AdapterMerger(model, model.make_linear, config.lora_merge_after_steps)
    return LoRAParts(adapters, LocalAdapterCatalog(adapters.store), merger)


@dataclass(frozen=True)
class EngineParts:
    """What an engine is made of, built from its config by :func:`build_parts`."""

    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    tokenizer: Any | None  # None with skip_tokenizer_init
    model: DecoderForCausalLM
    eos_token_ids: set[int]  # the model's and the tokenizer's
    lora: LoRAParts | None  # None without enable_lora
    cache: PagedKVCache
    pool: BlockPool
    max_model_len: int
    workers: TPWorkers | None = None  # the tensor-parallel group (rank 0's handle), if any
    state_pool: BlockPool | None = None  # the state groups' pages (recurrent layers), if any


def set_threads(n: int | None) -> None:
    if n and torch.get_num_threads() != n:
        # only when it changes: resizing the OpenMP team while another engine in this process
        # (a test's, a second LLM) is inside a parallel region is unsafe in the OpenMP runtime
        torch.set_num_threads(n)


def _parse(config: EngineConfig) -> tuple[ModelConfig, torch.device, torch.dtype, Any]:
    """The model's config, device, dtype and quantization (no weights read yet)."""
    mc = load_model_config(
        Path(config.model), config.generation_config, config.generation_overrides
    )
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, mc, device)
    qc = mc.raw.get("quantization_config")
    if qc and qc.get("quant_method") in model_class(mc.architecture, mc.raw).own_quant_methods:
        qc = None  # the architecture dequantizes these tensors at load
    quant = parse_quantization(qc, config.quantization, config.quantization_group_size)
    return mc, device, dtype, quant


def load_base(
    config: EngineConfig, parsed: tuple | None = None, group: Group | None = None, rank: int = 0
) -> tuple[ModelConfig, torch.device, torch.dtype, DecoderForCausalLM]:
    """Load the model (a tensor-parallel rank's shard with ``group``); ``parsed``: what
    :func:`_parse` returned, if the caller has it."""
    mc, device, dtype, quant = parsed or _parse(config)
    tp = model_shard(config, mc, group, rank) if group is not None else None
    model = load_model(Path(config.model), mc, dtype, device, quant, tp)  # mc.architecture's
    return mc, device, dtype, model


def _read(
    config: EngineConfig, group: Group | None
) -> tuple[Any | None, tuple[ModelConfig, torch.device, torch.dtype, DecoderForCausalLM]]:
    """The tokenizer (None with skip_tokenizer_init) and the model (rank 0's shard with
    ``group``)."""
    parsed = _parse(config)
    tokenizer = None
    if not config.skip_tokenizer_init:  # its errors name it before a weight is read
        tok_dir = Path(config.tokenizer) if config.tokenizer else Path(config.model)
        tokenizer = load_tokenizer(tok_dir, config.trust_remote_code)
    return tokenizer, load_base(config, parsed, group)


def build_parts(config: EngineConfig) -> EngineParts:
    """Load the model (and tokenizer), wire LoRA and size the KV cache for ``config``; with
    ``tensor_parallel_size > 1`` this process is rank 0 and starts the workers first (they
    load their shards meanwhile)."""
    if config.tensor_parallel_size > 1:
        rv = config.rendezvous()
        set_threads(rank_threads(config, rv))
        workers = TPWorkers.start(config, rv)
        with workers.closed_on_error():
            return _build(config, workers)
    set_threads(config.num_threads)
    return _build(config, None)


def _build(config: EngineConfig, workers: TPWorkers | None) -> EngineParts:
    group = workers.group if workers is not None else None
    # the workers wait to hear whether every rank loaded (a tensor-parallel group's)
    tokenizer, (mc, device, dtype, model) = on_every_rank(lambda: _read(config, group), group)
    quant = model.quant
    if quant is not None:
        release_freed_memory()  # the float copies quantized at load, back to the OS
        log.info("quantized base (%s): %s", quant.label, model.linear_impl)
    if model.linear_impl == "upcast-f32":
        log.warning(
            "this CPU has no native bfloat16 (no AVX512_BF16 or AMX): bfloat16 GEMMs run "
            "much slower than float32 here; prompt GEMMs are computed in float32 from the "
            "bfloat16 weights, decode steps stay bfloat16 (--dtype float32 is faster on "
            "this CPU if memory allows)"
        )
    eos = set(mc.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    local = model.cfg  # a tensor-parallel rank's heads: its KV cache and slot tables
    groups = model_kv_groups(model, config)
    budget = MemoryBudget(config, local, device, dtype, groups, model.state_shape())
    lora = wire_lora(config, model, budget, workers) if config.enable_lora else None
    num_blocks = budget.kv_blocks(lora.adapters.bank.nbytes if lora is not None else 0)
    state_pages = budget.state_pages()
    if workers is not None:  # every rank builds the same number of blocks, pages and slots
        slots = lora.adapters.bank.max_loras if lora else 0
        workers.cast(WorkerLayout(num_blocks, slots, state_pages))
        model = DriverModel(model, workers)  # type: ignore[assignment]
    cache = PagedKVCache(
        local.num_layers, num_blocks, config.block_size, local.num_kv_heads, local.head_dim,
        dtype, device, groups, local.kv_layer_shapes(), model.state_shape(), state_pages,
    )  # fmt: skip
    pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching)
    state_pool = (
        BlockPool(state_pages, config.block_size, config.enable_prefix_caching)
        if state_pages
        else None
    )
    return EngineParts(
        model_config=mc,
        device=device,
        dtype=dtype,
        tokenizer=tokenizer,
        model=model,
        eos_token_ids=eos,
        lora=lora,
        cache=cache,
        pool=pool,
        state_pool=state_pool,
        max_model_len=budget.max_model_len(num_blocks),
        workers=workers,
    )
