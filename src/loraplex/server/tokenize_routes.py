"""vLLM's ``/tokenize`` and ``/detokenize`` (``vllm bench serve`` calls ``/tokenize`` first).

Bodies and answers are vLLM's:

    POST /tokenize    {"prompt": T} or {"messages": [...]} (rendered with the chat template),
                      add_special_tokens, return_token_strs, ...
                      -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"tokens": [ids]} -> {"prompt": text}

Both need an inference key where keys exist; a ``model`` given must be one the caller may use
(404 otherwise). Tokenizing runs in the engine's worker pool, never on the event loop.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from loraplex.registry import Principal
from loraplex.server.auth import inference_principal
from loraplex.server.errors import APIError
from loraplex.server.protocol import DetokenizeRequest, TokenizeRequest, template_tools
from loraplex.server.state import ServerState, get_state
from loraplex.types import InvalidRequestError

router = APIRouter()


def _need_tokenizer(state: ServerState) -> None:
    if not state.client.has_tokenizer:
        raise APIError(400, "this server runs without a tokenizer (token ids only)")


@router.post("/tokenize")
async def tokenize(
    body: TokenizeRequest,
    principal: Principal = Depends(inference_principal),
    state: ServerState = Depends(get_state),
) -> dict[str, Any]:
    state.unknown_fields.note("/tokenize", body)
    body.check()
    _need_tokenizer(state)
    if body.model is not None:
        await state.run_io(state.resolve_model, body.model, principal)
    client = state.client
    if body.messages is not None:
        ids = await client.chat_template(
            [m.as_template_message() for m in body.messages],
            body.generation_prompt,
            continue_final_message=body.continue_final_message,
            chat_template=body.chat_template,  # None: the tokenizer's (or --chat-template)
            chat_template_kwargs=body.chat_template_kwargs,
            tools=template_tools(body.tools),
            add_special_tokens=bool(body.add_special_tokens),
        )
    else:
        assert body.prompt is not None
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await client.tokenize(body.prompt, special)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": client.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = [client.vocab.piece(t) for t in ids]
    return out


@router.post("/detokenize")
async def detokenize(
    body: DetokenizeRequest,
    principal: Principal = Depends(inference_principal),
    state: ServerState = Depends(get_state),
) -> dict[str, str]:
    state.unknown_fields.note("/detokenize", body)
    _need_tokenizer(state)
    if body.model is not None:
        await state.run_io(state.resolve_model, body.model, principal)
    vocab = state.client.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequestError(
            f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens"
        )
    text = await state.client.run_in_pool(state.client.decode, body.tokens)
    return {"prompt": text}
