"""Structured outputs: grammars compiled off the engine loop, token masks applied by the sampler.

A request's :class:`~loraplex.requests.StructuredOutput` (JSON Schema, regex, choice, or an
EBNF / Lark grammar) is compiled by xgrammar into a token-level automaton once per distinct spec
(an LRU of compiled grammars keyed by :func:`grammar_key`, compilations shared by concurrent
requests asking for the same spec) on a small thread pool. Each constrained sequence gets its
own :class:`GrammarState` (a matcher: which tokens may come next), so constrained,
unconstrained and different-adapter sequences share one batch; the sampler fills one bitmask
row per constrained sequence and applies it to those rows of the logits only:

    allowed[t] = bit t of the row's mask;  logits[row, t] = -inf where not allowed[t]

JSON grammars (``json_schema``: OpenAI's ``json_schema`` and ``json_object``, ``guided_json``,
the tool-call schemas) fix the whitespace between JSON tokens (:data:`WHITESPACE_MODES`,
``--structured-outputs-whitespace``). ``compact``, the default, is one line with ``", "`` and
``": "`` separators (vLLM's ``disable_any_whitespace``): a model that favours whitespace still
writes exactly the compact text, so the output is parseable within a budget derived from the
schema. ``bounded`` allows any layout with at most :data:`MAX_JSON_WHITESPACE` characters per
gap (after ``{`` or ``[``, around ``:`` and ``,``, before ``}`` or ``]``): pretty-printed JSON
stays legal and every gap ends, but one member may cost 4 x 16 whitespace characters more.
``any`` is xgrammar's (and vLLM's) unbounded default, which a weak model can pad until
``max_tokens``. A request picks for itself with ``StructuredOutput.disable_any_whitespace``:
true is ``compact``, false asks for whitespace (pretty printing: the server's mode if it allows
whitespace, else ``bounded``); unset follows the server. Whitespace inside a string is its
content, bounded only by the schema (``maxLength``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch
import xgrammar as xgr

from loraplex.config import WHITESPACE_MODES
from loraplex.requests import StructuredOutput
from loraplex.types import InvalidRequestError

log = logging.getLogger(__name__)

# Whitespace characters per gap under "bounded": a newline plus the indentation of pretty JSON
# up to depth 3 with indent 4 (13 characters) or depth 7 with indent 2 (15). An object of k
# members has 4k gaps, so at most 4k * MAX_JSON_WHITESPACE whitespace characters.
MAX_JSON_WHITESPACE = 16


def json_whitespace(so: StructuredOutput, default: str) -> str:
    """The whitespace mode of ``so``'s JSON grammar ("" for the kinds that are not JSON):

    disable_any_whitespace is True  -> "compact"
    disable_any_whitespace is False -> default, or "bounded" where default is "compact"
    disable_any_whitespace is None  -> default (the server's --structured-outputs-whitespace)
    """
    if so.kind != "json_schema":
        return ""
    if so.disable_any_whitespace is None:
        return default
    if so.disable_any_whitespace:
        return "compact"
    return "bounded" if default == "compact" else default


def json_schema_options(
    whitespace: str, max_whitespace: int = MAX_JSON_WHITESPACE
) -> dict[str, Any]:
    """xgrammar's ``compile_json_schema`` whitespace arguments of one mode."""
    if whitespace == "bounded":
        return {"any_whitespace": True, "max_whitespace_cnt": max_whitespace}
    if whitespace == "any":
        return {"any_whitespace": True}
    if whitespace == "compact":  # indent None: one line, separators ", " and ": "
        return {"any_whitespace": False}
    raise ValueError(f"whitespace must be one of {', '.join(WHITESPACE_MODES)}, got {whitespace!r}")


def grammar_key(so: StructuredOutput, whitespace: str = "compact") -> tuple[str, str, str]:
    """Cache key of a spec: its kind, its JSON whitespace mode ("" for the other kinds; see
    :func:`json_whitespace`) and a canonical text of it (JSON keys sorted)."""
    kind = so.kind
    mode = json_whitespace(so, whitespace)
    if kind == "json_schema":
        return kind, mode, json.dumps(so.json_schema, sort_keys=True, separators=(",", ":"))
    if kind == "choice":
        return kind, mode, json.dumps(list(so.choice or ()))
    return kind, mode, str(getattr(so, kind))


def choice_ebnf(choices: tuple[str, ...]) -> str:
    """An EBNF grammar matching exactly one of ``choices`` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class GrammarState:
    """One sequence's position in its grammar: which tokens may come next."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 [rows, ceil(V / 32)])."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False when the grammar does not allow it."""
        return bool(self._matcher.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return bool(self._matcher.is_terminated())


class StructuredOutputBackend:
    """Compiles and caches grammars for one tokenizer and vocabulary (thread-safe).

    ``vocab_size`` is the model's (its logits' width, which may exceed the tokenizer's);
    ``stop_token_ids`` end a completed grammar (the engine's EOS ids); ``whitespace`` is the
    JSON grammars' whitespace mode (:data:`WHITESPACE_MODES`, ``--structured-outputs-whitespace``)
    unless a request picks its own (:func:`json_whitespace`), ``max_whitespace`` the ``bounded``
    limit per gap.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        *,
        max_workers: int = 2,
        cache_size: int = 256,
        compile_timeout_s: float = 60.0,
        whitespace: str = "compact",
        max_whitespace: int = MAX_JSON_WHITESPACE,
    ) -> None:
        json_schema_options(whitespace)  # raises ValueError for an unknown mode
        if max_whitespace < 1:
            raise ValueError(f"max_whitespace must be >= 1, got {max_whitespace}")
        self.vocab_size = vocab_size
        self.whitespace = whitespace
        self.max_whitespace = max_whitespace
        self._info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        # our own bounded LRU below replaces xgrammar's (unbounded by default) cache
        self._compiler = xgr.GrammarCompiler(
            self._info, max_threads=max_workers, cache_enabled=False
        )
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="loraplex-grammar")
        self._cache: OrderedDict[tuple[str, str, str], Future[xgr.CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._cache_size = cache_size
        self._timeout = compile_timeout_s
        self.num_compiled = 0  # compilations run (cache misses), for tests and metrics

    def _compile(self, so: StructuredOutput) -> xgr.CompiledGrammar:
        kind = so.kind
        self.num_compiled += 1
        if kind == "json_schema":
            mode = json_whitespace(so, self.whitespace)
            return self._compiler.compile_json_schema(
                json.dumps(so.json_schema), **json_schema_options(mode, self.max_whitespace)
            )
        if kind == "regex":
            return self._compiler.compile_regex(so.regex)  # type: ignore[arg-type]
        if kind == "choice":
            return self._compiler.compile_grammar(choice_ebnf(so.choice or ()))
        text = so.grammar or ""
        if "::=" in text:  # EBNF (GBNF), as vLLM tells the two apart
            return self._compiler.compile_grammar(text)
        return self._compiler.compile_lark(text)

    def compile(self, so: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar of ``so`` (cached; compiled on the pool, the caller waits).

        Raises InvalidRequestError naming the spec's field when it cannot be compiled."""
        key = grammar_key(so, self.whitespace)
        with self._lock:
            fut = self._cache.get(key)
            if fut is None:
                fut = self._pool.submit(self._compile, so)
                self._cache[key] = fut
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        try:
            return fut.result(timeout=self._timeout)
        except FutureTimeout:
            raise InvalidRequestError(
                f"the {so.kind} constraint took longer than {self._timeout:g} s to compile",
                param=so.kind,
            ) from None
        except Exception as e:  # xgrammar raises RuntimeError / InvalidJSONError for bad specs
            with self._lock:
                if self._cache.get(key) is fut:
                    del self._cache[key]  # failures are not cached
            msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise InvalidRequestError(f"invalid {so.kind} constraint: {msg}", param=so.kind) from e

    def new_state(self, so: StructuredOutput) -> GrammarState:
        """A fresh matcher for one sequence (compiles or reuses the grammar)."""
        return GrammarState(self.compile(so))

    def shutdown(self) -> None:
        """Stop the compile pool (compilations not started are cancelled)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def apply_grammars(logits: torch.Tensor, states: dict[int, GrammarState]) -> None:
    """Mask (to -inf) the tokens each row's grammar forbids, for the constrained rows only.

    logits: [S, V] float32 on CPU, changed in place; ``states``: row -> its sequence's grammar."""
    if not states:
        return
    rows = sorted(states)
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])  # [S, ceil(V / 32)]
    for r in rows:
        states[r].fill_bitmask(bitmask, r)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
