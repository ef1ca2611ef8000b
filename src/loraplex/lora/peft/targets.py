"""PEFT's module selection and per-module rank and scale, as ``adapter_config.json`` spells
them: which modules (and, for a MoE's experts, which parameters) an adapter adapts, and with
which rank and ``alpha``. Matches PEFT's own rules (``check_target_module_exists``,
``get_pattern_key``) on the module names of :mod:`loraplex.checkpoint.modules`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loraplex.checkpoint.modules import VOCAB_MODULES


def pattern_key(patterns: Mapping[str, Any], module: str) -> str | None:
    """PEFT's ``get_pattern_key``: the first pattern (in file order) matching a suffix of
    ``module``."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


@dataclass(frozen=True)
class LoraSettings:
    """The parts of adapter_config.json that decide which modules are adapted and how."""

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: str | list[str]
    exclude_modules: str | list[str] | None
    layers_to_transform: int | list[int] | None
    layers_pattern: list[str] | None
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    target_parameters: tuple[str, ...] = ()
    """PEFT's ``target_parameters``: parameters adapted directly (a MoE's packed experts,
    ``mlp.experts.gate_up_proj``; its router, ``mlp.gate.weight``), matched as name suffixes."""

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> LoraSettings:
        """The settings as ``config`` spells them, PEFT's defaults for missing fields; no checks
        (:func:`~loraplex.lora.peft.config.parse_lora_config` checks first)."""
        pattern = config.get("layers_pattern")
        alpha = config.get("lora_alpha", 8)
        return cls(
            r=config.get("r", 8),
            lora_alpha=float(alpha) if is_finite_number(alpha) else alpha,
            use_rslora=config.get("use_rslora", False),
            target_modules=config.get("target_modules"),  # type: ignore[arg-type]
            exclude_modules=config.get("exclude_modules"),
            layers_to_transform=config.get("layers_to_transform"),
            layers_pattern=[pattern] if isinstance(pattern, str) else (pattern or None),
            rank_pattern=config.get("rank_pattern") or {},
            alpha_pattern=config.get("alpha_pattern") or {},
            target_parameters=tuple(config.get("target_parameters") or ()),
        )

    def is_param_targeted(self, param: str) -> bool:
        """Whether ``target_parameters`` names parameter ``param`` (e.g.
        ``model.layers.3.mlp.experts.down_proj``): the whole name or a suffix of it after a dot,
        within ``layers_to_transform`` as for modules."""
        if not any(param == t or param.endswith(f".{t}") for t in self.target_parameters):
            return False
        return self._in_layers(param)

    def is_targeted(self, module: str) -> bool:
        """PEFT's ``check_target_module_exists`` for a key like ``model.layers.3.mlp.up_proj``
        (or ``model.embed_tokens`` / ``lm_head``: with no layer index, ``layers_to_transform``
        leaves them out unless ``target_modules`` lists the whole name, as PEFT does)."""
        ex = self.exclude_modules
        if ex:
            if isinstance(ex, str):
                if re.fullmatch(ex, module):
                    return False
            elif module in ex or any(module.endswith(f".{e}") for e in ex):
                return False
        tm = self.target_modules
        if not tm:
            return False
        if isinstance(tm, str):
            if tm.lower() == "all-linear":  # every linear but the LM head (an embedding is none)
                found = module.rsplit(".", 1)[-1] not in VOCAB_MODULES
            else:
                return re.fullmatch(tm, module) is not None
        elif module in tm:
            return True
        else:
            found = any(module.endswith(f".{t}") for t in tm)
        return found and self._in_layers(module)

    def _in_layers(self, module: str) -> bool:
        """Whether ``layers_to_transform`` (with ``layers_pattern``) keeps ``module``."""
        lt = self.layers_to_transform
        if lt is None or (isinstance(lt, list) and not lt):
            return True
        match = None
        if not self.layers_pattern:
            match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
        else:
            for pattern in self.layers_pattern:
                match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", module)
                if match is not None:
                    break
        if match is None:
            return False
        idx = int(match.group("idx"))
        return idx == lt if isinstance(lt, int) else idx in lt

    def rank_and_scale(self, module: str) -> tuple[int, float]:
        """Configured (rank, scale) of one module: ``scale = alpha / r`` (``alpha / sqrt(r)``
        with rsLoRA); rank and alpha from the first matching pattern, else ``r`` /
        ``lora_alpha``."""
        r = self.rank_of(module)
        a_key = pattern_key(self.alpha_pattern, module)
        alpha = self.alpha_pattern[a_key] if a_key is not None else self.lora_alpha
        scale = alpha / math.sqrt(r) if self.use_rslora else alpha / r
        return r, float(scale)

    def rank_of(self, module: str) -> int:
        """Configured rank of one module: the first matching ``rank_pattern`` entry, else ``r``."""
        key = pattern_key(self.rank_pattern, module)
        return self.rank_pattern[key] if key is not None else self.r

    def rank_field(self, module: str) -> str:
        """The config field the module's rank comes from: ``rank_pattern`` or ``r``."""
        return "rank_pattern" if pattern_key(self.rank_pattern, module) else "r"


def is_finite_number(v: Any) -> bool:
    """A finite int or float, not a bool (what ``lora_alpha`` and alphas must be)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
