"""How the engine loop hands a step's outputs to the readers' event loop: one wake-up per event
loop per step (``call_soon_threadsafe`` writes to the loop's self-pipe and queues a handle, so one
per request per token is a cost the engine thread pays under the GIL for every stream), and every
reader still gets its output."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loraplex.config import EngineConfig
from loraplex.engine.client import EngineClient
from loraplex.requests import GenerationRequest, SamplingParams
from loraplex.testing.sync import StepGate, wait_until


def test_one_wake_up_per_step_reaches_every_reader(tiny_model: Path) -> None:
    client = EngineClient.from_config(
        EngineConfig(model=str(tiny_model), dtype="float32", num_kv_blocks=64, enable_lora=False)
    )
    client.start()
    n = 6

    async def run() -> None:
        loop = asyncio.get_running_loop()
        real: Callable[..., Any] = loop.call_soon_threadsafe
        from_engine: list[int] = []

        def counting(*args: Any, **kw: Any) -> Any:  # the real loop's own method, counted
            if threading.current_thread().name == "loraplex-engine":
                from_engine.append(1)
            return real(*args, **kw)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        with StepGate(client.engine) as gate:
            gate.hold()
            prepared = [
                await client.prepare(GenerationRequest(f"r{i}", [5, 6, 7, 8 + i], params))
                for i in range(n)
            ]
            streams = [client.generate(p) for p in prepared]
            await asyncio.to_thread(wait_until, lambda: client.engine.num_waiting == n)
            await asyncio.to_thread(gate.wait_held)
            assert from_engine == []
            gate.allow(1)  # one step: every request's prompt, and its first token
            await asyncio.to_thread(gate.wait_held)
            assert gate.passed == 1
            assert len(from_engine) == 1, "one wake-up for the whole step"
            firsts = [await s.__anext__() for s in streams]
            assert [len(o.outputs[0].token_ids) for o in firsts] == [1] * n
            gate.open()
            lasts = []
            for s, last in zip(streams, firsts, strict=True):
                async for out in s:
                    last = out
                lasts.append(last)
            passed = gate.passed
        assert all(o.finished and len(o.outputs[0].token_ids) == 3 for o in lasts)
        assert passed == 3  # two more steps, n outputs each: at most one wake-up each
        assert 1 <= len(from_engine) <= passed

    try:
        asyncio.run(run())
    finally:
        client.shutdown()
