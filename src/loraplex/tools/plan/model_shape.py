"""What the planner needs of a base model: its shape from a ``config.json`` (through the served
architecture's own parse where there is one) or a preset, and the parameters of its parts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.checkpoint.modules import (
    EXPERT_CHECKPOINT_NAMES,
    EXPERT_PROJ_NAMES,
    FUSED_BY_MODEL_TYPE,
    FUSED_PROJ_NAMES,
    GATED_Q_MODEL_TYPES,
    LINEAR_ATTN_PROJ_NAMES,
    PACKED_EXPERT_PARAMS,
    PER_LAYER_INPUT_PROJ_NAMES,
    PER_LAYER_MODEL_PROJECTION,
    PROJ_NAMES,
    ROUTER,
    SHARED_EXPERT_GATE,
    SHARED_EXPERT_PROJ_NAMES,
    VOCAB_MODULES,
    LinearAttentionSpec,
    MoESpec,
    projection_shapes,
    vocab_module_shapes,
)
from loraplex.kv.groups import (
    Window,
    blocks_per_sequence,
    kv_cache_groups,
    layers_per_group,
    layers_per_state_group,
    state_pages_per_sequence,
)
from loraplex.lora import digest

PACKED_GATE_UP = "experts.gate_up_proj"
"""PEFT's ``target_parameters`` LoRA on the packed ``mlp.experts.gate_up_proj`` as the planner
names it: one A ``[E r, hidden]`` for gate and up and one B over both (the engine splits it into
``experts.gate_proj`` and ``experts.up_proj``, A copied to each)."""
ALL_FUSED: dict[str, tuple[str, ...]] = {
    **FUSED_PROJ_NAMES,
    PACKED_GATE_UP: PACKED_EXPERT_PARAMS["gate_up_proj"],
}
MOE_ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
"""``model_type`` -> the mixture-of-experts architecture served for it."""
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


class PlanError(ValueError):
    """Bad planner input; the message names the problem."""


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a Llama-family config (or a mixture-of-experts one)."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int  # the dense MLP's (a MoE base's dense layers, if any)
    vocab_size: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    layer_norm_params: int = 0  # 0: Llama's two norms of hidden_size per layer
    layer_bias_params: int = 0
    text_only: bool = False  # a multimodal checkpoint's language model (other towers unserved)
    fused: tuple[str, ...] = ()  # the checkpoint's fused modules (Phi-3's qkv_proj, gate_up_proj)
    num_experts: int = 0  # experts per sparse layer (0: a dense model)
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # one expert's
    sparse_layers: tuple[int, ...] | None = None  # the sparse layers (None: all, when MoE)
    moe_block: str = "mlp"  # the sparse block's checkpoint name (Mixtral's block_sparse_moe)
    layer_windows: tuple[Window, ...] = ()  # each layer's sliding window / chunk (empty: none)
    linear: LinearAttentionSpec | None = None  # a hybrid's linear-attention layers (Qwen3.5)
    gated_q: bool = False  # q_proj also yields a per-head output gate ([2 q, hidden])
    per_layer_input: int = 0  # Gemma 4's per-layer stream width P (0: none)
    per_layer_vocab: int = 0  # ... and its embedding's vocabulary
    layer_modules: tuple[dict[str, tuple[int, int]], ...] = ()
    """Each layer's modules -> (d_in, d_out) where layers differ (Gemma 4's head sizes, MLP
    widths, KV-sharing layers, per-layer input modules; a hybrid's linear-attention layers:
    ``ModelConfig.layer_modules``)."""
    layer_norms: tuple[int, ...] = ()  # each layer's norm parameters, where they differ
    kv_width: int = 0  # a KV slot's values: the widest layer's kv heads x head_dim (0: alike)
    layer_windows: tuple[Window, ...] = ()  # each layer's sliding window / chunk (empty: none)
    shared_intermediate: int = 0  # a sparse block's shared expert's width (0: none)
    packed_in_out: bool = False  # packed experts stored [E, in, out] (Llama 4)
    router_name: str = ROUTER  # the router's module name (Llama 4: router)
    shared_gate: bool = False  # a one-output gate of the shared expert (Qwen-MoE's)
    dense_mlp: bool = False  # the sparse layers keep their dense MLP beside the block (Gemma 4)
    packed_only: bool = False  # no per-expert modules in any transformers (Qwen3.5-MoE, GPT-OSS)

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def sparse(self) -> tuple[int, ...]:
        """The layers whose MLP is a sparse block (none for a dense model)."""
        if not self.is_moe:
            return ()
        return tuple(range(self.num_layers)) if self.sparse_layers is None else self.sparse_layers

    @property
    def moe(self) -> MoESpec | None:
        """The sparse blocks (None: dense)."""
        if not self.is_moe:
            return None
        return MoESpec(
            self.num_experts, self.sparse, self.hidden_size, self.moe_intermediate_size,
            self.moe_block, self.shared_intermediate, self.packed_in_out, self.router_name,
            self.shared_gate, dense_mlp=self.dense_mlp, packed_only=self.packed_only,
        )  # fmt: skip

    @property
    def adapter_projs(self) -> tuple[str, ...]:
        """The modules of a layer an adapter for this base names: the seven projections, with
        each fused module in place of its parts."""
        out: list[str] = []
        for p in PROJ_NAMES:
            f = next((f for f in self.fused if p in FUSED_PROJ_NAMES[f]), p)
            if f not in out:
                out.append(f)
        return (*out, *(PER_LAYER_INPUT_PROJ_NAMES if self.per_layer_input else ()))

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """What ``target_modules`` may name on this base (for messages): the layers' modules
        (a MoE's router and per-expert projections too) and the vocabulary modules."""
        names = list(self.adapter_projs)
        if self.linear is not None:
            names += LINEAR_ATTN_PROJ_NAMES
        if self.is_moe:
            names += [self.router_name, *EXPERT_CHECKPOINT_NAMES[self.moe_block]]
        return tuple(dict.fromkeys([*names, *self.outer_modules]))

    @property
    def outer_modules(self) -> tuple[str, ...]:
        """The adaptable modules outside the layers: the vocabulary's (and Gemma 4's
        ``per_layer_model_projection``)."""
        return (*VOCAB_MODULES, *((PER_LAYER_MODEL_PROJECTION,) if self.per_layer_input else ()))

    def layer_adapter_projs(self, layer: int) -> tuple[str, ...]:
        """:attr:`adapter_projs` of ``layer`` (a Gemma 4 KV-sharing layer has no k/v)."""
        return tuple(self.layer_modules[layer]) if self.layer_modules else self.adapter_projs

    def layer_projs(self, layer: int) -> tuple[str, ...]:
        """The modules of ``layer`` as the engine holds them (fused ones split): the seven
        projections, or a sparse layer's attention, router and three expert projections; where
        layers differ (Gemma 4, a hybrid's linear-attention layers), the layer's own."""
        if self.layer_modules:
            return tuple(self.layer_modules[layer])
        if layer in self.sparse:
            shared = SHARED_EXPERT_PROJ_NAMES if self.shared_intermediate else ()
            return (*PROJ_NAMES[:4], ROUTER, *EXPERT_PROJ_NAMES, *shared)
        return PROJ_NAMES

    def experts_of(self, proj: str) -> int:
        """How many times a module's ``(d_in, d_out)`` is held: E for an expert projection (the
        slot bank's ``E x capacity`` rows), else 1."""
        return self.num_experts if proj.startswith("experts.") else 1

    def dims(self, proj: str, layer: int | None = None) -> tuple[int, int]:
        """(d_in, d_out) of a projection (in ``layer``, where layers differ), of a fused module
        (its parts' rows), of ``embed_tokens`` / ``lm_head``, or of a sparse layer's router and
        expert projections (one expert's)."""
        if layer is not None and layer >= 0 and self.layer_modules:
            own = self.layer_modules[layer].get(proj)
            if own is not None:
                return own
        if proj in VOCAB_MODULES:
            return vocab_module_shapes(self.vocab_size, self.hidden_size)[proj]
        d, p = self.hidden_size, self.per_layer_input
        if p and proj in (*PER_LAYER_INPUT_PROJ_NAMES, PER_LAYER_MODEL_PROJECTION):
            return {"per_layer_input_gate": (d, p), "per_layer_projection": (p, d),
                    PER_LAYER_MODEL_PROJECTION: (d, self.num_layers * p)}[proj]  # fmt: skip
        if proj in ALL_FUSED:
            parts = [self.dims(q) for q in ALL_FUSED[proj]]
            return parts[0][0], sum(d_out for _, d_out in parts)
        if proj in LINEAR_ATTN_PROJ_NAMES:
            if self.linear is None:
                raise PlanError(f"{self.name} has no linear-attention layers: it has no {proj}")
            return self.linear.shapes[proj]
        if proj in (ROUTER, *EXPERT_PROJ_NAMES, *SHARED_EXPERT_PROJ_NAMES, SHARED_EXPERT_GATE):
            moe = self.moe
            if moe is None:
                raise PlanError(f"{self.name} is not a mixture-of-experts model: it has no {proj}")
            return moe.shapes[proj]
        shapes = projection_shapes(
            self.hidden_size, self.num_heads, self.num_kv_heads, self.hd, self.intermediate_size
        )
        if self.gated_q:
            shapes["q_proj"] = (self.hidden_size, 2 * self.num_heads * self.hd)
        return shapes[proj]

    def expert_params(self) -> int:
        """Parameters of one expert of a sparse layer (its three projections; 0: dense)."""
        return sum(math.prod(self.dims(p)) for p in EXPERT_PROJ_NAMES) if self.is_moe else 0

    def linear_params(self) -> int:
        """Parameters of every projection of every layer, a sparse layer's router, all its
        experts and its shared expert (no norms, embeddings or head)."""
        if self.layer_modules:  # layers differ: each its own (a sparse layer's experts E times)
            out = sum(
                math.prod(self.dims(p, i)) * self.experts_of(p)
                for i in range(self.num_layers)
                for p in self.layer_projs(i)
            )
            if self.per_layer_input:
                out += math.prod(self.dims(PER_LAYER_MODEL_PROJECTION))
            return out
        n_sparse = len(self.sparse)
        dense = (i for i in range(self.num_layers) if i not in self.sparse)
        out = sum(math.prod(self.dims(p, i)) for i in dense for p in self.layer_projs(i))
        if self.per_layer_input:
            out += math.prod(self.dims(PER_LAYER_MODEL_PROJECTION))
        if n_sparse:
            attn = sum(math.prod(self.dims(p)) for p in PROJ_NAMES[:4])
            router = math.prod(self.dims(ROUTER))
            shared = SHARED_EXPERT_PROJ_NAMES if self.shared_intermediate else ()
            attn += sum(math.prod(self.dims(p)) for p in shared)
            out += n_sparse * (attn + router + self.num_experts * self.expert_params())
        return out

    def _layer_extras(self) -> int:
        """A layer's norm and bias parameters (a linear-attention layer's: its two norms, its
        convolution, decay and gated norm), and the final norm."""
        norms = self.layer_norm_params or 2 * self.hidden_size
        every = sum(self.layer_norms) if self.layer_norms else self.num_layers * norms
        stream = self.per_layer_input  # Gemma 4's per-layer stream's norm
        return every + self.num_layers * self.layer_bias_params + self.hidden_size + stream

    def params(self) -> int:
        """All parameters: projections (every expert), biases, norms, embedding, LM head
        (unless tied)."""
        emb = self.vocab_size * self.hidden_size
        return (
            self.linear_params()
            + self._layer_extras()
            + emb * (1 if self.tie_word_embeddings else 2)
            + self.per_layer_vocab * self.num_layers * self.per_layer_input  # Gemma 4's lookup
        )

    def experts_read(self, tokens: int) -> int:
        """Experts a step of ``tokens`` tokens reads per sparse layer, at most (every token
        choosing experts no other token chose while there are any): min(E, tokens x top-k)."""
        return min(self.num_experts, tokens * self.num_experts_per_tok)

    def _idle_expert_params(self, tokens: int) -> int:
        idle = self.num_experts - self.experts_read(tokens)
        return len(self.sparse) * idle * self.expert_params()

    def active_params(self) -> int:
        """Parameters one token reads: all but the experts it does not choose (top-k of E per
        sparse layer: the "A3B" of Qwen3-30B-A3B; every parameter of a dense model)."""
        return self.params() - self._idle_expert_params(1)

    def decode_read_params(self, tokens: int = 1) -> int:
        """Parameters a decode step of ``tokens`` tokens reads in full: projections (of a
        sparse layer at most :meth:`experts_read` experts), biases, norms and the LM head (the
        embedding is a gather of a few rows; a tied head reads the embedding matrix)."""
        return (
            self.linear_params()
            - self._idle_expert_params(tokens)
            + self._layer_extras()
            + self.vocab_size * self.hidden_size
        )

    @property
    def kv_row(self) -> int:
        """Values of one layer's K (or V) at one position as the cache holds them (every slot
        as wide as the widest layer's, ``PagedKVCache``)."""
        return self.kv_width or self.num_kv_heads * self.hd

    @property
    def attention_layers(self) -> int:
        """Layers that keep KV (all but a hybrid's linear-attention layers)."""
        return self.num_layers - (len(self.linear.layers) if self.linear is not None else 0)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.attention_layers * self.kv_row * dtype_bytes

    def _groups(self) -> list:
        windows = self.layer_windows or [None] * self.num_layers
        return kv_cache_groups(windows, 1, self.linear.layers if self.linear else ())

    def kv_bytes_per_sequence(self, tokens: int, dtype_bytes: int, block_size: int = 16) -> int:
        """KV bytes one decoding sequence of ``tokens`` tokens holds: blocks of the engine's
        KV-cache groups (windowed layers keep only their window's blocks) times the page of a
        group's layers (``loraplex.kv.groups``), plus a hybrid's recurrent state pages."""
        groups = self._groups()
        page = 2 * layers_per_group(groups) * block_size * self.kv_row
        kv = blocks_per_sequence(groups, tokens, block_size) * page * dtype_bytes
        return kv + self.state_bytes_per_sequence(tokens, dtype_bytes, block_size)

    def state_bytes_per_sequence(self, tokens: int, dtype_bytes: int, block_size: int = 16) -> int:
        """Bytes of the recurrent state pages one decoding sequence holds (0: no linear
        attention): the convolution window in the model dtype, the state matrix in float32."""
        lin = self.linear
        if lin is None:
            return 0
        groups = self._groups()
        conv = (2 * lin.key_heads * lin.key_dim + lin.value_heads * lin.value_dim) * (
            lin.kernel - 1
        )
        per_layer = conv * dtype_bytes + lin.value_heads * lin.key_dim * lin.value_dim * 4
        pages = state_pages_per_sequence(groups, tokens, block_size)
        return pages * layers_per_state_group(groups) * per_layer


# every layer sparse: 128 experts of 768, top-8; Qwen3's q/k norms of head_dim
_QWEN3_30B_A3B = ModelShape("qwen3-30b-a3b", 2048, 48, 32, 4, 6144, 151936, 128,
                            layer_norm_params=2 * 2048 + 2 * 128, num_experts=128,
                            num_experts_per_tok=8, moe_intermediate_size=768)  # fmt: skip
_MIXTRAL_8X7B = ModelShape("mixtral-8x7b", 4096, 32, 32, 8, 14336, 32000, num_experts=8,
                           num_experts_per_tok=2, moe_intermediate_size=14336,
                           moe_block="block_sparse_moe")  # fmt: skip
PRESETS: dict[str, ModelShape] = {
    p.name: p
    for p in (
        ModelShape("llama-3-8b", 4096, 32, 32, 8, 14336, 128256),
        ModelShape("llama-3.1-8b", 4096, 32, 32, 8, 14336, 128256),
        ModelShape("llama-3-70b", 8192, 80, 64, 8, 28672, 128256),
        ModelShape("llama-2-7b", 4096, 32, 32, 32, 11008, 32000),
        ModelShape("llama-2-13b", 5120, 40, 40, 40, 13824, 32000),
        ModelShape("mistral-7b", 4096, 32, 32, 8, 14336, 32000),
        ModelShape("qwen2-7b", 3584, 28, 28, 4, 18944, 152064),
        ModelShape("smollm2-135m", 576, 30, 9, 3, 1536, 49152, 64, True),
        _QWEN3_30B_A3B,
        _MIXTRAL_8X7B,
    )
}


def _positive(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _architecture(archs: list[str], raw: dict[str, Any]) -> Any:
    """The served architecture class of the first of ``archs`` loraplex serves, for
    ``config.json`` ``raw``."""
    from loraplex.model.registry import ARCHITECTURES, model_class

    return next(model_class(a, raw) for a in archs if a in ARCHITECTURES)


def model_from_config(cfg: dict[str, Any], name: str) -> ModelShape:
    """The shape of a ``config.json``: through the architecture's own parse where it names one
    we serve (its norms, biases, a multimodal checkpoint's ``text_config``, a MoE's sparse
    blocks; a MoE ``model_type`` we serve without ``architectures`` counts as naming it), else
    read as a Llama-family config. A mixture-of-experts config of another architecture is
    refused: its experts would be left out of every count."""
    from loraplex.model.config import parse_model_config
    from loraplex.model.registry import ARCHITECTURES

    archs = cfg.get("architectures") or []
    if not archs and cfg.get("model_type") in MOE_ARCHITECTURES:
        cfg = {**cfg, "architectures": [MOE_ARCHITECTURES[str(cfg["model_type"])]]}
        archs = cfg["architectures"]
    if any(a in ARCHITECTURES for a in archs):
        from loraplex.types import ModelLoadError

        try:
            mc = parse_model_config(cfg, source=name)
        except ModelLoadError as e:
            raise PlanError(str(e)) from None
        moe = mc.moe_spec()
        return ModelShape(
            name=name,
            hidden_size=mc.hidden_size,
            num_layers=mc.num_layers,
            num_heads=mc.num_heads,
            num_kv_heads=mc.num_kv_heads,
            intermediate_size=mc.intermediate_size,
            vocab_size=mc.vocab_size,
            head_dim=mc.head_dim,
            tie_word_embeddings=mc.tie_word_embeddings,
            dtype=str(mc.torch_dtype or "bfloat16"),
            layer_norm_params=sum(mc.layer_norm_widths),
            layer_bias_params=mc.layer_bias_params(),
            text_only=isinstance(cfg.get("text_config"), dict),
            fused=FUSED_BY_MODEL_TYPE.get(mc.model_type, ()),
            num_experts=moe.num_experts if moe else 0,
            num_experts_per_tok=int(getattr(mc, "num_experts_per_tok", 0)) if moe else 0,
            moe_intermediate_size=moe.intermediate if moe else 0,
            sparse_layers=tuple(moe.layers) if moe else None,
            moe_block=moe.block if moe else "mlp",
            layer_windows=tuple(_architecture(archs, cfg).windows_of(mc)),
            linear=mc.linear_spec(),
            gated_q=mc.model_type in GATED_Q_MODEL_TYPES,
            per_layer_input=int(getattr(mc, "hidden_size_per_layer_input", 0)),
            per_layer_vocab=int(getattr(mc, "vocab_size_per_layer_input", 0)),
            layer_modules=mc.layer_modules(),
            layer_norms=tuple(mc.layer_norm_params(i) for i in range(mc.num_layers)),
            kv_width=max(kvh * hd for kvh, hd in mc.kv_layer_shapes()),
            shared_intermediate=moe.shared_intermediate if moe else 0,
            packed_in_out=moe.packed_in_out if moe else False,
            router_name=moe.router_name if moe else ROUTER,
            shared_gate=moe.shared_gate if moe else False,
            dense_mlp=moe.dense_mlp if moe else False,
            packed_only=moe.packed_only if moe else False,
        )
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    if any(_positive(text.get(k)) for k in _MOE_KEYS):
        what = ", ".join(map(str, archs)) or f"model_type {cfg.get('model_type')!r}"
        raise PlanError(
            f"{name}: a mixture-of-experts config ({what}) of an architecture loraplex does not "
            f"serve (MoE bases served: {', '.join(MOE_ARCHITECTURES.values())})"
        )
    try:
        heads = int(cfg["num_attention_heads"])
        shape = ModelShape(
            name=name,
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            head_dim=int(cfg.get("head_dim") or 0),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        )
    except KeyError as e:
        raise PlanError(
            f"{name}: config has no {e.args[0]!r} (is it a Llama-family config?)"
        ) from None
    except (TypeError, ValueError) as e:
        raise PlanError(f"{name}: bad value in config ({e})") from None
    if min(shape.hidden_size, shape.num_layers, heads, shape.num_kv_heads,
           shape.intermediate_size, shape.vocab_size) < 1:  # fmt: skip
        raise PlanError(f"{name}: config sizes must be >= 1")
    return shape


def load_model(spec: str) -> ModelShape:
    """A preset name, a model directory, or a ``config.json`` path."""
    if spec.lower() in PRESETS:
        return PRESETS[spec.lower()]
    p = Path(spec)
    cfg_path = p / "config.json" if p.is_dir() else p
    if not cfg_path.is_file():
        raise PlanError(
            f"--model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a model directory "
            "or config.json"
        )
    cfg = read_json_object(cfg_path)
    return model_from_config(cfg, p.name if p.is_dir() else p.parent.name or str(p))


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file holding an object (a config or a manifest: ``lora.digest``'s reader); a
    :class:`PlanError` else."""
    try:
        return digest.read_json_object(path, str(path))[1]
    except OSError as e:
        raise PlanError(f"cannot read {path}: {e}") from None
    except digest.DigestError as e:
        raise PlanError(str(e)) from None
