"""Tensor parallelism (Megatron-style) over a ``torch.distributed`` process group.

Each of ``size`` ranks holds one shard of every weight::

    q/k/v, gate/up  column-parallel: the rank's output rows (its heads, its MLP columns)
    o, down         row-parallel:    the rank's input columns; outputs all-reduced (SUM)
    embed_tokens    vocab-parallel:  the rank's vocabulary rows; looked up masked, all-reduced
    lm_head         vocab-parallel:  the rank's vocabulary rows; logits gathered on rank 0

KV heads are split over ranks, or replicated when ``num_kv_heads < size`` (rank ``r`` keeps KV
head ``r // (size / num_kv_heads)``, the one its query heads read). A row-parallel bias (o's,
down's, a MoE's down experts') is added by rank 0 only (before the all-reduce, so once).

LoRA follows the same split (:meth:`TensorParallel.shard_lora`), in vLLM's two modes:

- default: on a column-parallel module A is whole and B keeps the rank's output rows; on a
  row-parallel module A keeps the rank's input columns and B is whole, and the delta of the
  partial shrink is added to the rank's partial output before the layer's all-reduce. The sum
  over ranks of ``(x_r A_r^T) B^T`` is ``(x A^T) B^T``: the shrink's all-reduce rides on the
  layer's own, no collective of its own;
- ``fully_sharded`` (``--fully-sharded-loras``): A and B both cut, 1/size of each per rank.
  A keeps the rank's input columns (of the hidden size on a column-parallel module, whose
  input every rank holds whole), B the rank's output rows (of the hidden size on a
  row-parallel one); the partial shrinks ``[T, rank rows]`` of a projection group are summed
  in one all-reduce (far smaller than the ``[T, hidden]`` one), then each rank expands into
  its own output columns (``lora_binding.FullyShardedLoRABinding``).

A family's own modules fall into the same two kinds (``HIDDEN_IN``: output rows cut, input
the hidden state; ``HIDDEN_OUT``: input columns cut, output summed into the hidden state:
Gated DeltaNet's in- and out-projections, a shared expert's); which rows a rank keeps of them
is the family's to say (its ``shard_lora`` hook, through :meth:`TensorParallel.cut_lora`).

The embedding's A is whole on every rank (its delta is added after the lookup's all-reduce);
the head's B keeps the rank's vocabulary rows.

``TensorParallel`` is passed explicitly (no module state); ``size == 1`` is never built: a
single device has no shard plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from loraplex.checkpoint.modules import (
    EMBED_TOKENS,
    EXPERT_PROJ_NAMES,
    LM_HEAD,
    PER_LAYER_MODEL_PROJECTION,
    ROUTER,
)
from loraplex.model.tensor_parallel.collectives import GlooCollectives
from loraplex.types import ModelLoadError

if TYPE_CHECKING:
    from loraplex.model.spec import ModelConfig

COLUMN_PARALLEL = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})
HIDDEN_IN = COLUMN_PARALLEL | frozenset(
    {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",  # Gated DeltaNet's in-projections
     "shared_expert.gate_proj", "shared_expert.up_proj"}
)  # fmt: skip
"""Modules cut by their output rows whose input is the whole hidden state (each family says
which rows: ``shard_lora``): ``--fully-sharded-loras`` cuts their A's hidden columns."""
HIDDEN_OUT = ROW_PARALLEL | frozenset({"out_proj", "shared_expert.down_proj"})
"""Modules cut by their input columns whose output is the hidden state (summed over the
ranks): ``--fully-sharded-loras`` cuts their B's hidden rows."""
EXPERT_COLUMN = frozenset({"experts.gate_proj", "experts.up_proj"})
"""A MoE's experts are tensor-parallel as the dense MLP is (each expert's columns cut); the
router is whole on every rank."""
WHOLE = frozenset({EMBED_TOKENS, ROUTER, PER_LAYER_MODEL_PROJECTION})
"""Modules whose LoRA every rank holds whole: the embedding's (its delta is added after the
lookup's all-reduce), the router's and Gemma 4's ``per_layer_model_projection`` (their inputs
and outputs are whole on every rank)."""
SLOT_PROJECTIONS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "gate_up": ("gate_proj", "up_proj"),
    "o": ("o_proj",),
    "down": ("down_proj",),
}
"""A fused Linear slot's projections in column order (``decoder.LINEAR_SLOTS``)."""


@dataclass(frozen=True)
class ShardLayout:
    """Which heads and columns one rank holds of a model of ``cfg``'s shape."""

    rank: int
    size: int
    num_heads: int  # query heads per rank
    num_kv_heads: int  # KV heads per rank (1 when replicated)
    first_kv_head: int
    intermediate: int  # MLP columns per rank
    moe_intermediate: int  # each expert's MLP columns per rank (0: a dense model)
    vocab_rows: tuple[int, int]  # [lo, hi) of the vocabulary this rank holds
    vocab_pad: int  # rows per rank of the gathered logits (the last rank's may be fewer)

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, size: int) -> ShardLayout:
        """The rank's shard of ``cfg``; ModelLoadError naming the field that does not split."""
        h, kv, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
        where = f"--tensor-parallel-size {size}"
        if h % size:
            raise ModelLoadError(f"{where}: num_attention_heads={h} is not a multiple of {size}")
        if kv % size and size % kv:
            raise ModelLoadError(
                f"{where}: num_key_value_heads={kv} neither divides nor is a multiple of {size}"
            )
        if inter % size:
            raise ModelLoadError(f"{where}: intermediate_size={inter} is not a multiple of {size}")
        moe = int(getattr(cfg, "moe_intermediate_size", 0) or 0)
        if moe % size:
            raise ModelLoadError(
                f"{where}: moe_intermediate_size={moe} is not a multiple of {size}"
            )
        kv_local = max(1, kv // size)
        first_kv = rank * kv_local if kv >= size else rank // (size // kv)
        per = -(-cfg.vocab_size // size)
        lo = min(rank * per, cfg.vocab_size)
        return cls(
            rank,
            size,
            h // size,
            kv_local,
            first_kv,
            inter // size,
            moe // size,
            (lo, min(lo + per, cfg.vocab_size)),
            per,
        )

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` with this rank's heads and MLP width (its blocks, KV cache and slot tables
        are built from it); the vocabulary stays whole (sampling and intake read it)."""
        moe = {"moe_intermediate_size": self.moe_intermediate} if self.moe_intermediate else {}
        return replace(
            cfg,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate,
            **moe,
        )

    # -- index sets ----------------------------------------------------------------------------
    def proj_rows(self, proj: str, cfg: ModelConfig) -> torch.Tensor:
        """The full output rows of column-parallel ``proj`` this rank keeps (also the input
        columns of a row-parallel one: o_proj's are q_proj's, down_proj's are up_proj's)."""
        hd = cfg.head_dim
        if proj in ("q_proj", "o_proj"):
            first, n = self.rank * self.num_heads, self.num_heads
        elif proj in ("k_proj", "v_proj"):
            first, n = self.first_kv_head, self.num_kv_heads
        elif proj in EXPERT_PROJ_NAMES:  # each expert's columns, as the dense MLP's
            lo = self.rank * self.moe_intermediate
            return torch.arange(lo, lo + self.moe_intermediate)
        else:  # gate_proj, up_proj, down_proj
            lo = self.rank * self.intermediate
            return torch.arange(lo, lo + self.intermediate)
        return torch.arange(first * hd, (first + n) * hd)

    def slot_rows(self, slot: str, cfg: ModelConfig, offsets: dict[str, int]) -> torch.Tensor:
        """Rows of a fused column-parallel slot's weight this rank keeps: each projection's
        rows, shifted by its first column in the full fused layout (``offsets``; a projection
        it does not name is not in the layer: Gemma 4's k-is-v layers have no v)."""
        projs = [p for p in SLOT_PROJECTIONS[slot] if p in offsets]
        return torch.cat([self.proj_rows(p, cfg) + offsets[p] for p in projs])


@dataclass(frozen=True)
class TensorParallel:
    """One rank of a tensor-parallel model: its shard layout and the process group its
    collectives run on (the engine's step group)."""

    layout: ShardLayout
    group: Any = field(default=None, compare=False)  # a torch.distributed ProcessGroup
    fully_sharded: bool = False  # --fully-sharded-loras: LoRA's A and B both cut
    comm: Any = field(default=None, compare=False)
    """The step traffic's collectives (``collectives``: shared memory on one host, else
    the group's); None: ``GlooCollectives`` over ``group``."""

    def __post_init__(self) -> None:
        if self.comm is None:
            object.__setattr__(self, "comm", GlooCollectives(self.group, self.rank, self.size))

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def size(self) -> int:
        return self.layout.size

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``sum over ranks of x`` on every rank (in place; x: a row-parallel partial output)."""
        return self.comm.all_reduce(x)

    def gather_vocab(self, logits: torch.Tensor, vocab: int) -> torch.Tensor:
        """The full logits [N, vocab] on rank 0 from each rank's [N, its rows]; other ranks get
        their own shard back (nothing reads it: sampling runs once, on rank 0)."""
        pad = self.layout.vocab_pad
        n = logits.shape[0]
        if logits.shape[1] < pad:  # the last rank's shard is shorter: pad to one shape
            logits = torch.cat([logits, logits.new_zeros(n, pad - logits.shape[1])], dim=1)
        parts = self.comm.gather(logits.contiguous())
        if parts is None:
            return logits
        return torch.cat(parts, dim=1)[:, :vocab]  # [N, vocab]

    # -- weights -------------------------------------------------------------------------------
    def shard_slot(
        self,
        slot: str,
        kind: str,
        t: torch.Tensor,
        cfg: ModelConfig,
        offsets: dict[str, int],
    ) -> torch.Tensor | None:
        """This rank's part of fused slot ``slot``'s full ``kind`` ("weight" or "bias") tensor
        (None: a row-parallel bias on a rank other than 0, which adds none)."""
        lay = self.layout
        if slot in ("qkv", "gate_up"):  # column-parallel: output rows
            return t.index_select(0, lay.slot_rows(slot, cfg, offsets)).contiguous()
        if kind == "bias":  # row-parallel: added once, by rank 0
            return t if lay.rank == 0 else None
        cols = lay.proj_rows(SLOT_PROJECTIONS[slot][0], cfg)
        return t.index_select(1, cols).contiguous()

    def shard_experts(self, slot: str, t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor | None:
        """The rank's columns of every expert: ``w_gate_up [E, 2 I, D]`` and its bias
        ``b_gate_up [E, 2 I]`` (gate rows, then up rows) or ``w_down [E, D, I]``; the
        row-parallel ``b_down [E, D]`` whole on rank 0, None on the others (added once)."""
        if slot == "b_down":
            return t if self.rank == 0 else None
        cols = self.layout.proj_rows("experts.gate_proj", cfg)
        if slot == "w_down":
            return t.index_select(2, cols).contiguous()
        inter = int(cfg.moe_intermediate_size)  # type: ignore[attr-defined]
        return t.index_select(1, torch.cat([cols, cols + inter])).contiguous()

    def shard_vocab(self, t: torch.Tensor) -> torch.Tensor:
        """The rank's vocabulary rows of an embedding or head weight [V, D]."""
        lo, hi = self.layout.vocab_rows
        return t[lo:hi].contiguous()

    def embed(self, table: Any, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: rows of this rank's ids, zeros for the others, summed over
        ranks. ``table``: the rank's [V_r, D] rows (anything indexable by ids)."""
        lo, hi = self.layout.vocab_rows
        local = input_ids - lo
        outside = (local < 0) | (local >= hi - lo)  # [T]
        h = table[local.clamp(0, max(hi - lo - 1, 0))]  # [T, D]
        h[outside] = 0
        return self.all_reduce(h)

    def hidden_cols(self, cfg: ModelConfig) -> tuple[int, int]:
        """``[lo, hi)`` of the hidden size this rank's fully sharded LoRA holds."""
        per = cfg.hidden_size // self.size
        return self.rank * per, (self.rank + 1) * per

    def lora_shape(self, proj: str, dims: tuple[int, int], cfg: ModelConfig) -> tuple[int, int]:
        """The rank's ``(d_in, d_out)`` of module ``proj`` whose heads-and-MLP cut is ``dims``
        (``fully_sharded`` cuts the hidden side too)."""
        if not self.fully_sharded:
            return dims
        part = cfg.hidden_size // self.size
        if proj in HIDDEN_IN:
            return part, dims[1]
        if proj in HIDDEN_OUT:
            return dims[0], part
        return dims

    def check_lora_split(self, cfg: ModelConfig) -> None:
        """ModelLoadError unless ``--fully-sharded-loras`` can cut the hidden size evenly."""
        if self.fully_sharded and cfg.hidden_size % self.size:
            raise ModelLoadError(
                f"--fully-sharded-loras: hidden_size={cfg.hidden_size} is not a multiple of "
                f"--tensor-parallel-size {self.size}"
            )

    def shard_lora(self, proj: str, a: torch.Tensor, b: torch.Tensor, cfg: ModelConfig) -> tuple:
        """This rank's (A [r, d_in_r], B [d_out_r, r]) of a LoRA module of ``proj`` (full A
        [r, d_in], B [d_out, r]); see the module docstring for the split."""
        lay = self.layout
        if proj in COLUMN_PARALLEL | ROW_PARALLEL:
            return self.cut_lora(proj, a, b, lay.proj_rows(proj, cfg), cfg)
        if proj == LM_HEAD:
            lo, hi = lay.vocab_rows
            return a, b[lo:hi]
        if proj in EXPERT_COLUMN:  # A [E, r, D] whole, B [E, I, r] the rank's columns
            return a, b.index_select(1, lay.proj_rows(proj, cfg))
        if proj == "experts.down_proj":  # A [E, r, I] the rank's columns, B [E, D, r] whole
            return a.index_select(2, lay.proj_rows(proj, cfg)), b
        if proj in WHOLE:
            return a, b
        raise ModelLoadError(f"--tensor-parallel-size {lay.size}: LoRA on {proj} has no split")

    def cut_lora(
        self, proj: str, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor, cfg: ModelConfig
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) of module ``proj`` (``HIDDEN_IN`` or ``HIDDEN_OUT``) cut by ``rows``: the
        output rows the rank keeps of a column-parallel module (B's rows; A whole, or its
        hidden columns when ``fully_sharded``), the input columns of a row-parallel one (A's
        columns; B whole, or its hidden rows)."""
        hidden = slice(*self.hidden_cols(cfg))
        if proj in HIDDEN_OUT:
            return a.index_select(1, rows), (b[hidden] if self.fully_sharded else b)
        return (a[:, hidden] if self.fully_sharded else a), b.index_select(0, rows)


class VocabShard:
    """A rank's rows of a vocab-parallel embedding, indexed like the whole table:
    ``shard[input_ids]`` is the [T, D] lookup summed over the ranks."""

    def __init__(self, table: torch.Tensor, tp: TensorParallel) -> None:
        self.table = table  # [V_r, D]
        self.tp = tp
        self.nbytes = table.nbytes

    def __getitem__(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.tp.embed(self.table, input_ids)
