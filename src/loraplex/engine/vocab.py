"""What one token id stands for, on its own: its vocabulary piece, its bytes and a text key.

Logprobs name tokens one at a time. Decoding a single byte-level token that holds part of a
UTF-8 character gives U+FFFD, so every such token would get the same name ("\\ufffd") and
their entries would merge. Instead each token is named by its bytes where they are valid UTF-8
and by its own vocabulary piece otherwise; ``bytes`` are the token's real bytes:

    byte-level BPE (GPT-2, Llama 3, Qwen)  piece "Ġthe" -> bytes b" the" (the GPT-2 byte map)
    SentencePiece with byte fallback       "<0xE2>" -> b"\\xe2";  "▁the" -> b" the"
    added / special tokens                 their text, as UTF-8
    any other tokenizer                    the UTF-8 of decode([id])

The kind is read once from the tokenizer's decoder (``tokenizers`` JSON); results are memoised
per id (bounded by the vocabulary).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character -> byte (the inverse of ``bytes_to_unicode``)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _decoder_types(tokenizer: Any) -> set[str]:
    """The ``type`` of the fast tokenizer's decoder and of every decoder it chains."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return set()
    try:
        spec = json.loads(decoder.__getstate__())
    except (TypeError, ValueError, AttributeError):
        return set()
    found: set[str] = set()
    todo = [spec]
    while todo:
        d = todo.pop()
        if isinstance(d, dict):
            found.add(str(d.get("type")))
            todo.extend(d.get("decoders") or [])
    return found


class TokenVocab:
    """Token id -> (piece, bytes, text key) for one tokenizer (thread-safe: reads only)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        kinds = _decoder_types(tokenizer)
        self.byte_level = "ByteLevel" in kinds
        self.metaspace = bool(kinds & {"Metaspace", "Replace", "ByteFallback"})
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added = {int(i) for i in added}
        self._memo: dict[int, tuple[str, bytes, str]] = {}

    def piece(self, token_id: int) -> str:
        """The token's own vocabulary entry (``convert_ids_to_tokens``)."""
        return self.info(token_id)[0]

    def token_bytes(self, token_id: int) -> bytes:
        return self.info(token_id)[1]

    def text(self, token_id: int) -> str:
        """The token's name in logprobs: its bytes as text where they are valid UTF-8, else
        its vocabulary piece (two ids never share a name unless their bytes are equal)."""
        return self.info(token_id)[2]

    def info(self, token_id: int) -> tuple[str, bytes, str]:
        got = self._memo.get(token_id)
        if got is None:
            got = self._compute(token_id)
            self._memo[token_id] = got
        return got

    def _compute(self, tid: int) -> tuple[str, bytes, str]:
        tok = self.tokenizer
        piece = tok.convert_ids_to_tokens(tid)
        if piece is None:
            piece = tok.decode([tid])
        piece = str(piece)
        raw = self._bytes(tid, piece)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = piece
        return piece, raw, text

    def _bytes(self, tid: int, piece: str) -> bytes:
        if tid in self._added:
            return piece.encode("utf-8")
        if self.byte_level:
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        if self.metaspace:
            m = _BYTE_PIECE.fullmatch(piece)
            if m is not None:
                return bytes([int(m.group(1), 16)])
            return piece.replace("\u2581", " ").encode("utf-8")
        return str(self.tokenizer.decode([tid])).encode("utf-8")
