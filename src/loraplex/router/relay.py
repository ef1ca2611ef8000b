"""HTTP pieces every loraplex proxy shares: the router (``router.app``) and the Ray Serve
ingress (``integrations.ray_serve``). Starlette only; no torch."""

from __future__ import annotations

import json

from starlette.requests import Request

__all__ = ["read_body", "sse_error"]


async def read_body(request: Request, limit: int) -> bytes | None:
    """The request body, or None once it exceeds ``limit`` bytes (a declared length over it
    is refused unread; otherwise counted while reading, so an oversized body is never held
    whole)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def sse_error(message: str, code: str) -> bytes:
    """The end of a stream cut short: an OpenAI error event, then ``[DONE]``."""
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return f"data: {json.dumps(body)}\n\n".encode() + b"data: [DONE]\n\n"
