"""What a merge of LoRA adapters into a new adapter is (PEFT's ``add_weighted_adapter``), checked
without torch: the combination types, their parameters and the rank of the result.

The arithmetic itself is :mod:`loraplex.lora.merging` (torch); the registry operation that
resolves the inputs, bounds them and registers the result is :mod:`loraplex.registry.merges`.
Both read a :class:`MergeSpec`, so the registry can refuse a bad merge before any tensor is read.

Semantics, as PEFT 0.21 defines them (``s_i`` is adapter ``i``'s ``alpha / r`` of the module,
``w_i`` its weight)::

    cat:    A = concat_rows(w_i * s_i * A_i), B = concat_cols(B_i)   rank = sum(r_i)   (exact)
    linear, ties, dare_linear, dare_ties, magnitude_prune:            rank = r (all equal)
            A = op({A_i}, sign(w_i s_i) * sqrt(|w_i s_i|)), B = op({B_i}, sqrt(|w_i s_i|))
    *svd:   D = op({s_i * B_i A_i}, w_i); U, S, Vh = svd(D)            rank = svd_rank or max(r_i)
            B = U[:, :rank] * S[:rank], A = Vh[:rank]   (both clamped at the svd_clamp quantile)

where ``op`` is task arithmetic (weighted sum), TIES (magnitude pruning to ``density``, sign
election, disjoint mean), DARE (random pruning to ``density`` rescaled by ``1 / density``,
then a weighted sum or TIES' sign election) or magnitude pruning then a weighted sum. The
result's ``lora_alpha`` equals its rank, so its own scale is 1.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loraplex.lora.peft.errors import FormatError

COMBINATION_TYPES = (
    "linear",
    "cat",
    "svd",
    "ties",
    "ties_svd",
    "dare_linear",
    "dare_ties",
    "dare_linear_svd",
    "dare_ties_svd",
    "magnitude_prune",
    "magnitude_prune_svd",
)
"""PEFT's ``combination_type`` values."""

SAME_RANK_TYPES = ("linear", "ties", "dare_linear", "dare_ties", "magnitude_prune")
"""Types that combine the A and B factors one by one: every adapter must have the same rank."""

DENSITY_TYPES = tuple(
    t for t in COMBINATION_TYPES if t.split("_")[0] in ("ties", "dare", "magnitude")
)
"""Types that prune to ``density``."""

SIGN_TYPES = ("ties", "ties_svd", "dare_ties", "dare_ties_svd")
"""Types that elect a sign per element (``majority_sign_method``)."""

RANDOM_TYPES = ("dare_linear", "dare_ties", "dare_linear_svd", "dare_ties_svd")
"""Types that draw random masks (``seed``)."""

MAJORITY_SIGN_METHODS = ("total", "frequency")

MAX_MERGED_ADAPTERS = 8
"""The most adapters one merge reads (each is read into memory whole)."""

MAX_WEIGHT = 1000.0
"""The largest ``|weight|`` of one adapter in a merge."""


class MergeError(FormatError):
    """A merge that cannot be done (reason ``invalid_merge``); ``param`` names the parameter at
    fault where one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__("invalid_merge", message)
        self.param = param


def merge_error(message: str, param: str | None = None) -> MergeError:
    return MergeError(message, param)


def is_svd_type(combination_type: str) -> bool:
    return combination_type.endswith("svd")


@dataclass(frozen=True)
class MergeSpec:
    """One merge's parameters (PEFT's names); checked when built (:class:`FormatError`, reason
    ``invalid_merge``). A parameter the type does not use must be left unset.

    ``seed`` fixes DARE's masks: each module's masks come from a generator seeded with
    :func:`module_seed` (``seed``, module name), drawn in PEFT's order within the module (the A
    factors of the adapters in order, then the B factors; or one delta per adapter), so a
    merge is reproducible and independent of which other modules exist."""

    combination_type: str
    weights: tuple[float, ...]
    density: float | None = None
    majority_sign_method: str | None = None
    svd_rank: int | None = None
    svd_clamp: float | None = None
    svd_full_matrices: bool | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.combination_type
        if t not in COMBINATION_TYPES:
            raise merge_error(
                f"combination_type must be one of {', '.join(COMBINATION_TYPES)}, got {t!r}",
                "combination_type",
            )
        if not isinstance(self.weights, tuple) or not 1 <= len(self.weights) <= MAX_MERGED_ADAPTERS:
            raise merge_error(
                f"weights: give 1 to {MAX_MERGED_ADAPTERS} numbers, one per adapter", "weights"
            )
        for w in self.weights:
            if not _number(w) or abs(w) > MAX_WEIGHT:
                raise merge_error(f"weights: each must be a finite number in [-{MAX_WEIGHT:g}, "
                                  f"{MAX_WEIGHT:g}], got {w!r}", "weights")  # fmt: skip
        self._only("density", self.density, DENSITY_TYPES)
        if t in DENSITY_TYPES:
            d = self.density
            if d is None or not _number(d) or not 0 < d <= 1:
                raise merge_error(
                    f"{t} needs density in (0, 1] (the fraction kept), got {d!r}", "density"
                )
        self._only("majority_sign_method", self.majority_sign_method, SIGN_TYPES)
        if self.majority_sign_method not in (None, *MAJORITY_SIGN_METHODS):
            raise merge_error(
                f"majority_sign_method must be one of {', '.join(MAJORITY_SIGN_METHODS)}, "
                f"got {self.majority_sign_method!r}",
                "majority_sign_method",
            )
        svd = tuple(x for x in COMBINATION_TYPES if is_svd_type(x))
        self._only("svd_rank", self.svd_rank, svd)
        self._only("svd_clamp", self.svd_clamp, svd)
        self._only("svd_full_matrices", self.svd_full_matrices, svd)
        r = self.svd_rank
        if r is not None and (not isinstance(r, int) or isinstance(r, bool) or r <= 0):
            raise merge_error(f"svd_rank must be a positive integer, got {r!r}", "svd_rank")
        c = self.svd_clamp
        if c is not None and (not _number(c) or not 0 <= c <= 1):
            raise merge_error(f"svd_clamp must be a quantile in [0, 1], got {c!r}", "svd_clamp")
        if self.svd_full_matrices not in (None, True, False):
            raise merge_error(
                f"svd_full_matrices must be a boolean, got {self.svd_full_matrices!r}",
                "svd_full_matrices",
            )
        self._only("seed", self.seed, RANDOM_TYPES)
        s = self.seed
        if s is not None and (not isinstance(s, int) or isinstance(s, bool) or not 0 <= s < 2**63):
            raise merge_error(f"seed must be an integer in [0, 2**63), got {s!r}", "seed")

    @classmethod
    def of(
        cls, combination_type: str, weights: Sequence[float] | None, adapters: int, **params: Any
    ) -> MergeSpec:
        """The spec of a request naming ``adapters`` adapters: ``weights`` default to 1 each
        and must be one per adapter; ``params`` are the strategy parameters (:data:`PARAMS`,
        None where not given)."""
        if weights is None:
            weights = [1.0] * adapters
        if len(weights) != adapters:
            raise merge_error(
                f"{adapters} adapters but {len(weights)} weights: give one weight per adapter",
                "weights",
            )
        return cls(combination_type, tuple(weights), **{k: params.get(k) for k in PARAMS})

    def _only(self, field: str, value: Any, types: tuple[str, ...]) -> None:
        if value is not None and self.combination_type not in types:
            raise merge_error(
                f"{field} is not used by combination_type {self.combination_type!r} "
                f"(only by {', '.join(types)})",
                field,
            )

    def effective_type(self) -> str:
        """PEFT merges a single adapter linearly, whatever the type asked for."""
        return "linear" if len(self.weights) == 1 else self.combination_type

    @property
    def sign_method(self) -> str:
        return self.majority_sign_method or "total"

    @property
    def full_matrices(self) -> bool:
        return True if self.svd_full_matrices is None else self.svd_full_matrices

    def merged_rank(self, ranks: Sequence[int]) -> int:
        """PEFT's rank of the result from each adapter's (largest) rank: the common rank for
        the factor-wise types (which need one), their sum for ``cat``, ``svd_rank`` or the
        largest for the SVD types."""
        t = self.effective_type()
        if t in SAME_RANK_TYPES:
            if len(set(ranks)) != 1:
                raise merge_error(
                    f"combination_type {t!r} needs adapters of one rank, got ranks "
                    f"{list(ranks)}; use 'cat' (exact) or an SVD type for different ranks"
                )
            return ranks[0]
        if t == "cat":
            return sum(ranks)
        return self.svd_rank or max(ranks)

    def to_dict(self) -> dict[str, Any]:
        """The parameters that were set (for the audit log)."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["weights"] = list(self.weights)
        return {k: v for k, v in d.items() if v is not None}


PARAMS = (
    "density",
    "majority_sign_method",
    "svd_rank",
    "svd_clamp",
    "svd_full_matrices",
    "seed",
)
"""The strategy parameters of :class:`MergeSpec` (PEFT's names)."""


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def module_seed(seed: int, module: str) -> int:
    """The seed of one module's DARE masks: the first 63 bits of sha256(``"{seed}:{module}"``)."""
    digest = hashlib.sha256(f"{seed}:{module}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1
