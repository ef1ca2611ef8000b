"""``loraplex plan``: capacity planning for LoRA serving, from shapes alone (no torch, no weights).

    loraplex plan --model llama-3-8b --rank 16 --targets q_proj,v_proj --device-budget 2GiB \\
        --num-adapters 1000 --host-budget 64GiB
    loraplex plan --model /models/llama3/config.json --adapter /adapters/sql --adapter /adapters/fr

For a Llama-family base (a model directory, its ``config.json``, or a preset) and adapters
(PEFT directories / ``adapter_config.json`` files / JSON manifests with ``r`` or ``rank`` and
``target_modules``, or ``--rank``/``--targets``), it computes:

- bytes per adapter: for every adapted projection of every adapted layer, r x (d_in + d_out)
  parameters (A is [r, d_in], B is [d_out, r]) times the dtype's bytes; ``embed_tokens`` and
  ``lm_head`` once each, r x (vocab + hidden);
- device slots: a slot holds any adapter up to ``max_lora_rank`` for the union of targets, so a
  slot is ``max_lora_rank`` x (d_in + d_out) per module; how many slots a device budget buys
  and how many KV-cache tokens that memory would have held instead
  (KV bytes/token = 2 x layers x kv_heads x head_dim x dtype bytes); beside it what
  ``loraplex serve`` allocates per slot (every projection, and ``embed_tokens`` and ``lm_head``
  whatever the adapters target: ``max_lora_rank`` x 2 x (vocab + hidden) of it);
- host and disk: bytes for N adapters, or how many fit a budget;
- the decode byte model: a decode step reads the base weights once (every linear layer and the
  LM head; the embedding is a gather) plus the A and B of each distinct adapter in the batch
  (of an embedding LoRA only B: its A is gathered by token id like the embedding), so k distinct
  adapters add k x an adapter's decode bytes, shown as a share of the base weight traffic.

A mixture-of-experts base (``Qwen3MoeForCausalLM``, ``MixtralForCausalLM``: its sparse layers
hold a router ``gate [E, hidden]`` and E experts of ``gate_proj``/``up_proj``/``down_proj``):

- weights count every expert; a token reads ``num_experts_per_tok`` (top-k) of them per sparse
  layer, a step of T tokens at most ``min(E, T x top_k)`` (an upper bound: every token is taken
  to choose experts no other token chose, as far as there are any). The decode model reports
  both ends: *one token per adapter* (k adapters, k tokens: the base reads
  ``min(E, k x top_k)`` experts per sparse layer, each adapter the LoRA of its token's top-k)
  and *a full batch* of ``--decode-batch`` tokens spread evenly over the k adapters;
- an adapter on the experts, per-expert keys (``mlp.experts.{e}.gate_proj``, Mixtral's
  ``block_sparse_moe.experts.{e}.w1``) or PEFT's ``target_parameters`` on the packed experts
  (``mlp.experts.gate_up_proj``: one A ``[E r, hidden]`` and B ``[2 I, E r]``), costs
  r x (d_in + d_out) per adapted expert, E times what the same rank costs on one dense
  projection: each adapter's bytes are reported by part (attention, dense MLP, router, experts,
  embed_tokens/lm_head), so an expert adapter's size is plain. A config alone that names the
  experts' projections (``gate_proj``..., ``w1``..., ``all-linear``) is priced per expert, the
  layout PEFT saved while experts were linears (a note says that PEFT on transformers 5 trains
  them packed, ``gate_up_proj`` at rank 2r); an adapter directory is priced as saved (an
  ``all-linear`` one by the experts and router its weights hold);
- a slot (and the engine's bank) holds every expert's rows of every expert projection:
  ``max_lora_rank x E x (d_in + d_out)`` per expert projection per sparse layer, as the slot

Modules: ``model_shape`` (the base), ``adapter_shape`` (an adapter on it), ``capacity`` (the byte
model: :func:`build_plan`), ``report`` (:func:`render_plan`) and ``cli`` (``loraplex plan``).
"""

from loraplex.tools.plan.adapter_shape import (
    PART_NAMES,
    PARTS,
    PER_EXPERT_NOTE,
    AdapterShape,
    adapter_from_config,
    adapter_from_path,
    part_of,
)
from loraplex.tools.plan.capacity import (
    DEFAULT_DECODE_BATCH,
    DTYPE_BYTES,
    QUANT_BITS,
    build_plan,
    projection_bytes_per_param,
)
from loraplex.tools.plan.cli import build_parser, main
from loraplex.tools.plan.model_shape import (
    MOE_ARCHITECTURES,
    PACKED_GATE_UP,
    PRESETS,
    ModelShape,
    PlanError,
    load_model,
    model_from_config,
)
from loraplex.tools.plan.report import render_plan

__all__ = [
    "DEFAULT_DECODE_BATCH",
    "DTYPE_BYTES",
    "MOE_ARCHITECTURES",
    "PACKED_GATE_UP",
    "PARTS",
    "PART_NAMES",
    "PER_EXPERT_NOTE",
    "PRESETS",
    "QUANT_BITS",
    "AdapterShape",
    "ModelShape",
    "PlanError",
    "adapter_from_config",
    "adapter_from_path",
    "build_parser",
    "build_plan",
    "load_model",
    "main",
    "model_from_config",
    "part_of",
    "projection_bytes_per_param",
    "render_plan",
]
