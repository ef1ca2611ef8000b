"""Rendering a conversation with a chat template into prompt token ids.

``LLMEngine.apply_chat_template`` delegates here. The template is the request's own
(``chat_template``), else the server's (``--chat-template``), else the tokenizer's. Options as
vLLM passes them to transformers:

    add_generation_prompt   open an assistant turn after the messages (default)
    continue_final_message  leave the last message open (no end-of-turn), so the model goes
                            on with it ("prefill"); excludes add_generation_prompt
    tools, documents        handed to the template (tool-aware templates render them)
    chat_template_kwargs    any other variables the template reads (``enable_thinking``, ...)
    add_special_tokens      add the tokenizer's special tokens (BOS) on top of the template's

Templates run in transformers' sandboxed Jinja environment.
"""

from __future__ import annotations

import threading
from typing import Any

from loraplex.types import InvalidRequestError


def render_chat(
    tokenizer: Any,
    lock: threading.Lock,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    default_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    add_special_tokens: bool = False,
) -> list[int]:
    """Token ids of ``messages`` under the chosen template (see the module docstring).
    InvalidRequestError when there is no template or it fails on these messages."""
    template = chat_template or default_template or getattr(tokenizer, "chat_template", None)
    if tokenizer is None or not template:
        raise InvalidRequestError(
            "this model has no chat template (tokenizer_config / chat_template.jinja); "
            "start the server with --chat-template or send chat_template"
        )
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError(
            "continue_final_message and add_generation_prompt cannot both be true",
            param="continue_final_message",
        )
    if continue_final_message and not messages:
        raise InvalidRequestError(
            "continue_final_message needs a final message", param="continue_final_message"
        )
    try:
        with lock:
            text = tokenizer.apply_chat_template(
                messages,
                tools=tools,
                documents=documents,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **(chat_template_kwargs or {}),
            )
            ids = tokenizer(text, add_special_tokens=add_special_tokens).input_ids
    except InvalidRequestError:
        raise
    except Exception as e:  # jinja raises TemplateError and friends for bad messages
        raise InvalidRequestError(f"cannot apply the chat template: {e}") from e
    return [int(t) for t in ids]
