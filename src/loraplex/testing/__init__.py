"""Builders for tiny random models and PEFT adapters, used by tests and benchmarks.

Everything is generated locally in a directory the caller owns: no hub downloads. Requires the
``dev`` extra (transformers, peft).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "What is the capital of France? Answer in one word please.",
    "Multi-LoRA serving runs many adapters on one base model at once.",
    "def add(a, b):\n    return a + b\n# numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000",
    "Hello world! How are you today? I am fine, thank you very much.",
    "SELECT name FROM users WHERE id = 42 ORDER BY created_at DESC;",
    "Once upon a time there was a small model that answered every question.",
    '{"answer": "yes", "reason": "because"} THE END. Cheers, the loraplex team.',
]

ARCH_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "gemma3": ("Gemma3Config", "Gemma3ForConditionalGeneration"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    "qwen3_5_vl": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
    "qwen3_5_moe_vl": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration"),
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM"),
    "gemma4": ("Gemma4Config", "Gemma4ForConditionalGeneration"),
    "gemma4_moe_text": ("Gemma4TextConfig", "Gemma4ForCausalLM"),  # enable_moe_block
    "gemma4_moe": ("Gemma4Config", "Gemma4ForConditionalGeneration"),
    "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM"),
    "llama4": ("Llama4Config", "Llama4ForConditionalGeneration"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
}

ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
                      norm_topk_prob=True),
    "mixtral": dict(num_local_experts=16, num_experts_per_tok=2),
    "smollm3": dict(pad_token_id=None),  # its 128004 lies outside a tiny vocabulary
    # a linear-attention layer before each full one (the released models: three), 2 key
    # heads serving 4 value heads
    "qwen3_5": dict(full_attention_interval=2, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=16, linear_value_head_dim=16),
    # ... and a sparse block in every layer: 8 experts of 32, top 2, a gated shared expert of 48
    "qwen3_5_moe": dict(full_attention_interval=2, linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_key_head_dim=16,
                        linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=32, shared_expert_intermediate_size=48),
    "qwen3_5_vl": dict(full_attention_interval=2, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=16,
                       linear_value_head_dim=16),
    "qwen3_5_moe_vl": dict(full_attention_interval=2, linear_num_key_heads=2,
                           linear_num_value_heads=4, linear_key_head_dim=16,
                           linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=32, shared_expert_intermediate_size=48),
    # Gemma 4: a window prompts cross, per-layer inputs of 8 (the real 256 over 262144 tokens)
    "gemma4_text": dict(sliding_window=4, hidden_size_per_layer_input=8),
    "gemma4": dict(sliding_window=4, hidden_size_per_layer_input=8),
    # ... and the MoE block (enable_moe_block, the 26B-A4B's): 8 experts of 32, top 2
    "gemma4_moe_text": dict(sliding_window=4, hidden_size_per_layer_input=8,
                            enable_moe_block=True, num_experts=8, top_k_experts=2,
                            moe_intermediate_size=32),
    "gemma4_moe": dict(sliding_window=4, hidden_size_per_layer_input=8, enable_moe_block=True,
                       num_experts=8, top_k_experts=2, moe_intermediate_size=32),
    # 4 experts (of intermediate_size, the shared expert's width too) in every other layer,
    # dense layers of 96, chunks of 4 on the rope layers (every prompt crosses them), every
    # other layer NoPE with a temperature that moves from position 3 on
    "llama4_text": dict(num_local_experts=4, intermediate_size_mlp=96,
                        interleave_moe_layer_step=2, no_rope_layer_interval=2,
                        attention_chunk_size=4, floor_scale=4, attn_scale=0.5),
    "llama4": dict(num_local_experts=4, intermediate_size_mlp=96, interleave_moe_layer_step=2,
                   no_rope_layer_interval=2, attention_chunk_size=4, floor_scale=4,
                   attn_scale=0.5),
    # 8 experts, top-4; a window of 4 tokens every prompt crosses on the sliding layers
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=4, sliding_window=4),
}  # fmt: skip
"""Config values a family's tiny model takes unless the caller says otherwise (a MoE's expert
count and size: the config classes' defaults, 128 experts of 768, are a real model's)."""

SIZED_DEFAULTS: dict[str, dict[str, str]] = {
    "gemma4_text": {"global_head_dim": "head_dim", "vocab_size_per_layer_input": "vocab_size"},
    "gemma4": {"global_head_dim": "head_dim", "vocab_size_per_layer_input": "vocab_size"},
    "gemma4_moe_text": {"global_head_dim": "head_dim", "vocab_size_per_layer_input": "vocab_size"},
    "gemma4_moe": {"global_head_dim": "head_dim", "vocab_size_per_layer_input": "vocab_size"},
}
"""Config values a family's tiny model sizes after its own (key -> ``head_dim`` or
``vocab_size``), unless the caller says otherwise (Gemma 4's full-layer head size and
per-layer vocabulary default to a real model's 512 and 262144)."""

_TEXT_CONFIGS = {
    "Gemma3Config": "Gemma3TextConfig",
    "Gemma4Config": "Gemma4TextConfig",
    "Llama4Config": "Llama4TextConfig",
    "Qwen3_5Config": "Qwen3_5TextConfig",
    "Qwen3_5MoeConfig": "Qwen3_5MoeTextConfig",
}
"""Multimodal config class -> the text config class it wraps: ``make_random_model`` builds the
text config from its arguments and wraps it with a tiny vision tower (``_wrap_text_config``)."""


def _wrap_text_config(cfg_name: str, text: Any) -> Any:
    """The multimodal ``cfg_name`` config around text config ``text`` with a tiny SigLIP
    vision tower (one layer, 28 px images of 2 x 2 patches, 4 tokens per image), so the saved
    checkpoint really holds vision tensors beside the language model's."""
    import transformers

    if cfg_name == "Gemma4Config":  # a one-layer vision tower of Gemma 4's own kind, no audio
        tower = transformers.Gemma4VisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=64,
        )  # fmt: skip
        return transformers.Gemma4Config(
            text_config=text,
            vision_config=tower,
            audio_config=None,
            tie_word_embeddings=text.tie_word_embeddings,
            initializer_range=text.initializer_range,
        )
    if cfg_name in ("Qwen3_5Config", "Qwen3_5MoeConfig"):  # one tiny vision block
        vision_cls = getattr(transformers, cfg_name.replace("Config", "VisionConfig"))
        tower = vision_cls(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
            out_hidden_size=text.hidden_size, num_position_embeddings=16,
        )  # fmt: skip
        return getattr(transformers, cfg_name)(
            text_config=text.to_dict(), vision_config=tower.to_dict(),
            tie_word_embeddings=text.tie_word_embeddings,
        )  # fmt: skip
    if cfg_name == "Llama4Config":  # one tiny vision layer, its projector and pixel shuffle
        llama4_vision = transformers.Llama4VisionConfig(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
            image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
            projector_output_dim=text.hidden_size,
        )  # fmt: skip
        return transformers.Llama4Config(
            text_config=text, vision_config=llama4_vision,
            tie_word_embeddings=text.tie_word_embeddings,
        )  # fmt: skip
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    return getattr(transformers, cfg_name)(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        tie_word_embeddings=text.tie_word_embeddings,
        initializer_range=text.initializer_range,
    )


ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTN_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP_PROJ = ["gate_proj", "up_proj", "down_proj"]
PHI3_ALL_PROJ = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
"""Phi-3's modules (its checkpoints fuse q/k/v and gate/up; adapters name the fused ones)."""
PHI3_ATTN_PROJ = ["qkv_proj", "o_proj"]
PHI3_MLP_PROJ = ["gate_up_proj", "down_proj"]


def make_tokenizer(out_dir: str | Path, vocab_size: int = 384) -> Any:
    """Train a small byte-level BPE tokenizer with a ChatML template and save it to ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def make_random_model(
    out_dir: str | Path,
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    with_tokenizer: bool = True,
    init_std: float = 0.2,
    max_shard_size: str | None = None,
    **config_overrides: Any,
) -> Path:
    """Save a random ``arch`` causal LM (HF format, safetensors) plus tokenizer to ``out_dir``.

    ``vocab_size`` defaults to the tokenizer's size when a tokenizer is made, else 512;
    ``head_dim`` to ``hidden_size // num_heads`` (whatever the config class's own default:
    Qwen3Config's is 128).
    """
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if with_tokenizer:
        tok = make_tokenizer(out)
        vocab = vocab_size or len(tok)
        eos, bos = tok.eos_token_id, tok.bos_token_id
    else:
        vocab = vocab_size or 512
        eos, bos = 1, 0
    cfg_name, model_name = ARCH_CONFIGS[arch]
    config_overrides = {**ARCH_DEFAULTS.get(arch, {}), **config_overrides}
    sizes = {"head_dim": head_dim or hidden_size // num_heads, "vocab_size": vocab}
    for key, like in SIZED_DEFAULTS.get(arch, {}).items():
        config_overrides.setdefault(key, sizes[like])
    text_name = _TEXT_CONFIGS.get(cfg_name, cfg_name)
    cfg = getattr(transformers, text_name)(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab,
        max_position_embeddings=config_overrides.pop("max_position_embeddings", 512),
        initializer_range=init_std,
        eos_token_id=eos,
        bos_token_id=bos,
        **config_overrides,
    )
    pad = getattr(cfg, "pad_token_id", None)
    if isinstance(pad, int) and pad >= vocab:  # Phi3Config's default (32000) in a tiny vocabulary
        cfg.pad_token_id = None
    if text_name != cfg_name:
        cfg = _wrap_text_config(cfg_name, cfg)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).to(dtype)
    with torch.no_grad():  # norms get non-trivial weights so they are exercised
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))  # Gemma 4's router scales too
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn_like(p))
        for name, b in model.named_buffers():  # Gemma 4's per-layer output scale
            if name.endswith("layer_scalar"):
                b.copy_(1.0 + 0.1 * torch.randn_like(b))
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(out), **kwargs)
    return out


def make_random_adapter(
    base_dir: str | Path,
    out_dir: str | Path,
    *,
    r: int = 8,
    lora_alpha: float | None = None,
    target_modules: list[str] | str = "all-linear",
    use_rslora: bool = False,
    layers_to_transform: list[int] | int | None = None,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    seed: int = 0,
    std: float = 0.05,
    save_format: str = "safetensors",
    target_parameters: list[str] | None = None,
    alora_invocation_tokens: list[int] | None = None,
) -> Path:
    """Create a PEFT LoRA adapter with random non-zero A and B for the model in ``base_dir``
    (``target_parameters``: PEFT's LoRA on parameters, a MoE's packed experts and router;
    ``alora_invocation_tokens``: an activated LoRA)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    cfg = LoraConfig(
        r=r,
        lora_alpha=lora_alpha if lora_alpha is not None else 2 * r,
        target_modules=target_modules,
        use_rslora=use_rslora,
        layers_to_transform=layers_to_transform,
        rank_pattern=rank_pattern or {},
        alpha_pattern=alpha_pattern or {},
        target_parameters=target_parameters,
        alora_invocation_tokens=alora_invocation_tokens,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(std * torch.randn(p.shape, generator=gen))
    out = Path(out_dir)
    model.save_pretrained(str(out), safe_serialization=save_format == "safetensors")
    return out


def make_per_expert_adapter(
    base_dir: str | Path,
    out_dir: str | Path,
    *,
    r: int = 8,
    lora_alpha: float | None = None,
    target_modules: list[str],
    seed: int = 0,
    std: float = 0.05,
) -> Path:
    """A MoE adapter in the layout PEFT wrote when the experts were ``nn.Linear`` modules
    (transformers 4, and most expert adapters on the hub): per-expert keys
    ``...layers.L.mlp.experts.E.gate_proj.lora_A.weight`` (Mixtral:
    ``block_sparse_moe.experts.E.w1``), the router as ``...mlp.gate``, attention as usual; random
    non-zero factors for every module of ``target_modules`` in every layer that has it. PEFT on
    transformers 5 reads this layout through its own conversion (``load_merged_reference``)."""
    from safetensors.torch import save_file

    cfg = json.loads((Path(base_dir) / "config.json").read_text())
    mixtral = cfg["model_type"] == "mixtral"
    block = "block_sparse_moe" if mixtral else "mlp"
    hidden, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    heads, kv = int(cfg["num_attention_heads"]), int(cfg.get("num_key_value_heads") or 0)
    hd = int(cfg.get("head_dim") or hidden // heads)
    n_exp = int(cfg.get("num_local_experts") or cfg.get("num_experts"))
    inter = int(cfg["intermediate_size"] if mixtral else cfg["moe_intermediate_size"])
    step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or [])
    attn = {"q_proj": (hidden, heads * hd), "k_proj": (hidden, kv * hd),
            "v_proj": (hidden, kv * hd), "o_proj": (heads * hd, hidden)}  # fmt: skip
    experts = {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
               "w1": (hidden, inter), "w3": (hidden, inter), "w2": (inter, hidden)}  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}

    def pair(module: str, d_in: int, d_out: int) -> None:
        sd[f"base_model.model.{module}.lora_A.weight"] = std * torch.randn(r, d_in, generator=gen)
        sd[f"base_model.model.{module}.lora_B.weight"] = std * torch.randn(d_out, r, generator=gen)

    for layer in range(layers):
        pre = f"model.layers.{layer}"
        for t in target_modules:
            if t in attn:
                pair(f"{pre}.self_attn.{t}", *attn[t])
        if layer in dense or (layer + 1) % step:  # a dense MLP (Qwen-MoE's mlp_only_layers)
            mlp = {"gate_proj": (hidden, int(cfg["intermediate_size"])),
                   "up_proj": (hidden, int(cfg["intermediate_size"])),
                   "down_proj": (int(cfg["intermediate_size"]), hidden)}  # fmt: skip
            for t in target_modules:
                if t in mlp:
                    pair(f"{pre}.mlp.{t}", *mlp[t])
            continue
        for t in target_modules:
            if t == "gate":
                pair(f"{pre}.{block}.gate", hidden, n_exp)
            elif t in experts:
                for e in range(n_exp):
                    pair(f"{pre}.{block}.experts.{e}.{t}", *experts[t])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out / "adapter_model.safetensors"))
    write_json(
        out / "adapter_config.json",
        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r,
         "lora_alpha": lora_alpha if lora_alpha is not None else 2 * r,
         "target_modules": target_modules, "lora_dropout": 0.0, "bias": "none",
         "base_model_name_or_path": str(base_dir)},
    )  # fmt: skip
    return out


def load_merged_reference(base_dir: str | Path, adapter_dir: str | Path | None) -> Any:
    """transformers model (float32, eval) with the adapter merged in: the correctness reference.

    Unmerged (PEFT's own forward) where merging would write a tied base's one embedding / LM
    head matrix (``merge_writes_tied_matrix``): the adapter means what it did in training."""
    from transformers import AutoModelForCausalLM

    from loraplex.lora.peft.config import merge_writes_tied_matrix
    from loraplex.lora.peft.files import CONFIG_NAME

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
        adapter_cfg = json.loads((Path(adapter_dir) / CONFIG_NAME).read_text())
        base_cfg = json.loads((Path(base_dir) / "config.json").read_text())
        if not merge_writes_tied_matrix(adapter_cfg, base_cfg):
            model = model.merge_and_unload()
    return model.eval()


@torch.no_grad()
def reference_greedy(
    model: Any, prompt_ids: list[int], max_new_tokens: int
) -> tuple[list[int], torch.Tensor]:
    """Greedy-decode with a plain full forward each step; returns (new tokens, logprobs [n, vocab])."""
    ids = list(prompt_ids)
    rows = []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        rows.append(torch.log_softmax(logits, dim=-1))
        ids.append(int(logits.argmax()))
    return ids[len(prompt_ids) :], torch.stack(rows)


def logprob_gap(logprobs: Any, ref: torch.Tensor) -> float:
    """The largest ``|logprob - reference|`` over the engine's sampled steps and their top
    tokens: ``logprobs[step].top`` ({token: logprob}) against ``ref [steps, vocab]``."""
    return max(
        abs(val - float(ref[step, tid]))
        for step, lp in enumerate(logprobs)
        for tid, val in lp.top.items()
    )


@torch.no_grad()
def reference_greedy_alora(
    model: Any, prompt_ids: list[int], max_new_tokens: int, start: int | None
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """:func:`reference_greedy` for a PEFT aLoRA model (unmerged) whose adapter starts at
    prompt position ``start`` (None: not invoked, the base model throughout), passing PEFT's
    ``alora_offsets`` explicitly (a plain forward applies no aLoRA at all in PEFT 0.21).
    Returns (new tokens, their logprobs [n, vocab], prompt logprobs [len(prompt) - 1, vocab]:
    row ``i`` is ``log p(prompt[i + 1] | prompt[: i + 1])``)."""
    ids = list(prompt_ids)
    rows, prompt_rows = [], None
    for _ in range(max_new_tokens):
        offsets = [None if start is None else len(ids) - start]
        logits = model(torch.tensor([ids]), alora_offsets=offsets).logits[0].float()
        if prompt_rows is None:
            prompt_rows = torch.log_softmax(logits[:-1], dim=-1)
        rows.append(torch.log_softmax(logits[-1], dim=-1))
        ids.append(int(logits[-1].argmax()))
    assert prompt_rows is not None
    return ids[len(prompt_ids) :], torch.stack(rows), prompt_rows


def check_greedy(completion: Any, model: Any, prompt_ids: list[int], tol: float) -> None:
    """Assert that a greedy ``completion`` (a ``CompletionOutput`` with logprobs) has the
    tokens of ``model``'s greedy decode of ``prompt_ids`` and every logprob it reports within
    ``tol`` of the model's."""
    want, ref_lp = reference_greedy(model, prompt_ids, len(completion.token_ids))
    assert completion.token_ids == want
    worst = logprob_gap(completion.logprobs, ref_lp)
    assert worst < tol, worst


def write_json(path: str | Path, obj: Any) -> None:
    Path(path).write_text(json.dumps(obj, indent=2))
