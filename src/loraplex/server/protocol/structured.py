"""The structured-output fields of a completions or chat body, and the one constraint they make.

``response_format``, vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` and ``structured_outputs`` each can name a constraint; together with the JSON
schema that a chat body's ``tool_choice`` (``required`` or a named tool) adds, they become one
:class:`~loraplex.requests.StructuredOutput`. More than one source in a request is a 400 naming
the second, as is any value the server's one grammar engine (xgrammar) cannot honour.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal, Protocol

from pydantic import Field

from loraplex.requests import StructuredOutput
from loraplex.server.protocol.base import Body, Text, refuse
from loraplex.types import InvalidRequestError

MAX_CHOICES = 1024  # guided_choice alternatives


class JsonSchemaFormat(Body):
    name: Text | None = None
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(Body):
    """vLLM's ``structured_outputs`` (its ``StructuredOutputsParams``)."""

    json_: dict[str, Any] | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    structural_tag: Text | None = None
    disable_fallback: bool = False  # there is one grammar engine: nothing to fall back to
    # JSON constraints of the request (whatever field names them): true, one compact line;
    # false, whitespace allowed (pretty printing); unset, the server's
    # --structured-outputs-whitespace (compact unless changed)
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool = False
    whitespace_pattern: Text | None = None


class StructuredFields(Protocol):
    """The fields of a request body that name structured outputs (completions and chat)."""

    response_format: ResponseFormat | None
    guided_json: dict[str, Any] | str | None
    guided_regex: str | None
    guided_choice: list[str] | None
    guided_grammar: str | None
    guided_decoding_backend: str | None
    guided_whitespace_pattern: str | None
    structured_outputs: StructuredOutputsBody | None


def _json_schema(value: dict[str, Any] | str, param: str) -> dict[str, Any]:
    """A JSON schema given as an object or as JSON text (vLLM accepts both)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidRequestError(f"{param} is not valid JSON: {e}", param=param) from e
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{param} must be a JSON schema object", param=param)
    return value


def _choices(values: list[str], param: str) -> tuple[str, ...]:
    if not values:
        raise InvalidRequestError(f"{param} needs at least one choice", param=param)
    if len(values) > MAX_CHOICES:
        raise InvalidRequestError(
            f"{param} takes at most {MAX_CHOICES} choices (got {len(values)})", param=param
        )
    return tuple(values)


def check_structured_fields(body: StructuredFields) -> None:
    """Refuse, naming the field, every structured-output value we cannot honour."""
    if body.guided_decoding_backend not in (None, "auto", "xgrammar"):
        refuse(
            "guided_decoding_backend",
            f"the server's grammar engine is xgrammar (got {body.guided_decoding_backend!r}; "
            "use 'auto', 'xgrammar' or omit it)",
        )
    if body.guided_whitespace_pattern is not None:
        refuse("guided_whitespace_pattern", "JSON whitespace follows the server's "
               "--structured-outputs-whitespace (structured_outputs.disable_any_whitespace "
               "true asks for compact JSON, false for whitespace)")  # fmt: skip
    so = body.structured_outputs
    if so is not None:
        if so.structural_tag is not None:
            refuse("structured_outputs", "structural_tag is not implemented")
        if so.disable_additional_properties:
            refuse("structured_outputs", "disable_additional_properties is not implemented")
        if so.whitespace_pattern is not None:
            refuse("structured_outputs", "whitespace_pattern is not implemented (JSON "
                   "whitespace is the server's --structured-outputs-whitespace, or per "
                   "request compact or not with disable_any_whitespace)")  # fmt: skip
    if body.response_format is not None and body.response_format.type == "structural_tag":
        refuse("response_format", "the 'structural_tag' type is not implemented")


def structured_sources(body: StructuredFields) -> Iterator[tuple[str, StructuredOutput]]:
    """Every structured-output constraint the body asks for, with the field naming it."""
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        yield "response_format", StructuredOutput(json_schema={"type": "object"})
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise InvalidRequestError(
                "response_format of type 'json_schema' needs json_schema.schema",
                param="response_format",
            )
        yield "response_format", StructuredOutput(json_schema=rf.json_schema.schema_)
    if body.guided_json is not None:
        schema = _json_schema(body.guided_json, "guided_json")
        yield "guided_json", StructuredOutput(json_schema=schema)
    if body.guided_regex is not None:
        yield "guided_regex", StructuredOutput(regex=body.guided_regex)
    if body.guided_choice is not None:
        yield (
            "guided_choice",
            StructuredOutput(choice=_choices(body.guided_choice, "guided_choice")),
        )
    if body.guided_grammar is not None:
        yield "guided_grammar", StructuredOutput(grammar=body.guided_grammar)
    so = body.structured_outputs
    if so is not None:
        p = "structured_outputs"
        found = [
            StructuredOutput(json_schema=_json_schema(so.json_, p)) if so.json_ is not None
            else None,
            StructuredOutput(regex=so.regex) if so.regex is not None else None,
            StructuredOutput(choice=_choices(so.choice, p)) if so.choice is not None
            else None,
            StructuredOutput(grammar=so.grammar) if so.grammar is not None else None,
            StructuredOutput(json_schema={"type": "object"}) if so.json_object else None,
        ]  # fmt: skip
        for s in found:
            if s is not None:
                yield p, s


def one_constraint(
    body: StructuredFields, extra: tuple[str, StructuredOutput] | None = None
) -> StructuredOutput | None:
    """The one structured-output constraint of the request (None: unconstrained), ``extra``
    (a chat body's tool choice) counted first; a JSON one, from whichever field, takes
    ``structured_outputs.disable_any_whitespace`` where the request gives it (as vLLM merges it
    with ``response_format``)."""
    sources = ([extra] if extra is not None else []) + list(structured_sources(body))
    if len(sources) > 1:
        names = ", ".join(dict.fromkeys(n for n, _ in sources))
        raise InvalidRequestError(
            f"only one structured-output constraint per request (got {len(sources)}: {names})",
            param=sources[1][0],
        )
    if not sources:
        return None
    found = sources[0][1]
    so = body.structured_outputs
    if so is not None and so.disable_any_whitespace is not None and found.kind == "json_schema":
        found = StructuredOutput(
            json_schema=found.json_schema, disable_any_whitespace=so.disable_any_whitespace
        )
    return found
