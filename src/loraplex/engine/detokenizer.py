"""Incremental detokenization: O(1) text per generated token, append-only output.

Decoding the whole output every step costs O(n) per token and, for byte-level tokenizers, can
change the last characters of earlier text (an incomplete UTF-8 sequence decodes to U+FFFD until
its last byte arrives). Streaming needs text that only grows, so we decode a short window:

    prefix_text = decode(ids[prefix:read])      # already emitted, used as context
    window_text = decode(ids[prefix:])
    if window_text is longer and does not end in U+FFFD:
        emit window_text[len(prefix_text):]; prefix, read = read, len(ids)

The window starts a few prompt tokens back so that tokenizers whose decoding depends on the
previous token (SentencePiece's leading spaces) produce the same text as a full decode.

Fast (``tokenizers``-backed) tokenizers use :class:`StreamDetokenizer` instead: ``tokenizers``'
own ``DecodeStream``, primed with the same prompt suffix, does this bookkeeping in Rust (one
step per token, ``None`` while a character is incomplete). :func:`make_detokenizer` picks one.
"""

from __future__ import annotations

from typing import Any, Protocol

_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into append-only text."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly complete text (may be empty while a character is
        still incomplete)."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        window = self._decode(self._ids[self._prefix :])
        if len(window) <= len(prefix_text) or window.endswith(_INCOMPLETE):
            return ""
        delta = window[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (the sequence ended), incomplete characters included."""
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        window = self._decode(self._ids[self._prefix :])
        delta = window[len(prefix_text) :]
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta


class Detokenizer(Protocol):
    """What the engine needs from a detokenizer: append-only ``text``."""

    text: str

    def add(self, token_ids: list[int]) -> str: ...

    def flush(self) -> str: ...


class StreamDetokenizer:
    """Append-only text through ``tokenizers.decoders.DecodeStream`` (fast tokenizers)."""

    def __init__(
        self, tokenizer: Any, backend: Any, prompt_ids: list[int], skip_special_tokens: bool
    ) -> None:
        from tokenizers.decoders import DecodeStream

        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._backend = backend  # the tokenizers.Tokenizer behind the HF tokenizer
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._stream: Any = DecodeStream(skip_special_tokens=skip_special_tokens)
        try:
            for t in self._ids:  # prime with the context; its text is the prompt's, not ours
                self._stream.step(backend, t)
        except Exception:  # an invalid byte run in the prompt: the window decode serves
            self._stream = None
        self._done = len(self._ids)  # ids whose text has been emitted
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly complete text (empty while a character is
        incomplete)."""
        delta = ""
        for t in token_ids:
            self._ids.append(t)
            if self._stream is not None:
                try:
                    chunk = self._stream.step(self._backend, t)
                except Exception:  # tokenizers gives up on some invalid byte runs
                    self._stream = None  # the window decode takes over for good
                else:
                    if chunk is not None:
                        delta += chunk
                        self._done = len(self._ids)
                    continue
            delta += self._window(final=False)
        self.text += delta
        return delta

    def _window(self, final: bool) -> str:
        """Text of the ids after ``_done``, decoded with a few ids before them as context;
        empty (and nothing consumed) while it ends in an incomplete character, unless final."""
        if self._done == len(self._ids):
            return ""
        ctx = max(0, self._done - _CONTEXT_TOKENS)
        prefix_text = self._tok.decode(self._ids[ctx : self._done], skip_special_tokens=self._skip)
        window = self._tok.decode(self._ids[ctx:], skip_special_tokens=self._skip)
        if not final and (len(window) <= len(prefix_text) or window.endswith(_INCOMPLETE)):
            return ""
        self._done = len(self._ids)
        return window[len(prefix_text) :]

    def flush(self) -> str:
        """Emit what is still held (the sequence ended), incomplete characters included (as
        U+FFFD, like a full decode)."""
        delta = self._window(final=True)
        self.text += delta
        return delta


def make_detokenizer(
    tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool
) -> Detokenizer:
    """A :class:`StreamDetokenizer` where the tokenizer is backed by ``tokenizers`` (and its
    ``DecodeStream`` exists), else the window :class:`IncrementalDetokenizer`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream  # noqa: F401
    except ImportError:  # tokenizers too old for DecodeStream
        return IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    if isinstance(backend, Tokenizer):
        return StreamDetokenizer(tokenizer, backend, prompt_ids, skip_special_tokens)
    return IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
