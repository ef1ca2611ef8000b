"""Tool calling: the parsers that find tool calls in generated text (``--tool-call-parser``),
and the JSON schemas that enforce ``tool_choice`` ``required`` or a named tool.

Formats (as vLLM's parsers of the same names read them):

    hermes       <tool_call>{"name": N, "arguments": {...}}</tool_call>  (Hermes, Qwen 2/2.5/3);
                 text before the first <tool_call> is the message content
    llama3_json  {"name": N, "parameters": {...}} (optionally after <|python_tag|>), several
                 separated by ";"; text that does not start with "{" is plain content

``tool_choice="required"`` constrains the output to a JSON array of ``{"name", "parameters"}``
objects, one of the offered tools each; a named choice constrains it to that tool's
``parameters`` object (vLLM's two schemas). Streaming: :meth:`ToolParser.content_end` says how
much of the text so far is certainly content (it may be sent now); the rest waits for the end.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from loraplex.types import InvalidRequestError


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Extracted:
    """What a parser found: the message content (None: none) and the tool calls."""

    content: str | None
    calls: list[ToolCall]


def _call(obj: Any, args_key: str) -> ToolCall | None:
    """A ToolCall of a decoded ``{"name": ..., args_key: {...}}`` object, None if not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models send the arguments already as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), tool_call_id())


class ToolParser(Protocol):
    name: str

    def extract(self, text: str) -> Extracted:
        """The content and tool calls of a finished output."""
        ...

    def content_end(self, text: str) -> int:
        """How many leading characters of the (unfinished) ``text`` are content whatever
        follows (safe to stream now)."""
        ...


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class HermesToolParser:
    """``<tool_call>{json}</tool_call>`` blocks (an unclosed last block is read to the end)."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def extract(self, text: str) -> Extracted:
        if self.START not in text:
            return Extracted(text, [])
        calls = []
        for m in self._BLOCK.finditer(text):
            body = (m.group(1) if m.group(1) is not None else m.group(2)).strip()
            try:
                call = _call(json.loads(body), "arguments")
            except ValueError:
                call = None
            if call is None:  # a malformed block: the text is content, as it came
                return Extracted(text, [])
            calls.append(call)
        content = text[: text.index(self.START)]
        return Extracted(content if content.strip() else None, calls)

    def content_end(self, text: str) -> int:
        at = text.find(self.START)
        if at >= 0:
            return at
        return len(text) - _held_prefix(text, self.START)


class Llama3JsonToolParser:
    """Llama 3.x's JSON tool calls: ``{"name", "parameters"}`` objects joined by ``;``."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def extract(self, text: str) -> Extracted:
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].lstrip()
        if not body.startswith("{"):
            return Extracted(text, [])
        decoder = json.JSONDecoder()
        calls, at = [], 0
        while at < len(body):
            try:
                obj, end = decoder.raw_decode(body, at)
            except ValueError:
                return Extracted(text, [])
            call = _call(obj, "parameters")
            if call is None:
                return Extracted(text, [])
            calls.append(call)
            at = end
            rest = body[at:].lstrip()
            if not rest:
                break
            if not rest.startswith(";"):
                return Extracted(text, [])
            at = len(body) - len(rest) + 1
            while at < len(body) and body[at].isspace():
                at += 1
        return Extracted(None, calls)

    def content_end(self, text: str) -> int:
        body = text.lstrip()
        if not body:
            return 0
        if body.startswith("{") or self.TAG.startswith(body[: len(self.TAG)]):
            return 0  # a tool call (or the start of its tag): wait for the end
        return len(text)


PARSERS: dict[str, type[HermesToolParser] | type[Llama3JsonToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def tool_parser(name: str) -> ToolParser:
    """The parser ``--tool-call-parser NAME`` selects (ValueError naming the supported ones)."""
    cls = PARSERS.get(name)
    if cls is None:
        raise ValueError(
            f"tool call parser {name!r} is not supported (supported: {', '.join(PARSERS)})"
        )
    return cls()


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool.get("parameters") or {"type": "object", "properties": {}}


def required_tools_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """``tool_choice="required"``: a non-empty JSON array of calls of the offered functions
    (``tools``: function definitions), ``$defs`` of every function's parameters hoisted."""
    defs: dict[str, Any] = {}
    items = []
    for t in tools:
        params = dict(_parameters(t))
        for k, v in params.pop("$defs", {}).items():
            if k in defs and defs[k] != v:
                raise InvalidRequestError(
                    f"tools define $defs {k!r} twice with different schemas", param="tools"
                )
            defs[k] = v
        items.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t["name"]]},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if defs:
        schema["$defs"] = defs
    return schema


def named_tool_schema(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """A named ``tool_choice``: the output is that function's arguments object."""
    tool = next(t for t in tools if t["name"] == name)
    return _parameters(tool)


def parse_required(text: str) -> list[ToolCall] | None:
    """The calls of a ``required`` output (the schema's array); None if it is not one (the
    output was cut short by ``max_tokens``)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list):
        return None
    calls = [_call(x, "parameters") for x in items]
    if any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]
