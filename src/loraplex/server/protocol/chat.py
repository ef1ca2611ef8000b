"""``POST /v1/chat/completions``: messages as chat templates take them, tools and the tool
choice (``required`` or a named tool is enforced by a JSON schema, as in vLLM), and the chat
template's own options."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

from loraplex.requests import SamplingParams, StructuredOutput
from loraplex.server.protocol.base import Body, Text
from loraplex.server.protocol.sampling import MAX_LOGPROBS, SamplingBody
from loraplex.server.protocol.structured import one_constraint
from loraplex.server.tools import named_tool_schema, required_tools_schema
from loraplex.types import InvalidRequestError

MAX_TOOLS = 128  # tools offered in one request
# chat_template_kwargs may not override what the server itself passes to the renderer
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "return_dict", "return_tensors", "padding",
     "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"}
)  # fmt: skip


class ContentPart(Body):
    type: str
    text: Text | None = None


class FunctionDefinition(Body):
    name: Text = Field(min_length=1, max_length=256)
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(Body):
    name: Text = Field(min_length=1)


class NamedToolChoice(Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: Text | None = None
    reasoning_content: Text | None = None

    def text(self) -> str:
        """The message's text (its text parts joined); other content types are a 400."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise InvalidRequestError(
                        f"message content of type {part.type!r} is not supported (text only)",
                        param="messages",
                    )
                texts.append(part.text)
            return "".join(texts)
        return content or ""

    def as_template_message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = [_template_tool_call(c) for c in self.tool_calls]
        return msg


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call of an assistant message as chat templates expect it: ``arguments`` as an
    object (transformers' convention), not the JSON text OpenAI clients send."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequestError(
            "each tool call of an assistant message needs function.name", param="messages"
        )
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as e:
            raise InvalidRequestError(
                f"tool call {fn['name']!r}: arguments are not valid JSON", param="messages"
            ) from e
    return {**call, "type": call.get("type", "function"), "function": {**fn, "arguments": args}}


class ChatCompletionRequest(SamplingBody):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Text | None = None
    include_reasoning: bool = True  # no reasoning parser: there is never reasoning to include
    # vLLM's chat extras
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, Any]] | None = None
    chat_template: Text | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    structural_tag: Text | None = None

    @property
    def special_tokens(self) -> bool:
        """Whether special tokens are added on top of the chat template's (vLLM: no)."""
        return bool(self.add_special_tokens)

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """``tool_choice`` as vLLM reads it: ``auto`` when tools come without one, ``none``
        without tools or when ``required`` comes with an empty list (OpenAI's behaviour)."""
        if not self.tools:
            return "none"
        return self.tool_choice if self.tool_choice is not None else "auto"

    @property
    def generation_prompt(self) -> bool:
        """Whether an assistant turn is opened: ``add_generation_prompt``, unless the final
        message is continued (then the default ``true`` does not apply)."""
        if self.continue_final_message and "add_generation_prompt" not in self.model_fields_set:
            return False
        return self.add_generation_prompt

    @property
    def response_role(self) -> str:
        """The role of the message generated (vLLM's: the last message's when no generation
        prompt is added)."""
        return "assistant" if self.generation_prompt else self.messages[-1].role

    def _check_chat(self) -> None:
        if self.reasoning_effort is not None:
            raise InvalidRequestError(
                "reasoning_effort is not supported: this server runs no reasoning parser",
                param="reasoning_effort",
            )
        if self.mm_processor_kwargs:
            raise InvalidRequestError(
                "mm_processor_kwargs is not supported: the models served here are text-only",
                param="mm_processor_kwargs",
            )
        if self.structural_tag is not None:
            raise InvalidRequestError("structural_tag is not supported", param="structural_tag")
        if self.continue_final_message and self.add_generation_prompt:
            if "add_generation_prompt" in self.model_fields_set:
                raise InvalidRequestError(
                    "continue_final_message and add_generation_prompt cannot both be true",
                    param="continue_final_message",
                )
        if self.tool_choice is not None and self.tool_choice != "none" and self.tools is None:
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        if self.tools is not None and len(self.tools) > MAX_TOOLS:
            raise InvalidRequestError(
                f"tools takes at most {MAX_TOOLS} tools (got {len(self.tools)})", param="tools"
            )
        choice = self.effective_tool_choice
        if isinstance(choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or []}
            if choice.function.name not in names:
                raise InvalidRequestError(
                    f"tool_choice names {choice.function.name!r}, which is not in tools",
                    param="tool_choice",
                )
        for key in self.chat_template_kwargs or {}:
            if key in RESERVED_TEMPLATE_KWARGS:
                raise InvalidRequestError(
                    f"chat_template_kwargs may not set {key!r} (use the request field)",
                    param="chat_template_kwargs",
                )

    def _tool_constraint(self) -> tuple[str, StructuredOutput] | None:
        """``required`` and a named tool choice are enforced by a JSON schema (as vLLM)."""
        choice = self.effective_tool_choice
        tools = [t.function.model_dump(by_alias=True, exclude_none=True)
                 for t in self.tools or []]  # fmt: skip
        if choice == "required":
            return "tool_choice", StructuredOutput(json_schema=required_tools_schema(tools))
        if isinstance(choice, NamedToolChoice):
            schema = named_tool_schema(tools, choice.function.name)
            return "tool_choice", StructuredOutput(json_schema=schema)
        return None

    def sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs must be in [0, {MAX_LOGPROBS}] (got {self.top_logprobs})",
                param="top_logprobs",
            )
        self._check_bounds()
        self._check_chat()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        given = self._given("max_completion_tokens") or self._given("max_tokens")
        max_tokens = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(
            max_tokens=max_tokens,
            max_tokens_given=given,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            structured=one_constraint(self, self._tool_constraint()),
            defaults=defaults or {},
        )

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_message() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        return template_tools(self.tools)


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """Tools as chat templates take them (OpenAI's shape); None without any."""
    if not tools:
        return None
    return [t.model_dump(by_alias=True, exclude_none=True) for t in tools]
