"""A file digest that two threads can compute while they read: BLAKE3 over fixed segments.

A disk-tier re-read must read every byte and hash every byte. One BLAKE3 stream hashes slower
than the page cache copies, so read-then-hash costs several raw reads. Splitting the file into
fixed segments lets the caller and one helper thread each read (``os.preadv``) and hash whole
segments (both release the GIL), so the pair costs about half of read + hash (figures:
docs/benchmarks.md).

The digest of ``data`` with segment size ``s``::

    BLAKE3(len(data) as 8 bytes LE || s as 8 bytes LE || BLAKE3(seg_0) || BLAKE3(seg_1) || ...)

where ``seg_i = data[i*s : (i+1)*s]`` (the last may be short; none for empty data). Two inputs
with equal digests are equal unless BLAKE3 collides (same length and segment size fix the
segment boundaries; each segment's digest is compared through the outer hash).
"""

from __future__ import annotations

import os
import threading
from itertools import count
from typing import TYPE_CHECKING

from blake3 import blake3

from loraplex.workers import IdleWorker

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

SEGMENT = 1 << 20
"""Bytes per segment: large enough that per-segment Python work is noise beside hashing it,
small enough that a 2.5 MB rank-8 file still splits across two threads and a segment stays in a
core's L2 between its read and its hash."""


def segmented_digest(data: Buffer, segment: int = SEGMENT) -> bytes:
    """The segmented BLAKE3 digest of in-memory ``data`` (see the module docstring)."""
    with memoryview(data) as v:
        v = v.cast("B")
        parts = [blake3(v[a : a + segment]).digest() for a in range(0, len(v), segment)]
    return _combine(len(v), segment, parts)


def _combine(size: int, segment: int, parts: list[bytes]) -> bytes:
    h = blake3(size.to_bytes(8, "little") + segment.to_bytes(8, "little"))
    for p in parts:
        h.update(p)
    return h.digest()


class _Share:
    """One file's segments, handed out to whichever thread asks next."""

    def __init__(self, fd: int, view: memoryview, segment: int) -> None:
        self.fd, self.view, self.segment = fd, view, segment
        self.n = -(-len(view) // segment)
        self.parts: list[bytes | None] = [None] * self.n
        self._next = count()  # next() on a count is atomic under the GIL
        self.failed: Exception | None = None
        self.lock = threading.Lock()
        self.helper_started = False
        self.helper_skip = False  # the caller finished first: the helper must not touch view
        self.helper_done = threading.Event()

    def work(self) -> None:
        """Read and hash segments until none are left (or a read fails)."""
        seg, view = self.segment, self.view
        try:
            while self.failed is None:
                i = next(self._next)
                if i >= self.n:
                    return
                a = i * seg
                part = view[a : a + seg]
                got, want = 0, len(part)
                while got < want:
                    k = os.preadv(self.fd, [part[got:]], a + got)
                    if k == 0:
                        raise OSError(f"short read at byte {a + got} of {len(view)}")
                    got += k
                self.parts[i] = blake3(part).digest()
        except Exception as e:  # any failure on either thread: no digest
            self.failed = e

    def helper_job(self) -> None:
        with self.lock:
            if self.helper_skip:
                return
            self.helper_started = True
        try:
            self.work()
        finally:
            self.helper_done.set()

    def join(self) -> None:
        """After the caller's own ``work``: wait for the helper only if it started."""
        with self.lock:
            self.helper_skip = not self.helper_started
        if not self.helper_skip:
            self.helper_done.wait()


def read_digest(
    fd: int, buffer: Buffer, *, segment: int = SEGMENT, helper: IdleWorker | None = None
) -> bytes | None:
    """Fill ``buffer`` with the first ``len(buffer)`` bytes of the open file ``fd`` (positional
    reads; the file offset is not used) and return their segmented digest; None if the file
    ends early or a read fails. With ``helper``, its thread reads and hashes segments beside the
    caller (if it is busy, the caller does them all and does not wait for it)."""
    with memoryview(buffer) as view:
        share = _Share(fd, view.cast("B"), segment)
        if helper is not None and share.n > 1:
            helper.submit(share.helper_job)
        share.work()
        share.join()
        size = len(share.view)
        share.view.release()  # a skipped helper job still queued must not keep buffer alive
        parts = [p for p in share.parts if p is not None]
        if share.failed is not None or len(parts) != share.n:
            return None
        return _combine(size, segment, parts)
