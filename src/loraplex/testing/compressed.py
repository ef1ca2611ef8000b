"""compressed-tensors checkpoints for tests, written the way llm-compressor writes them, with
the float reference every test compares against.

``write_compressed_tensors`` reproduces llm-compressor's data-free
``oneshot(model, recipe=QuantizationModifier(targets="Linear", scheme=SCHEME,
ignore=["lm_head"]))`` + ``save_pretrained(out, save_compressed=True)`` with the
``compressed_tensors`` library alone (llm-compressor pins an older transformers): the preset
scheme is attached with ``apply_quantization_config``, weight scales / zero points are
round-to-nearest from each weight's min / max (llm-compressor's ``memoryless_minmax`` weight
observer), a static input scale (scheme ``FP8``) is the absmax of the float model's inputs
over a few random prompts (its ``static_minmax`` observer), and ``ModelCompressor`` packs and
saves. The reference directory is the checkpoint as compressed-tensors itself decompresses
it, saved as a plain float32 model, so it is independent of loraplex's unpacking.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

SCHEMES = ("W4A16", "W4A16_ASYM", "W8A16", "W8A8", "W4A8", "FP8_DYNAMIC", "FP8")
TARGETS = ["Linear"]
IGNORE = ["lm_head"]
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
CALIBRATION_SHAPE = (4, 32)
"""Random prompts (batch, tokens) a static input scale is calibrated on, drawn with
``torch.randint(0, vocab_size, CALIBRATION_SHAPE, generator=Generator().manual_seed(seed))``."""


def _scheme(scheme: str, group_size: int | None) -> QuantizationScheme:
    """The preset ``scheme`` targeting Linear layers, observers named as llm-compressor's
    ``QuantizationModifier`` names them (they are written to config.json), with
    ``group_size`` replacing a grouped scheme's."""
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationStrategy,
        preset_name_to_scheme,
    )

    if scheme not in SCHEMES:
        raise ValueError(f"unsupported scheme {scheme!r}; expected one of {SCHEMES}")
    qscheme = preset_name_to_scheme(scheme, TARGETS)
    weights = qscheme.weights
    if group_size is not None and weights.strategy == QuantizationStrategy.GROUP:
        fields = weights.model_dump(exclude_unset=True)
        qscheme.weights = QuantizationArgs.model_validate({**fields, "group_size": group_size})
    # QuantizationMixin._apply_observer_overrides: an observer the preset set explicitly is
    # kept; otherwise weights get memoryless_minmax, static activations minmax, dynamic none.
    for attr, default in (
        ("weights", "memoryless_minmax"),
        ("input_activations", "minmax"),
        ("output_activations", "minmax"),
    ):
        args = getattr(qscheme, attr)
        if args is None or (args.observer is not None and "observer" in args.model_fields_set):
            continue
        args.observer = None if args.dynamic is True else default
    return qscheme


def _flatten_weight(w: torch.Tensor, args: QuantizationArgs) -> torch.Tensor:
    """``(1, *qparam_shape, elements per qparam)``: llm-compressor's
    ``flatten_for_calibration`` for a weight."""
    from compressed_tensors.quantization import QuantizationStrategy

    strategy = args.strategy
    if strategy == QuantizationStrategy.TENSOR:
        return w.reshape(1, 1, -1)
    if strategy == QuantizationStrategy.CHANNEL:
        return w.unsqueeze(-2).unsqueeze(0)
    if strategy == QuantizationStrategy.GROUP:
        return w.unflatten(-1, (-1, args.group_size)).unsqueeze(0)
    raise ValueError(f"weight strategy {strategy} is not supported here")


def _min_max(observed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-qparam min and max of a flattened observation (llm-compressor's ``_get_min_max``)."""
    return torch.amin(observed, dim=(0, -1)), torch.amax(observed, dim=(0, -1))


@torch.no_grad()
def _observe_inputs(
    model: torch.nn.Module, names: list[str], input_ids: torch.Tensor
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Min / max over all tokens of each named module's input in one float forward pass
    (per-tensor strategy), with eager attention and no KV cache as llm-compressor calibrates."""
    stats: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    modules = dict(model.named_modules())

    def hook(name: str) -> Callable[[torch.nn.Module, tuple], None]:
        def observe(_module: torch.nn.Module, args: tuple) -> None:
            x = args[0]
            lo, hi = _min_max(x.reshape(-1, 1, x.size(-1)))
            if name in stats:  # static_minmax: running min / max
                lo, hi = torch.min(lo, stats[name][0]), torch.max(hi, stats[name][1])
            stats[name] = (lo, hi)

        return observe

    handles = [modules[n].register_forward_pre_hook(hook(n)) for n in names]
    attn = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        model.eval()(input_ids=input_ids, use_cache=False)
    finally:
        model.config._attn_implementation = attn
        for h in handles:
            h.remove()
    return stats


@torch.no_grad()
def _quantize(model: torch.nn.Module, qscheme: QuantizationScheme, seed: int) -> None:
    """Attach ``qscheme`` to every Linear but ``lm_head``, calibrate its qparams and freeze:
    what llm-compressor's QuantizationModifier leaves on the model before saving."""
    from compressed_tensors.offload import update_offload_parameter
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from compressed_tensors.utils import match_named_modules

    names = [n for n, _ in match_named_modules(model, TARGETS, IGNORE)]
    inputs = qscheme.input_activations
    input_stats = {}
    if inputs is not None and inputs.dynamic is not True:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, model.config.vocab_size, CALIBRATION_SHAPE, generator=gen)
        input_stats = _observe_inputs(model, names, ids)

    config = QuantizationConfig(
        config_groups={"group_0": qscheme},
        quantization_status=QuantizationStatus.INITIALIZED,
        ignore=IGNORE,
    )
    apply_quantization_config(model, config)
    for name, module in match_named_modules(model, TARGETS, IGNORE):
        scheme = module.quantization_scheme
        if name in input_stats:
            scale, zero_point = calculate_qparams(*input_stats[name], scheme.input_activations)
            update_offload_parameter(module, "input_scale", scale)
            if hasattr(module, "input_zero_point"):
                update_offload_parameter(module, "input_zero_point", zero_point)
        lo, hi = _min_max(_flatten_weight(module.weight, scheme.weights))
        scale, zero_point = calculate_qparams(lo, hi, scheme.weights)
        update_offload_parameter(module, "weight_scale", scale)
        if hasattr(module, "weight_zero_point"):
            update_offload_parameter(module, "weight_zero_point", zero_point)
        module.quantization_status = QuantizationStatus.FROZEN
        module.quantization_enabled = True


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)


def _resave_config(model: torch.nn.Module, float_dir: Path, out_dir: Path) -> None:
    """llm-compressor's ``resave_config``: config.json is the original one (not transformers'
    reserialization), with ``tie_word_embeddings`` and ``dtype`` taken from the model."""
    cfg = json.loads((float_dir / "config.json").read_text())
    src = model.config.to_dict()
    for key in ("tie_word_embeddings",):
        if key in src and key in cfg:
            cfg[key] = src[key]
    for key in ("torch_dtype", "dtype"):
        if key in cfg and "dtype" in src:
            cfg[key] = src["dtype"]
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))


def _write_reference(out_dir: Path, ref_dir: Path, float_dir: Path) -> None:
    """The checkpoint as compressed-tensors decompresses it (``run_compressed=False``), saved
    as a plain float32 model: every projection is its dequantized weight."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    from transformers.utils.quantization_config import CompressedTensorsConfig

    # dequantize=True is run_compressed=False's non-deprecated spelling. Quiet: "the model's
    # quantization_config will be used", and a dense model's load report of unused input_scale
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="You passed `quantization_config`")
            deq = AutoModelForCausalLM.from_pretrained(
                str(out_dir),
                quantization_config=CompressedTensorsConfig(dequantize=True),
                dtype=torch.float32,
            )
    finally:
        hf_logging.set_verbosity(verbosity)
    decompressed = deq.state_dict()
    config = AutoConfig.from_pretrained(str(float_dir))
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = plain.state_dict()
    missing = [k for k in state if k not in decompressed]
    if missing:
        raise RuntimeError(f"decompressed model lacks {missing[:5]}")
    plain.load_state_dict({k: decompressed[k].to(torch.float32) for k in state})
    plain.save_pretrained(str(ref_dir), safe_serialization=True)
    cfg = json.loads((ref_dir / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (ref_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    _copy_tokenizer(float_dir, ref_dir)


def write_compressed_tensors(
    float_dir: str | Path,
    out_dir: str | Path,
    ref_dir: str | Path,
    scheme: str,
    *,
    group_size: int | None = None,
    seed: int = 0,
) -> tuple[Path, Path]:
    """Quantize the float checkpoint ``float_dir`` with preset ``scheme`` (one of
    ``SCHEMES``) into ``out_dir`` in compressed-tensors format, as llm-compressor's data-free
    ``QuantizationModifier(targets="Linear", ignore=["lm_head"])`` writes it, and its
    decompressed float32 reference into ``ref_dir``; both get the tokenizer files.

    ``group_size`` replaces a grouped scheme's (the presets' 128 does not divide a tiny
    model's widths); ``seed`` draws the random calibration prompts of scheme ``FP8``'s static
    input scales (``CALIBRATION_SHAPE``).
    """
    from compressed_tensors import ModelCompressor
    from transformers import AutoModelForCausalLM

    float_dir, out_dir, ref_dir = Path(float_dir), Path(out_dir), Path(ref_dir)
    qscheme = _scheme(scheme, group_size)
    model = AutoModelForCausalLM.from_pretrained(str(float_dir), dtype=torch.float32)
    _quantize(model, qscheme, seed)

    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model, skip_compressed=True)
    compressor.remove_decompression_hook(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True, max_shard_size="20GB")
    _resave_config(model, float_dir, out_dir)
    compressor.update_config(str(out_dir))
    _copy_tokenizer(float_dir, out_dir)

    ref_dir.mkdir(parents=True, exist_ok=True)
    _write_reference(out_dir, ref_dir, float_dir)
    return out_dir, ref_dir
