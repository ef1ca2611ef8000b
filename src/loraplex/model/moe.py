"""Sparse mixture-of-experts layers: the router, the experts as grouped GEMMs, and their LoRA.

One sparse block per MoE layer (``SparseMoE``), for every token of the step at once::

    logits = x @ router.T (+ bias) (+ the router's LoRA)   # [T, E]
    w, e   = top-k of softmax(logits) (renormalised)         # [T, k] each
             (or softmax of the top-k logits: GPT-OSS)
    pairs (token, expert) sorted by expert (stable)         # [N = T k]
    h = grouped(x[tok], W_gate_up)  (+ expert LoRA) (+ b)    # [N, 2 I]: each expert over its rows
    h = grouped(glu(h), W_down)  (+ expert LoRA) (+ b)       # [N, D]
    out[t] = sum over t's pairs of w * h                     # index_add in sorted order
    out += shared(x)  (+ its LoRA; times sigmoid(x @ g.T) with a shared gate)   # optional

A subclass may route otherwise (``route``: Llama 4's sigmoid of the top-1 logit) and scale
each expert's input by its weight instead of its output (``scale_input``, Llama 4); the router
may read an input of its own (``router_x``) and a layer may scale each expert's weight
(``L.per_expert_scale``: Gemma 4's, ``model/gemma4_moe.py``). The shared
expert (``MoEConfig.shared_expert_intermediate_size``) is a gated MLP every token runs, in
its own LoRA groups (``shared_expert.{gate,up,down}_proj``), with an optional sigmoid gate
``[1, D]`` (``shared_expert_gate``, Qwen-MoE's).

``glu`` is ``act(gate) * up`` or GPT-OSS's clamped SwiGLU (:func:`clamped_swiglu`); the biases
(per expert, GPT-OSS) are optional. ``W_gate_up`` always holds gate rows then up rows: a
checkpoint that interleaves them (GPT-OSS) is de-interleaved at load, and its adapters' ``B``
rows with it (``MoESpec.gate_up_interleaved``).

Tokens are routed once per layer and sorted by expert, so each expert's GEMM runs over one
contiguous block of rows and an expert no token chose is never read (``GroupedExperts``: a loop
over the experts that have rows on CPU, one grouped Triton kernel on CUDA). Nothing loops over
tokens.

Expert LoRA rides on the gathered LoRA ops unchanged: an expert module's slot tables hold expert
``e``'s rows at ``[e * capacity, (e + 1) * capacity)`` (``loraplex.lora.slots``), and the sort is
stable, so within an expert the pairs keep the step's token order, adapters in increasing row
order. The pairs of (expert ``e``, a slot's rows ``[rs, re)``) are then contiguous and read rows
``[e * capacity + rs, e * capacity + re)``: a ``LoRABatchPlan`` over the sorted pairs
(``loraplex.lora.plan.plan_expert_rows``), which every backend (torch, the C kernel, Triton) runs as it runs any
module's. Each (token, expert) row thus gets its own request's adapter for that expert.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from loraplex.checkpoint.modules import (
    ATTN_PROJ_NAMES,
    EXPERT_CHECKPOINT_NAMES,
    EXPERT_PROJ_NAMES,
    ROUTER,
    SHARED_EXPERT_GATE,
    SHARED_EXPERT_PROJ_NAMES,
    MoESpec,
)
from loraplex.lora.plan import plan_expert_rows
from loraplex.model.decoder import DecoderForCausalLM, pre_norm_stack
from loraplex.model.layers import ACTIVATIONS, DecoderLayer, LayerStep
from loraplex.model.linear import LinearFactory, dense_weight, expert_factory
from loraplex.model.spec import ModelConfig
from loraplex.model.tensor_parallel.sharding import ShardLayout
from loraplex.types import ModelLoadError


@dataclass(frozen=True)
class MoEConfig(ModelConfig):
    """A decoder whose MLP is a sparse block in ``sparse_layers`` (dense elsewhere)."""

    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    sparse_layers: tuple[int, ...] = ()
    moe_block: str = "mlp"  # the sparse block's checkpoint name (Mixtral: block_sparse_moe)
    routing_in_model_dtype: bool = True
    """Whether the top-k weights are cast back to the model dtype before they scale the experts'
    outputs (Qwen-MoE's router does; Mixtral's keeps them float32)."""
    shared_expert_intermediate_size: int = 0
    """The shared expert's width (0: none)."""
    shared_expert_gate: bool = False
    """Whether a sigmoid gate ``[1, D]`` scales the shared expert's output."""
    packed_in_out: bool = False
    """Packed experts stored ``[E, d_in, d_out]`` (Llama 4; ``MoESpec.packed_in_out``)."""
    router_name: str = ROUTER
    """The router's module name in checkpoints and adapters (Llama 4: ``router``)."""
    softmax_after_topk: bool = False
    """Route by the top-k logits, weights their softmax in the logits' dtype (GPT-OSS), instead
    of the top-k of a float32 softmax over every expert."""
    router_bias: bool = False
    expert_bias: bool = False
    """Per-expert biases on gate/up ``[E, 2 I]`` and down ``[E, D]`` (GPT-OSS)."""
    gate_up_interleaved: bool = False
    """The checkpoint's packed gate/up interleaves gate and up columns (GPT-OSS)."""
    swiglu_limit: float | None = None
    """GPT-OSS's clamped SwiGLU (:func:`clamped_swiglu`) with this limit; None: ``act(g) * u``."""
    swiglu_alpha: float = 1.702
    packed_only: bool = False
    """No per-expert modules in any transformers version (``MoESpec.packed_only``)."""

    def moe_spec(self) -> MoESpec | None:
        return MoESpec(
            self.num_experts,
            self.sparse_layers,
            self.hidden_size,
            self.moe_intermediate_size,
            self.moe_block,
            self.shared_expert_intermediate_size,
            self.packed_in_out,
            self.router_name,
            self.shared_expert_gate,
            self.gate_up_interleaved,
            packed_only=self.packed_only,
        )

    def layer_module_shapes(self, layer: int) -> dict[str, tuple[int, int]]:
        if layer not in self.sparse_layers:
            return self.module_shapes
        attn = {p: d for p, d in self.module_shapes.items() if p in ATTN_PROJ_NAMES}
        spec = self.moe_spec()
        assert spec is not None
        return {**attn, **spec.shapes}

    def module_experts(self, proj: str) -> int:
        return self.num_experts if proj in EXPERT_PROJ_NAMES else 0

    def layer_bias_params(self) -> int:
        """The projections' biases, the router's and every expert's (GPT-OSS: every layer is
        sparse, so a layer's count is the sparse block's)."""
        e, i, d = self.num_experts, self.moe_intermediate_size, self.hidden_size
        extra = e * self.router_bias + e * (2 * i + d) * self.expert_bias
        return super().layer_bias_params() + extra

    def num_parameters(self) -> int:
        dense = super().num_parameters()
        mlp = sum(a * b for p, (a, b) in self.module_shapes.items() if p not in ATTN_PROJ_NAMES)
        spec = self.moe_spec()
        assert spec is not None
        sparse = sum(a * b * max(1, self.module_experts(p)) for p, (a, b) in spec.shapes.items())
        return dense + len(self.sparse_layers) * (sparse - mlp)

    def active_parameters(self) -> int:
        """Parameters a token reads: the dense ones and ``num_experts_per_tok`` experts per
        sparse layer (the ``A3B`` of Qwen3-30B-A3B)."""
        spec = self.moe_spec()
        assert spec is not None
        per_expert = sum(a * b for p, (a, b) in spec.shapes.items() if p in EXPERT_PROJ_NAMES)
        idle = (self.num_experts - self.num_experts_per_tok) * per_expert
        return self.num_parameters() - len(self.sparse_layers) * idle


def moe_config_fields(
    c: Mapping[str, Any], source: str, *, num_experts: int, inter: int, sparse: tuple[int, ...],
    norm_topk_prob: bool, block: str, in_model_dtype: bool, shared: int = 0,
    shared_gate: bool = False, packed_in_out: bool = False, router: str = ROUTER,
) -> dict[str, Any]:  # fmt: skip
    """The ``MoEConfig`` fields, checked: top-k within the experts, positive sizes (``shared``:
    the shared expert's width, 0 for none)."""
    top_k = int(c.get("num_experts_per_tok") or 0)
    if num_experts < 1:
        raise ModelLoadError(f"{source}: num_experts must be >= 1, got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise ModelLoadError(
            f"{source}: num_experts_per_tok must be in [1, num_experts={num_experts}], got {top_k}"
        )
    if inter < 1:
        raise ModelLoadError(f"{source}: moe_intermediate_size must be >= 1, got {inter}")
    if c.get("shared_expert_intermediate_size") and not shared:
        raise ModelLoadError(
            f"{source}: shared experts (shared_expert_intermediate_size) are not supported"
        )
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=inter,
        norm_topk_prob=norm_topk_prob,
        sparse_layers=sparse,
        moe_block=block,
        routing_in_model_dtype=in_model_dtype,
        shared_expert_intermediate_size=shared,
        shared_expert_gate=shared_gate,
        packed_in_out=packed_in_out,
        router_name=router,
    )


# ---------------------------------------------------------------------------- grouped GEMMs


class GroupedExperts(Protocol):
    """``out[offsets[e]:offsets[e+1]] = x[offsets[e]:offsets[e+1]] @ w[e].T`` for every expert
    with rows (``x [N, K]`` sorted by expert, ``w`` what :meth:`prepare` made of ``[E, M, K]``,
    ``offsets [E + 1]`` on x's device, ``counts`` the same as E Python ints); an expert without
    rows is never read."""

    name: str

    def prepare(self, w: torch.Tensor, make: LinearFactory) -> Any:
        """The layer's experts ``w [E, M, K]`` as this GEMM reads them (once, at load;
        ``make``: the dense projections' Linear factory)."""
        ...

    def __call__(
        self, x: torch.Tensor, w: Any, offsets: torch.Tensor, counts: list[int]
    ) -> torch.Tensor: ...


class ExpertLinears:
    """A layer's experts as one ``Linear`` each: on the kernel the dense projections chose at
    load (the panel kernel, oneDNN's packed layout) where it also wins at an expert's shape
    and rows (``expert_factory``; 3.4x ``torch.mm`` over a slice at one row for gpt-oss-20b's
    experts in bf16: scripts/bench_mxfp4.py), else plain views of the packed tensor."""

    def __init__(self, w: torch.Tensor, make: LinearFactory) -> None:
        self.shape = tuple(w.shape)  # [E, M, K]
        make = expert_factory(make, self.shape[1], self.shape[2], w.dtype)
        self.linears = [make(w[e], None) for e in range(w.shape[0])]
        self.nbytes = sum(lin.nbytes for lin in self.linears)

    def __len__(self) -> int:
        return len(self.linears)

    def dense(self) -> torch.Tensor:
        """Every expert's weight ``[E, M, K]`` read back (exact; for tests and references)."""
        return torch.stack([dense_weight(lin, self.shape[2])[0] for lin in self.linears])


class TorchGroupedExperts:
    """One GEMM per expert that has rows, into its block of the output (the CPU path: a loop
    over at most E experts per layer, never over tokens), each on its expert's Linear."""

    name = "torch-grouped"

    def prepare(self, w: torch.Tensor, make: LinearFactory) -> ExpertLinears:
        return ExpertLinears(w, make)

    def __call__(
        self, x: torch.Tensor, w: ExpertLinears, offsets: torch.Tensor, counts: list[int]
    ) -> torch.Tensor:
        out = x.new_empty(x.shape[0], w.shape[1])  # [N, M]
        start = 0
        for lin, n in zip(w.linears, counts, strict=True):
            if n:
                out[start : start + n] = lin(x[start : start + n])
                start += n
        return out


def select_grouped_experts(device: torch.device) -> GroupedExperts:
    """The grouped GEMM for ``device``, chosen once at load: Triton's on CUDA, else torch's."""
    if device.type == "cuda":
        try:
            from loraplex.model.moe_triton import TritonGroupedExperts
        except ImportError:  # no triton: the torch loop runs on CUDA too
            return TorchGroupedExperts()
        return TritonGroupedExperts()
    return TorchGroupedExperts()


# ------------------------------------------------------------------------------ the block


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def clamped_swiglu(gu: torch.Tensor, inter: int, limit: float, alpha: float) -> torch.Tensor:
    """GPT-OSS's expert activation (transformers' ``GptOssExperts._apply_gate``), gate columns
    first: ``[N, 2 I] -> [N, I]``::

        g = min(gate, limit);  u = clamp(up, -limit, limit)
        out = (u + 1) * (g * sigmoid(g * alpha))
    """
    g = gu[:, :inter].clamp(min=None, max=limit)
    u = gu[:, inter:].clamp(min=-limit, max=limit)
    return (u + 1) * (g * torch.sigmoid(g * alpha))


class SparseMoE:
    """The sparse block of a MoE layer (module docstring). Reads ``L.router`` (a Linear
    ``[E, D]``), ``L.w_gate_up [E, 2 I, D]`` (gate rows, then up rows) and ``L.w_down
    [E, D, I]`` of the layer it is called with, with a shared expert ``L.shared_gate_up``
    ``[2 Is, D]``, ``L.shared_down [D, Is]`` and, gated, ``L.shared_gate [1, D]``, and with
    ``expert_bias`` ``L.b_gate_up [E, 2 I]`` and ``L.b_down [E, D]`` (None on a
    tensor-parallel rank other than 0: a row-parallel bias is added once)."""

    scale_input = False
    """Whether the routing weights scale each expert's input (Llama 4) instead of its output."""

    def __init__(
        self,
        cfg: MoEConfig,
        grouped: GroupedExperts,
    ) -> None:
        self.num_experts = cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.in_model_dtype = cfg.routing_in_model_dtype
        self.inter = cfg.moe_intermediate_size
        self.act: Callable[[torch.Tensor], torch.Tensor] = ACTIVATIONS[cfg.hidden_act]
        self.glu: Callable[[torch.Tensor], torch.Tensor] = self._glu
        """``[N, 2 I] -> [N, I]``, chosen once: ``act(gate) * up`` or the clamped SwiGLU."""
        if cfg.swiglu_limit is not None:
            self.glu = functools.partial(
                clamped_swiglu, inter=self.inter, limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha
            )
        self.softmax_after_topk = cfg.softmax_after_topk
        self.expert_bias = cfg.expert_bias
        self.grouped = grouped
        i, d = self.inter, cfg.hidden_size
        self.gate_up_parts = (("experts.gate_proj", 0, i), ("experts.up_proj", i, 2 * i))
        self.down_parts = (("experts.down_proj", 0, d),)
        self.router_parts = ((ROUTER, 0, cfg.num_experts),)
        si = self.shared_inter = cfg.shared_expert_intermediate_size
        g, u, dn = SHARED_EXPERT_PROJ_NAMES
        self.shared_gate_up_parts = ((g, 0, si), (u, si, 2 * si))
        self.shared_down_parts = ((dn, 0, d),)
        self.shared_gate_parts = ((SHARED_EXPERT_GATE, 0, 1),)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = _same
        """Sum over tensor-parallel ranks, each of which ran its columns of every expert."""
        self.last_counts: list[int] | None = None
        """Rows per expert of the last call (what the grouped GEMMs read; for tests and
        profiling)."""

    def _glu(self, gu: torch.Tensor) -> torch.Tensor:
        return self.act(gu[:, : self.inter]) * gu[:, self.inter :]

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k], experts [T, k])`` of router ``logits [T, E]``, as transformers:
        softmax in float32, top-k, renormalised when ``norm_topk_prob``; or, with
        ``softmax_after_topk`` (GPT-OSS), top-k of the logits and the softmax of those."""
        if self.softmax_after_topk:
            top, e = torch.topk(logits, self.top_k, dim=-1)  # [T, k] each
            return torch.softmax(top, dim=-1, dtype=top.dtype), e
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
        w, e = torch.topk(probs, self.top_k, dim=-1)  # [T, k] each
        if self.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return (w.to(logits.dtype) if self.in_model_dtype else w), e

    def __call__(
        self, L: DecoderLayer, i: int, x: torch.Tensor, step: LayerStep,
        router_x: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Layer ``i``'s sparse-block output [T, D] for normed input ``x [T, D]`` (``router_x``:
        the router's own input where it is not ``x``, Gemma 4's). A layer with
        ``L.per_expert_scale [E]`` (Gemma 4's) scales each pair's weight by its expert's."""
        k = self.top_k
        rx = x if router_x is None else router_x
        logits = L.router(rx)  # [T, E]
        lora, plan = step.lora, step.plan
        if lora is not None and plan is not None and plan.uses((i, ROUTER)):
            lora.add(i, self.router_parts, rx, logits, plan)
        w, e = self.route(logits)  # [T, k], [T, k]
        scale = getattr(L, "per_expert_scale", None)
        if scale is not None:
            w = w * scale[e]  # [T, k] (float32 weights stay float32, as in HF)
        flat = e.reshape(-1)  # [T k]: pair p is token p // k's (p % k)-th expert
        order = torch.argsort(flat, stable=True)  # [N]: pairs sorted by expert
        tok = order // k  # [N] the token of each sorted pair
        counts_t = torch.bincount(flat, minlength=self.num_experts)  # [E]
        counts = counts_t.tolist()
        self.last_counts = counts
        offsets = torch.zeros(self.num_experts + 1, dtype=torch.int64, device=x.device)
        torch.cumsum(counts_t, 0, out=offsets[1:])
        xs = x[tok]  # [N, D]
        if self.scale_input:  # each expert reads its input times the pair's weight
            xs = (xs * w.reshape(-1)[order, None]).to(x.dtype)
        lora_plan = None
        if lora is not None and plan is not None and lora.experts_used(i, plan):
            tok_np = tok.cpu().numpy()
            exp_np = flat[order].cpu().numpy()
            lora_plan = plan_expert_rows(
                plan, lora.token_segments(plan), tok_np, exp_np, lora.bank.capacity
            )
        gu = self.grouped(xs, L.w_gate_up, offsets, counts)  # [N, 2 I]
        if lora_plan is not None:
            lora.add(i, self.gate_up_parts, xs, gu, plan, lora_plan)
        ex = flat[order] if self.expert_bias else None  # [N] the expert of each sorted pair
        if ex is not None:
            gu += L.b_gate_up[ex]
        act = self.glu(gu)  # [N, I]
        h = self.grouped(act, L.w_down, offsets, counts)  # [N, D]
        if lora_plan is not None:
            lora.add(i, self.down_parts, act, h, plan, lora_plan)
        if ex is not None and L.b_down is not None:  # row-parallel: rank 0's alone
            h += L.b_down[ex]
        if not self.scale_input:
            h = h * w.reshape(-1)[order, None]  # [N, D] (float32 weights promote, as in HF)
        out = torch.zeros_like(x) if not self.shared_inter else self.shared(L, i, x, step)
        return self.reduce(out.index_add_(0, tok, h.to(x.dtype)))  # [T, D]

    def shared(self, L: DecoderLayer, i: int, x: torch.Tensor, step: LayerStep) -> torch.Tensor:
        """The shared expert's output [T, D] for x [T, D] (gated MLP with its LoRA, times
        ``sigmoid(x @ L.shared_gate.T)`` where the layer has that gate)."""
        lora, plan = step.lora, step.plan
        gu = L.shared_gate_up(x)  # [T, 2 Is]
        if lora is not None and plan is not None:
            lora.add(i, self.shared_gate_up_parts, x, gu, plan)
        act = self.act(gu[:, : self.shared_inter]) * gu[:, self.shared_inter :]  # [T, Is]
        out = L.shared_down(act)  # [T, D]
        if lora is not None and plan is not None:
            lora.add(i, self.shared_down_parts, act, out, plan)
        gate = getattr(L, "shared_gate", None)
        if gate is not None:
            g = gate(x)  # [T, 1]
            if lora is not None and plan is not None:
                lora.add(i, self.shared_gate_parts, x, g, plan)
            out = out * torch.sigmoid(g)  # [T, D] * [T, 1]
        return out


# ------------------------------------------------------------------------------ the decoder

_MOE_TENSOR = re.compile(
    r"model\.layers\.(?P<layer>\d+)\.(?P<block>mlp|block_sparse_moe)\."
    r"(?:(?P<router>gate\.weight)|experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight"
    r"|experts\.(?P<packed>gate_up_proj|down_proj)"
    r"|(?P<shared>shared_expert\.(?:gate_proj|up_proj|down_proj)\.weight|shared_expert_gate\.weight))"
)
"""A sparse block's checkpoint tensors: the router, per-expert projections (Qwen-MoE's
``gate_proj`` / ``up_proj`` / ``down_proj``, Mixtral's ``w1`` / ``w3`` / ``w2``) or transformers
5's packed ``experts.gate_up_proj [E, 2 I, D]`` / ``experts.down_proj [E, D, I]``; a shared
expert's ``shared_expert.{gate,up,down}_proj.weight`` and ``shared_expert_gate.weight``."""


class MoEDecoderForCausalLM(DecoderForCausalLM):
    """A decoder whose ``sparse_layers`` have a :class:`SparseMoE` in place of the gated MLP;
    the attention, norms and residual wiring are Llama's. Loads either checkpoint layout of the
    experts into ``L.w_gate_up [E, 2 I, D]`` and ``L.w_down [E, D, I]`` (one tensor each per
    layer, so the grouped GEMM indexes experts without copies)."""

    config_class = MoEConfig
    cfg: MoEConfig
    supports_quantization = False  # expert weights have no quantized path yet
    sparse_class: type[SparseMoE] = SparseMoE
    """The sparse block (a subclass routes otherwise: Llama 4's)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(cfg, dtype, device)
        assert isinstance(cfg, MoEConfig)
        self.moe = self.sparse_class(cfg, select_grouped_experts(device))
        sparse = set(cfg.sparse_layers)
        self.ffns = [self.moe if i in sparse else self.mlp for i in range(cfg.num_layers)]
        self._moe_parts: dict[tuple[int, str], torch.Tensor] = {}
        self._moe_seen: dict[tuple[int, str], set[int]] = {}

    def layer_weights_of(self, layer: int) -> Mapping[str, tuple[str, int]]:
        if layer not in self.cfg.sparse_layers:
            return self.layer_weights
        return {k: v for k, v in self.layer_weights.items() if not k.startswith("mlp.")}

    def take_tensor(
        self, key: str, read: Callable[[], torch.Tensor], shape: tuple[int, ...]
    ) -> bool:
        m = _MOE_TENSOR.fullmatch(key)
        if m is None or int(m["layer"]) not in self.cfg.sparse_layers:
            return False
        c, layer = self.full_cfg, int(m["layer"])  # the checkpoint's (whole) experts
        E, inter, D = c.num_experts, c.moe_intermediate_size, c.hidden_size
        if m["router"]:
            self._check(key, shape, (E, D))
            self._moe_parts[(layer, "router")] = read()
            self._moe_seen[(layer, "router")] = {0}
            return True
        if m["shared"]:
            name = m["shared"].removesuffix(".weight")
            si = c.shared_expert_intermediate_size
            want = {"shared_expert.down_proj": (D, si), "shared_expert_gate": (1, D)}
            if not si or (name == "shared_expert_gate" and not c.shared_expert_gate):
                raise ModelLoadError(f"unexpected tensor {key!r}: config.json has no {name}")
            self._check(key, shape, want.get(name, (si, D)))
            self._moe_parts[(layer, name)] = read()
            self._moe_seen[(layer, name)] = {0}
            return True
        if m["packed"]:
            slot = "w_gate_up" if m["packed"] == "gate_up_proj" else "w_down"
            self._check(key, shape, (E, 2 * inter, D) if slot == "w_gate_up" else (E, D, inter))
            self._moe_parts[(layer, slot)] = read()
            self._moe_seen[(layer, slot)] = set(range(2 * E if slot == "w_gate_up" else E))
            return True
        names = EXPERT_CHECKPOINT_NAMES[m["block"]]
        proj, expert = names.get(m["proj"]), int(m["expert"])
        if proj is None or expert >= E:
            raise ModelLoadError(f"unexpected tensor {key!r} for {c.architecture} ({E} experts)")
        slot = "w_down" if proj == "experts.down_proj" else "w_gate_up"
        self._check(key, shape, (D, inter) if slot == "w_down" else (inter, D))
        full = (E, D, inter) if slot == "w_down" else (E, 2 * inter, D)
        t = self._moe_parts.get((layer, slot))
        if t is None:
            t = self._moe_parts[(layer, slot)] = torch.empty(
                full, dtype=self.dtype, device=self.device
            )
        half = 1 if proj == "experts.up_proj" else 0
        rows = slice(half * inter, (half + 1) * inter) if slot == "w_gate_up" else slice(None)
        t[expert, rows] = read()
        self._moe_seen.setdefault((layer, slot), set()).add(expert + half * E)
        return True

    @staticmethod
    def _check(key: str, shape: tuple[int, ...], want: tuple[int, ...]) -> None:
        if tuple(shape) != want:
            raise ModelLoadError(
                f"tensor {key!r} has shape {tuple(shape)}, config.json implies {want}"
            )

    def check_own_tensors(self, src: object) -> None:
        E, c = self.cfg.num_experts, self.cfg
        want = {"router": 1, "w_gate_up": 2 * E, "w_down": E}
        if c.shared_expert_intermediate_size:
            want.update(dict.fromkeys(SHARED_EXPERT_PROJ_NAMES, 1))
        if c.shared_expert_gate:
            want["shared_expert_gate"] = 1
        want.update(dict.fromkeys(("router_bias",) if c.router_bias else (), 1))
        want.update(dict.fromkeys(("b_gate_up", "b_down") if c.expert_bias else (), 1))
        for layer in self.cfg.sparse_layers:
            for slot, n in want.items():
                got = len(self._moe_seen.get((layer, slot), ()))
                if got != n:
                    what = {"router": "the router (gate)", "w_gate_up": "gate/up experts",
                            "w_down": "down experts", "router_bias": "the router's bias",
                            "b_gate_up": "the gate/up experts' bias",
                            "b_down": "the down experts' bias"}.get(slot, slot)  # fmt: skip
                    raise ModelLoadError(
                        f"{src}: layer {layer} is missing {what}: {got} of {n} tensors found"
                    )

    def build_own(self) -> None:
        make = self.make_linear
        assert make is not None
        for layer in self.cfg.sparse_layers:
            L = self.layers[layer]
            bias = self._moe_parts.pop((layer, "router_bias"), None)  # [E]
            L.router = make(self._moe_parts.pop((layer, "router")), bias)  # [E, D]
            L.w_gate_up = self._experts(layer, "w_gate_up", make)  # [E, 2 I, D]
            L.w_down = self._experts(layer, "w_down", make)  # [E, D, I]
            if self.cfg.shared_expert_intermediate_size:
                g, u, dn = (self._moe_parts.pop((layer, p)) for p in SHARED_EXPERT_PROJ_NAMES)
                if self.tp is not None:  # the rank's columns, as the dense MLP's
                    cols = self._shared_cols()
                    g, u, dn = g.index_select(0, cols), u.index_select(0, cols), dn[:, cols]
                L.shared_gate_up = make(torch.cat((g, u)), None)  # [2 Is, D] (Is: the rank's)
                L.shared_down = make(dn.contiguous(), None)  # [D, Is]
            if self.cfg.shared_expert_gate:
                L.shared_gate = make(self._moe_parts.pop((layer, "shared_expert_gate")), None)
            if self.cfg.expert_bias:
                L.b_gate_up = self._experts(layer, "b_gate_up")  # [E, 2 I]
                L.b_down = self._experts(layer, "b_down")  # [E, D] (None: a rank but 0's)
        self._moe_seen.clear()

    def _experts(self, layer: int, slot: str, make: LinearFactory | None = None) -> Any:
        """A layer's expert weights (``make`` given: as the grouped GEMM reads them) or biases
        as this rank holds them."""
        t = self._rank_experts(layer, slot)
        return t if make is None or t is None else self.moe.grouped.prepare(t, make)

    def _rank_experts(self, layer: int, slot: str) -> torch.Tensor | None:
        """A layer's expert weights or biases as this rank holds them (all of them on one
        device; ``TensorParallel.shard_experts``)."""
        t = self._moe_parts.pop((layer, slot))
        return t if self.tp is None else self.tp.shard_experts(slot, t, self.full_cfg)

    def use_grouped_experts(self, grouped: GroupedExperts) -> None:
        """Run the experts on ``grouped`` from now on, each layer's re-prepared for it (a test
        puts Triton's kernel, under its interpreter, into a model built on CPU)."""
        assert self.make_linear is not None
        self.moe.grouped = grouped
        for i in self.cfg.sparse_layers:
            L = self.layers[i]
            for attr in ("w_gate_up", "w_down"):
                w = getattr(L, attr)
                dense = w.dense() if isinstance(w, ExpertLinears) else w  # [E, M, K]
                setattr(L, attr, grouped.prepare(dense, self.make_linear))

    def row_parallel_blocks(self) -> tuple[Any, ...]:
        return (*super().row_parallel_blocks(), self.moe)

    # -- tensor parallelism: each expert's columns (``TensorParallel.shard_experts``) and the
    #    shared expert's, as the dense MLP's (gate/up rows, down's input columns); the shared
    #    expert's gate [1, D] is whole: ``sigmoid(gate(x))`` scales the rank's partial output
    #    before the all-reduce, which is linear, so the sum is the whole expert's output.
    @classmethod
    def shard_config(cls, cfg: ModelConfig, layout: ShardLayout) -> ModelConfig:
        local = super().shard_config(cfg, layout)
        si = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
        if si % layout.size:
            raise ModelLoadError(
                f"--tensor-parallel-size {layout.size}: shared_expert_intermediate_size={si} "
                f"is not a multiple of {layout.size}"
            )
        return replace(local, shared_expert_intermediate_size=si // layout.size) if si else local

    def _shared_cols(self) -> torch.Tensor:
        """The shared expert's columns this rank holds."""
        assert self.tp is not None
        n = self.cfg.shared_expert_intermediate_size  # the rank's
        return torch.arange(self.tp.rank * n, (self.tp.rank + 1) * n)

    def shard_lora(
        self, key: tuple[int, str], a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if key[1] == SHARED_EXPERT_GATE:  # A [r, D], B [1, r]: whole, as the gate
            return a, b
        if key[1] in SHARED_EXPERT_PROJ_NAMES:
            assert self.tp is not None
            return self.tp.cut_lora(key[1], a, b, self._shared_cols(), self.full_cfg)
        return super().shard_lora(key, a, b)

    def run_layers(self, h: torch.Tensor, step: LayerStep) -> torch.Tensor:
        """Llama's pre-norm wiring with each layer's own feed-forward block."""
        return pre_norm_stack(self, h, step, self.ffns)
