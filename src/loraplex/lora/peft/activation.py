"""Activated LoRA (aLoRA, PEFT ``LoraConfig.alora_invocation_tokens``): where an adapter starts.

An aLoRA adapter applies from the first token of the *last* occurrence of its invocation
sequence in the request's input (the prompt) onward, generated tokens included; every token
before that point runs the base model, so its KV is the base model's. A prompt without the
sequence runs the base model throughout (PEFT ``calculate_alora_offsets`` + the aLoRA variant's
mask: ``offset = len(input) - start``; the last ``offset`` positions are adapted).

Torch-free: the registry records and shows the invocation sequence, the engine finds the start.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

from loraplex.lora.peft.errors import FormatError

MAX_INVOCATION_TOKENS = 1024
"""Longest invocation sequence accepted (PEFT's are a few tokens: a role marker and a name)."""

_ITEM = array("q").itemsize


def invocation_tokens(config: dict[str, Any]) -> tuple[int, ...] | None:
    """``alora_invocation_tokens`` of an adapter config as a tuple (None: a standard LoRA);
    ``FormatError`` (``unsupported_config``) when it is not a non-empty list of token ids."""
    raw = config.get("alora_invocation_tokens")
    if raw is None:
        return None
    ok = (
        isinstance(raw, list)
        and 0 < len(raw) <= MAX_INVOCATION_TOKENS
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**63 for t in raw)
    )
    if not ok:
        raise FormatError(
            "unsupported_config",
            f"alora_invocation_tokens must be a list of 1 to {MAX_INVOCATION_TOKENS} token ids "
            f"(non-negative integers), got {raw!r}",
        )
    return tuple(raw)


def activation_start(tokens: Sequence[int], invocation: Sequence[int]) -> int | None:
    """The index of the first token of the last occurrence of ``invocation`` in ``tokens``
    (the first position the adapter applies to), or None when it does not occur::

        max(i for i in range(len(tokens) - len(invocation) + 1)
            if tokens[i : i + len(invocation)] == invocation)

    One ``bytes.rfind`` over 8-byte token ids (a match must start on a token boundary)."""
    k = len(invocation)
    if k == 0 or k > len(tokens):
        return None
    hay = array("q", tokens).tobytes()
    needle = array("q", invocation).tobytes()
    end = len(hay)
    while (at := hay.rfind(needle, 0, end)) >= 0:
        if at % _ITEM == 0:
            return at // _ITEM
        end = at + len(needle) - 1  # an unaligned match: look left of where it starts
    return None
