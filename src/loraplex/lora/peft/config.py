"""Reading ``adapter_config.json``: every config feature we cannot serve exactly is refused
(:func:`parse_lora_config`, reason ``unsupported_config``), and what the rest selects is a
:class:`~loraplex.lora.peft.targets.LoraSettings`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from loraplex.checkpoint.modules import (
    EXPERT_CHECKPOINT_NAMES,
    FUSED_PROJ_NAMES,
    LAYER_MODULE_ORDER,
    PACKED_EXPERT_PARAMS,
    VOCAB_MODULES,
    vocab_module_key,
)
from loraplex.lora.peft.activation import invocation_tokens
from loraplex.lora.peft.errors import FormatError
from loraplex.lora.peft.targets import LoraSettings, is_finite_number

UNSUPPORTED_FIELDS: dict[str, str] = {
    "use_dora": "DoRA adapters are not supported",
    "modules_to_save": "full replacement weights (modules_to_save) are not served, only LoRA A/B",
    "lora_bias": "LoRA bias terms are not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights) is not supported",
    "layer_replication": "layer_replication is not supported",
    "use_qalora": "QA-LoRA adapters are not supported",
    "trainable_token_indices": "trainable tokens (trainable_token_indices) are not supported",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
    "arrow_config": "Arrow routing (arrow_config) is not supported",
    "kasa_config": "KaSA adapters (kasa_config) are not supported",
    "monteclora_config": "MonteCLoRA adapters (monteclora_config) are not supported",
}
"""Fields whose presence (truthy value) means a variant we cannot serve as W + scale * B @ A."""

BASE_MODIFYING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
"""``init_lora_weights`` values that rewrite the base weights at init: such an adapter only fits
the modified base unless PEFT converted it on save (which resets init_lora_weights to True)."""

TARGET_PARAMETER_SUFFIXES = ("experts.gate_up_proj", "experts.down_proj", "gate.weight")
"""What a ``target_parameters`` entry may name (or a dotted suffix of it: PEFT's conversion of
an older adapter config writes bare ``gate_up_proj`` / ``down_proj``): the packed experts, or
the router's weight."""


def _str_or_str_list(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))


def _config_error(message: str) -> FormatError:
    return FormatError("unsupported_config", message)


def parse_lora_config(config: Mapping[str, Any]) -> LoraSettings:
    """Refuse every config feature we cannot serve exactly (``FormatError``, reason
    ``unsupported_config``); return the targeting settings."""
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise _config_error(f"peft_type must be 'LORA', got {peft_type!r}")
    for name, why in UNSUPPORTED_FIELDS.items():
        value = config.get(name)
        if value and name == "modules_to_save":
            modules = ", ".join(map(str, value)) if isinstance(value, list) else str(value)
            raise _config_error(
                f"modules_to_save={value!r}: full replacement weights for {modules} are not "
                "served, only LoRA A/B"
            )
        if value:
            raise _config_error(f"{name}={value!r}: {why}")
    bias = config.get("bias", "none")
    if bias != "none":
        raise _config_error(f"bias={bias!r}: only bias='none' is supported")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(BASE_MODIFYING_INITS):
        raise _config_error(
            f"init_lora_weights={init!r}: this adapter expects a modified base model; convert it "
            "with save_pretrained(path_initial_model_for_weight_conversion=...) first",
        )

    r = config.get("r", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise _config_error(f"r must be a positive integer, got {r!r}")
    alpha = config.get("lora_alpha", 8)
    if not is_finite_number(alpha):
        raise _config_error(f"lora_alpha must be a number, got {alpha!r}")
    use_rslora = config.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise _config_error(f"use_rslora must be a boolean, got {use_rslora!r}")
    rank_pattern = config.get("rank_pattern") or {}
    if not isinstance(rank_pattern, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in rank_pattern.values()
    ):
        raise _config_error(
            f"rank_pattern must map patterns to positive ints, got {rank_pattern!r}"
        )
    alpha_pattern = config.get("alpha_pattern") or {}
    if not isinstance(alpha_pattern, dict) or not all(
        is_finite_number(v) for v in alpha_pattern.values()
    ):
        raise _config_error(f"alpha_pattern must map patterns to numbers, got {alpha_pattern!r}")
    target = config.get("target_modules")
    params = config.get("target_parameters")
    if params is not None and not (
        isinstance(params, list) and all(isinstance(p, str) and p for p in params)
    ):
        raise _config_error(f"target_parameters must be a list of strings, got {params!r}")
    for param in params or ():
        if param.rsplit(".", 1)[-1] not in PACKED_EXPERT_PARAMS and not (
            param == "gate.weight" or param.endswith(".gate.weight")
        ):
            raise _config_error(
                f"target_parameters entry {param!r} is not supported (supported: the packed "
                f"experts and the router of a MoE base: {', '.join(TARGET_PARAMETER_SUFFIXES)})"
            )
    if not (target or params) or (target and not _str_or_str_list(target)):
        raise _config_error(f"target_modules must be a string or list of strings, got {target!r}")
    exclude = config.get("exclude_modules")
    if exclude is not None and not _str_or_str_list(exclude):
        raise _config_error(f"exclude_modules must be a string or list of strings, got {exclude!r}")
    layers = config.get("layers_to_transform")
    if layers is not None and not (
        (isinstance(layers, int) and not isinstance(layers, bool))
        or (isinstance(layers, list) and all(isinstance(i, int) for i in layers))
    ):
        raise _config_error(f"layers_to_transform must be an int or list of ints, got {layers!r}")
    pattern = config.get("layers_pattern")
    if pattern is not None and not _str_or_str_list(pattern):
        raise _config_error(f"layers_pattern must be a string or list of strings, got {pattern!r}")
    for name, value in (("target_modules", target), ("exclude_modules", exclude)):
        if isinstance(value, str):
            try:
                re.compile(value)
            except re.error as e:
                raise _config_error(f"{name} is not a valid regex {value!r}: {e}") from e
    settings = LoraSettings.of(config)
    tied = [m for m in VOCAB_MODULES if settings.is_targeted(vocab_module_key(m))]
    if config.get("ensure_weight_tying") and tied:
        raise _config_error(
            f"ensure_weight_tying=True with {' and '.join(tied)} targeted: one LoRA shared "
            "by a tied embedding and LM head is not supported"
        )
    if invocation_tokens(config) is not None:
        _check_alora_targets(settings)
    return settings


def _check_alora_targets(settings: LoraSettings) -> None:
    """PEFT applies aLoRA's activation mask on linear layers only: an aLoRA adapter on the
    embedding (or on packed experts) would be adapted before its activation point there, which
    no served path reproduces; refuse it."""
    if settings.is_targeted(vocab_module_key("embed_tokens")):
        raise _config_error(
            "alora_invocation_tokens with embed_tokens targeted: activated LoRA applies to "
            "linear layers only (PEFT's aLoRA variant); an embedding LoRA is not supported"
        )
    if settings.target_parameters:
        raise _config_error(
            f"alora_invocation_tokens with target_parameters={list(settings.target_parameters)}:"
            " activated LoRA on packed experts or the router is not supported"
        )


def merge_writes_tied_matrix(config: Mapping[str, Any], base_config: Mapping[str, Any]) -> bool:
    """Whether PEFT's ``merge_and_unload`` of this adapter (its ``adapter_config.json``) would
    write the one matrix a tied base (``tie_word_embeddings``) shares between its embedding and
    LM head: a LoRA on either would then reach the other too. The adapter means what it did in
    training, the unmerged PEFT model: LoRA on the tied head on the logits only, on the
    embedding in the lookup only (what loraplex serves)."""
    text = base_config.get("text_config")
    tied = base_config.get("tie_word_embeddings")
    if tied is None and isinstance(text, Mapping):
        tied = text.get("tie_word_embeddings")
    if not tied:
        return False
    try:
        settings = parse_lora_config(config)
    except FormatError:
        return False
    return any(settings.is_targeted(vocab_module_key(m)) for m in VOCAB_MODULES)


def unservable_targets(target_modules: Any) -> list[Any]:
    """Entries of a ``target_modules`` list that name no module we serve (GPT-2's ``c_attn``,
    non-strings; not the seven projections, ``embed_tokens``, ``lm_head``, a MoE's router
    ``gate`` or its experts' ``gate_proj`` / ``w1`` ...). The registry
    refuses adapters whose config names such modules; the loader only refuses their tensors."""
    if not isinstance(target_modules, list):
        return []
    experts = {name for names in EXPERT_CHECKPOINT_NAMES.values() for name in names}
    servable = (*LAYER_MODULE_ORDER, *FUSED_PROJ_NAMES, *VOCAB_MODULES, *experts)
    return [t for t in target_modules if not isinstance(t, str) or t.split(".")[-1] not in servable]
