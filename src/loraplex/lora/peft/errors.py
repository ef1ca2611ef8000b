"""The one error of the adapter format rules (:mod:`loraplex.lora.peft`)."""

from __future__ import annotations


class FormatError(ValueError):
    """An adapter breaks a format rule. ``reason`` is the registry's code (``unsupported_config``,
    ``unsupported_target``, ``unsupported_tensor``, ``unsupported_dtype``, ``incomplete_adapter``,
    ``shape_mismatch``, ``rank_too_large``, ``unsupported_base``); the message names the field
    or tensor."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
