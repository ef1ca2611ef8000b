"""A sequence's recent tokens as a numpy array, kept in step with the sequence, and the suffix
match both lookup drafters (``ngram``, ``suffix``) start from.

Drafting runs every step for every running sequence, so neither rebuilds anything per step:
:class:`TokenWindow` copies only the tokens appended since the last step, and
:func:`longest_suffix_match` compares the window once (one vectorized pass) and then only
the positions that still match.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from loraplex.engine.sequence import Sequence

DEFAULT_WINDOW_TOKENS = 1 << 15
"""How far back a lookup drafter searches (the last 32768 tokens of a sequence): bounds each
step's scan and each request's buffer (``2 x window x 4`` bytes at most)."""
MAX_CANDIDATES = 1024
"""The most recent occurrences of the last token a match is extended from (fewer for long
matches: ``min(1024, 65536 // max_n)``): bounds a step's work on a context that repeats one
token thousands of times to about 64k token comparisons per sequence."""
_MAX_COMPARED = 1 << 16
_BLOCK = 32  # tokens compared per pass when extending a match
_MIN_WINDOW_TOKENS = 64
_APPEND_AT_MOST = 64  # more new tokens than this at once (a first look, a rollback): rebuild

_EMPTY = np.empty(0, dtype=np.int64)


class TokenWindow:
    """The last ``size`` tokens of one sequence (``view()``: int32, oldest first).

    :meth:`sync` appends what the sequence gained since the last call; a sequence that got
    shorter or whose last seen token changed (a rollback) is read again from scratch. (A
    change it cannot see would only cost draft quality: drafts are verified.)"""

    __slots__ = ("buf", "n", "seen", "size")

    def __init__(self, size: int = DEFAULT_WINDOW_TOKENS) -> None:
        self.size = max(int(size), _MIN_WINDOW_TOKENS)
        self.buf = np.empty(0, dtype=np.int32)  # [capacity] capacity <= 2 * size
        self.n = 0  # tokens held: buf[:n]
        self.seen = 0  # the sequence's length at the last sync

    @property
    def nbytes(self) -> int:
        return int(self.buf.nbytes)

    def view(self) -> np.ndarray:
        """``[n]`` int32: the sequence's last ``n <= size`` tokens (the buffer holds up to twice
        as many, so that appending slides it only once per ``size`` tokens)."""
        return self.buf[max(0, self.n - self.size) : self.n]

    def sync(self, seq: Sequence) -> np.ndarray:
        """Catch up with ``seq`` and return :meth:`view`."""
        total = seq.num_tokens
        stale = total < self.seen or (
            self.n > 0 and seq.token_at(self.seen - 1) != int(self.buf[self.n - 1])
        )
        if stale or total - self.seen > _APPEND_AT_MOST:
            tail = seq.all_token_ids[-self.size :]
            self.n = 0
            self._append(np.asarray(tail, dtype=np.int32))
        elif total > self.seen:
            new = [seq.token_at(i) for i in range(self.seen, total)]
            self._append(np.asarray(new, dtype=np.int32))
        self.seen = total
        return self.view()

    def _append(self, new: np.ndarray) -> None:
        k = int(new.shape[0])
        if k >= self.size:
            self.buf = new[-self.size :].copy()
            self.n = self.size
            return
        if self.n + k > self.buf.shape[0]:
            cap = self.buf.shape[0]
            keep = self.n if self.n + k <= 2 * self.size else self.size - k
            if keep + k > cap:  # grow (doubling, up to twice the window)
                cap = min(2 * self.size, max(2 * cap, keep + k, 256))
                grown = np.empty(cap, dtype=np.int32)
                grown[:keep] = self.buf[self.n - keep : self.n]
                self.buf = grown
            else:  # full at twice the window: slide the last `keep` tokens to the front
                self.buf[:keep] = self.buf[self.n - keep : self.n].copy()
            self.n = keep
        self.buf[self.n : self.n + k] = new
        self.n += k


class SequenceWindows:
    """Each sequence's :class:`TokenWindow`, made on its first draft, dropped when it ends."""

    def __init__(self, size: int = DEFAULT_WINDOW_TOKENS) -> None:
        self.size = size
        self._by_seq: dict[Sequence, TokenWindow] = {}

    def __len__(self) -> int:
        return len(self._by_seq)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in list(self._by_seq.values()))

    def tokens(self, seq: Sequence) -> np.ndarray:
        """``seq``'s last tokens (``[n]`` int32), caught up with it."""
        win = self._by_seq.get(seq)
        if win is None:
            win = self._by_seq[seq] = TokenWindow(self.size)
        return win.sync(seq)

    def drop(self, seq: Sequence) -> None:
        self._by_seq.pop(seq, None)

    def clear(self) -> None:
        self._by_seq.clear()


def longest_suffix_match(a: np.ndarray, max_n: int) -> tuple[int, np.ndarray]:
    """The longest suffix of ``a`` (at most ``max_n`` tokens) that also occurs earlier in ``a``
    with at least one token after it, and where each such occurrence ends; searched among the
    ``min(MAX_CANDIDATES, 65536 // max_n)`` (at least 16) most recent occurrences of the last
    token.

    Returns ``(m, ends)``: ``ends`` ascending int64 indices ``e < len(a) - 1`` with
    ``a[e - m + 1 : e + 1] == a[-m:]``; ``(0, [])`` when the last token never occurred before.
    Cost: one comparison over ``a``, then one ``[candidates, 32]`` comparison per 32 tokens
    of match length.
    """
    n = int(a.shape[0])
    if n < 2 or max_n < 1:
        return 0, _EMPTY
    keep = max(16, min(MAX_CANDIDATES, _MAX_COMPARED // max_n))
    ends = np.flatnonzero(a[: n - 1] == a[n - 1])[-keep:]
    if ends.size == 0:
        return 0, _EMPTY
    m = 1
    while True:  # extend by up to _BLOCK tokens per pass
        b = min(_BLOCK, max_n - m, n - 1 - m)  # an earlier occurrence ends at n - 2 at most
        if b <= 0:
            return m, ends
        offs = np.arange(m, m + b)  # [b] how far back from each end
        back = ends[:, None] - offs[None, :]  # [c, b] positions compared, row per candidate
        same = (a[np.maximum(back, 0)] == a[n - 1 - offs][None, :]) & (back >= 0)  # [c, b]
        run = np.where(same.all(axis=1), b, same.argmin(axis=1))  # [c] tokens matched further
        longest = int(run.max())
        if longest == 0:
            return m, ends
        ends, m = ends[run == longest], m + longest
        if longest < b:
            return m, ends
