"""An adapter push fanned out to several replicas, and their answers fanned back in to one: what
``loraplex route`` and the Ray Serve ingress share (torch-free, HTTP-free).

    bearer_refusal(Authorization, key, route, hint) -> None, or (status, message, type, code):
                                                 404 while no key is configured (the route is
                                                 off), 401 for a missing or wrong one; checked
                                                 before a byte of the body is read
    check_digest(body, X-Loraplex-Body-SHA256)   -> None, or why the body is refused (400)
    one answer per target: Answer(target, status (0: none came), JSON body, error)
    fan_in(name, answers):
        every target 201 with one sha256  -> 201, the first answer + "replicas" (each target's
                                             status, revision and sha256)
        every target the same 4xx         -> that answer (refused everywhere, nothing changed)
        otherwise                         -> 502 push_incomplete (which did not take it, and
                                             why) or push_diverged (different sha256s)
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import Any

from loraplex.client import SHA256_HEADER

__all__ = ["Answer", "answer_of", "bearer_refusal", "check_digest", "fan_in"]


def bearer_refusal(
    authorization: str | None, key: str | None, route: str, hint: str
) -> tuple[int, str, str, str] | None:
    """None if ``authorization`` is ``Bearer <key>``; else ``(status, message, type, code)``:
    404 ``{route}_api_disabled`` while no key is configured (fails closed; ``hint`` says how to
    turn it on), 401 ``invalid_api_key`` for a missing or wrong key (compared in constant
    time)."""
    if key is None:
        return (404, f"the {route} route is disabled; {hint}", "not_found_error",
                f"{route}_api_disabled")  # fmt: skip
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode()):
        return None
    what = f"missing {route} API key" if not given.strip() else f"invalid {route} API key"
    return 401, what, "authentication_error", "invalid_api_key"


def check_digest(body: bytes, declared: str | None) -> str | None:
    """None when ``declared`` (the ``X-Loraplex-Body-SHA256`` header) is the sha256 of
    ``body``; else the one-line reason to refuse it (checked before any replica is sent the
    body, so no replica spends memory on a corrupt one)."""
    actual = hashlib.sha256(body).hexdigest()
    declared = (declared or "").strip()
    if not declared:
        return f"missing {SHA256_HEADER} (the lowercase hex sha256 of the body)"
    if not hmac.compare_digest(declared.lower().encode(), actual.encode()):
        return f"the body's sha256 is {actual}, not the {SHA256_HEADER} header's {declared!r}"
    return None


@dataclass(frozen=True)
class Answer:
    """One target's answer to a push: ``status`` 0 when none came (``error`` says why)."""

    target: str
    status: int
    body: Any = None
    error: str | None = None

    @property
    def took(self) -> bool:
        return self.status == 201 and self.error is None


def answer_of(target: str, status: int, content: bytes) -> Answer:
    """``target``'s HTTP answer as an :class:`Answer` (a 201 without a sha256 is an error)."""
    try:
        body = json.loads(content) if content else None
    except (ValueError, UnicodeDecodeError):
        body = None
    if status == 201:
        ok = isinstance(body, dict) and isinstance(body.get("sha256"), str)
        return Answer(target, 201, body, None if ok else "a 201 answer without a sha256")
    err = body.get("error") if isinstance(body, dict) else None
    msg = err.get("message") if isinstance(err, dict) else None
    text = str(msg) if msg else content[:300].decode("utf-8", "replace")
    return Answer(target, status, body, text)


def _error(message: str, type_: str, code: Any) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def fan_in(name: str, answers: list[Answer]) -> tuple[int, dict[str, Any]]:
    """The one answer to a push of ``name`` that reached ``answers``' targets: (status, JSON
    body) as the module docstring says."""
    rows: list[dict[str, Any]] = []
    for a in answers:
        row: dict[str, Any] = {"url": a.target, "status": a.status}
        if a.took:
            row.update(revision=a.body.get("revision"), sha256=a.body["sha256"])
        else:
            row["error"] = a.error
        rows.append(row)
    took = [a for a in answers if a.took]
    digests = {a.body["sha256"] for a in took}
    if answers and len(took) == len(answers) and len(digests) == 1:
        return 201, {**answers[0].body, "replicas": rows}
    statuses = {a.status for a in answers}
    if answers and not took and len(statuses) == 1 and 400 <= answers[0].status < 500:
        # refused alike everywhere (bad key, bad tensors, a name it may not write): the
        # replicas' own answer; nothing changed anywhere
        first = answers[0]
        if isinstance(first.body, dict) and isinstance(first.body.get("error"), dict):
            return first.status, first.body
        return first.status, _error(str(first.error), "invalid_request_error", first.status)
    if took and len(took) == len(answers):
        msg = f"the replicas took the push of {name!r} with different sha256s: " + ", ".join(
            f"{a.target}={a.body['sha256']}" for a in took
        )
        code = "push_diverged"
    else:
        failed = [a for a in answers if not a.took]
        msg = f"the push of {name!r} reached {len(took)} of {len(answers)} replicas; " + (
            "; ".join(f"{a.target}: {a.status or 'no answer'} {a.error}" for a in failed)
        )
        code = "push_incomplete"
    return 502, {**_error(msg, "server_error", code), "replicas": rows}
