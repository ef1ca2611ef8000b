"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` bodies."""

from __future__ import annotations

from typing import Any

from loraplex.server.protocol.base import Body, Text
from loraplex.server.protocol.chat import RESERVED_TEMPLATE_KWARGS, ChatMessage, Tool
from loraplex.types import InvalidRequestError


class TokenizeRequest(Body):
    """vLLM's ``POST /tokenize`` body: a ``prompt`` (completion form) or ``messages`` (chat
    form, rendered with the chat template)."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: yes for a prompt, no for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template: Text | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None

    @property
    def generation_prompt(self) -> bool:
        if self.continue_final_message and "add_generation_prompt" not in self.model_fields_set:
            return False
        return self.add_generation_prompt

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
        if self.continue_final_message and self.add_generation_prompt:
            if "add_generation_prompt" in self.model_fields_set:
                raise InvalidRequestError(
                    "continue_final_message and add_generation_prompt cannot both be true",
                    param="continue_final_message",
                )
        for key in self.chat_template_kwargs or {}:
            if key in RESERVED_TEMPLATE_KWARGS:
                raise InvalidRequestError(
                    f"chat_template_kwargs may not set {key!r} (use the request field)",
                    param="chat_template_kwargs",
                )


class DetokenizeRequest(Body):
    """vLLM's ``POST /detokenize`` body."""

    model: Text | None = None
    tokens: list[int]
