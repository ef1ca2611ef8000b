"""The segmented file digest and the two-thread verified read behind L2 re-reads."""

from __future__ import annotations

import gc
import os
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest
from blake3 import blake3

from loraplex.lora import filehash
from loraplex.lora.filehash import read_digest, segmented_digest
from loraplex.testing.sync import EVENT_TIMEOUT_S, wait_until
from loraplex.workers import IdleWorker


def expected(data: bytes, segment: int) -> bytes:
    """The module docstring's definition, written out independently."""
    head = len(data).to_bytes(8, "little") + segment.to_bytes(8, "little")
    parts = b"".join(blake3(data[a : a + segment]).digest() for a in range(0, len(data), segment))
    return blake3(head + parts).digest()


@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 1000])
@pytest.mark.parametrize("segment", [1, 64, 1 << 20])
def test_digest_is_the_documented_construction(size: int, segment: int) -> None:
    data = os.urandom(size)
    assert segmented_digest(data, segment) == expected(data, segment)
    assert segmented_digest(bytearray(data), segment) == expected(data, segment)


def test_digest_depends_on_length_segment_and_every_byte() -> None:
    data = bytes(range(256)) * 4
    base = segmented_digest(data, 64)
    assert segmented_digest(data, 128) != base  # same bytes, other boundaries
    assert segmented_digest(data + b"\0", 64) != base
    assert segmented_digest(data[:-1], 64) != base
    for at in (0, 63, 64, 500, len(data) - 1):
        changed = bytearray(data)
        changed[at] ^= 1
        assert segmented_digest(changed, 64) != base, at


def write(tmp_path: Path, data: bytes) -> Path:
    p = tmp_path / "f.bin"
    p.write_bytes(data)
    return p


@pytest.mark.parametrize("with_helper", [False, True])
def test_read_fills_the_buffer_and_digests_it(tmp_path: Path, with_helper: bool) -> None:
    data = os.urandom(10_000)
    helper = IdleWorker("test-read") if with_helper else None
    buf = bytearray(len(data))
    with open(write(tmp_path, data), "rb") as f:
        assert read_digest(f.fileno(), buf, segment=333, helper=helper) == expected(data, 333)
    assert bytes(buf) == data


def test_a_file_shorter_than_the_buffer_is_no_digest(tmp_path: Path) -> None:
    data = os.urandom(1000)
    with open(write(tmp_path, data), "rb") as f:
        for helper in (None, IdleWorker("test-read")):
            assert read_digest(f.fileno(), bytearray(1001), segment=100, helper=helper) is None
            assert read_digest(f.fileno(), bytearray(1000), segment=100, helper=helper) == (
                expected(data, 100)
            )


def test_both_threads_read_and_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller's first read waits until the helper has read a segment: both threads take
    part, each segment once, and the digest is still the whole file's."""
    data = os.urandom(64 * 50)
    readers: dict[int, list[int]] = {}
    helper_read = threading.Event()
    caller = threading.get_ident()
    real = os.preadv

    def preadv(fd: int, bufs: list, offset: int) -> int:  # type: ignore[type-arg]
        me = threading.get_ident()
        if me == caller and not readers.get(caller):
            assert helper_read.wait(EVENT_TIMEOUT_S), "the helper never read"
        readers.setdefault(me, []).append(offset)
        if me != caller:
            helper_read.set()
        return real(fd, bufs, offset)

    monkeypatch.setattr(filehash.os, "preadv", preadv)
    buf = bytearray(len(data))
    with open(write(tmp_path, data), "rb") as f:
        got = read_digest(f.fileno(), buf, segment=64, helper=IdleWorker("test-read"))
    assert got == expected(data, 64) and bytes(buf) == data
    assert len(readers) == 2 and all(readers.values())
    offsets = sorted(o for v in readers.values() for o in v)
    assert offsets == list(range(0, len(data), 64))


def test_a_busy_helper_is_not_waited_for(tmp_path: Path) -> None:
    """If the helper is still on another job, the caller reads everything itself and returns
    without waiting; the helper's late turn then touches nothing."""
    helper = IdleWorker("test-read")
    release, blocked = threading.Event(), threading.Event()

    def other_job() -> None:
        blocked.set()
        release.wait(EVENT_TIMEOUT_S)

    helper.submit(other_job)
    assert blocked.wait(EVENT_TIMEOUT_S)
    data = os.urandom(5000)
    buf = bytearray(len(data))
    try:
        with open(write(tmp_path, data), "rb") as f:
            assert read_digest(f.fileno(), buf, segment=100, helper=helper) == expected(data, 100)
        assert bytes(buf) == data
    finally:
        release.set()
    done = threading.Event()
    helper.submit(done.set)  # jobs run in order: the skipped share's turn came and went
    assert done.wait(EVENT_TIMEOUT_S) and bytes(buf) == data


@pytest.mark.parametrize("busy", [False, True])
def test_the_buffer_is_not_kept_alive_by_the_helper(tmp_path: Path, busy: bool) -> None:
    """Neither the job the helper ran nor one still queued behind another keeps a load's
    buffer (megabytes) alive after the read returns."""
    helper = IdleWorker("test-read")
    release = threading.Event()
    if busy:
        helper.submit(lambda: release.wait(EVENT_TIMEOUT_S))
    data = os.urandom(5000)
    buf = np.zeros(len(data), dtype=np.uint8)
    gone = weakref.ref(buf)
    with open(write(tmp_path, data), "rb") as f:
        assert read_digest(f.fileno(), buf, segment=100, helper=helper) == expected(data, 100)
    assert buf.tobytes() == data
    del buf
    gc.collect()
    assert gone() is None
    release.set()


def test_a_read_error_on_either_thread_is_no_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = os.urandom(64 * 20)
    real = os.preadv

    def failing(fd: int, bufs: list, offset: int) -> int:  # type: ignore[type-arg]
        if offset == 64 * 7:
            raise OSError(5, "Input/output error")
        return real(fd, bufs, offset)

    monkeypatch.setattr(filehash.os, "preadv", failing)
    with open(write(tmp_path, data), "rb") as f:
        for helper in (None, IdleWorker("test-read")):
            assert read_digest(f.fileno(), bytearray(len(data)), segment=64, helper=helper) is None


def test_idle_worker_runs_jobs_in_order_and_exits_when_idle() -> None:
    worker = IdleWorker("test-idle", idle_exit_s=0.05)
    seen: list[int] = []
    done = threading.Event()
    for i in range(5):
        worker.submit(lambda i=i: seen.append(i))
    worker.submit(lambda: 1 / 0)  # logged; the next job still runs
    worker.submit(done.set)
    assert done.wait(EVENT_TIMEOUT_S) and seen == [0, 1, 2, 3, 4]
    wait_until(lambda: not worker.alive, what="the idle worker thread exited")
    again = threading.Event()
    worker.submit(again.set)  # a new thread for the next job
    assert again.wait(EVENT_TIMEOUT_S)
