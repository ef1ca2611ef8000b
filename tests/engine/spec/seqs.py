"""Real :class:`~loraplex.engine.sequence.Sequence` objects for the drafting tests, with real
:class:`~loraplex.lora.adapter.LoRAAdapter` identities (the proposers read only their refs)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence as Seq

from loraplex.engine.sequence import Sequence
from loraplex.lora.adapter import LoRAAdapter
from loraplex.requests import SamplingParams
from loraplex.types import AdapterRef


def adapter(name: str) -> LoRAAdapter:
    """An adapter identity whose digest is derived from ``name`` (no weights: nothing runs)."""
    digest = hashlib.sha256(name.encode()).hexdigest()
    return LoRAAdapter(AdapterRef(name, "1", digest), f"/adapters/{name}", {}, {})


def make_seq(
    prompt: Seq[int],
    output: Seq[int] = (),
    *,
    tenant: str | None = "t0",
    adapters: Seq[LoRAAdapter] = (),
    scales: tuple[float, ...] | None = None,
    cache_salt: str | None = None,
    rid: str = "r",
) -> Sequence:
    """A running sequence: ``prompt`` computed, ``output`` sampled so far, ``adapters`` (the
    first is ``adapter``, the rest ``composed``; ``scales`` makes it a composition)."""
    params = SamplingParams(max_tokens=1 << 12, ignore_eos=True)
    seq = Sequence(
        rid,
        None,
        list(prompt),
        params,
        1 << 12,
        adapter=adapters[0] if adapters else None,
        composed=tuple(adapters[1:]),
        scales=scales,
        tenant=tenant,
        cache_salt=cache_salt,
    )
    seq.output_token_ids.extend(output)
    return seq
