"""Offline API mirroring vLLM's ``LLM``: build once, ``generate`` batches of prompts."""

from __future__ import annotations

import itertools
import json
import numbers
from collections.abc import Sequence
from typing import Any

from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.outputs import RequestOutput
from loraplex.requests import LoRARequest, SamplingParams
from loraplex.types import (
    MAX_COMPOSED_ADAPTERS,
    AdapterComposition,
    AdapterRef,
    InvalidRequestError,
    ScaledAdapter,
)

Prompt = str | list[int] | dict[str, Any]
"""A string, token ids, or vLLM's dict forms ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}``."""

LoRAChoice = LoRARequest | Sequence[LoRARequest] | None
"""One prompt's adapters: one (at its ``lora_scale``), several that compose, or None (base)."""


def _lora_requests(choice: Any) -> list[LoRARequest]:
    """The LoRARequests of one prompt's choice (for counting distinct directories)."""
    if isinstance(choice, LoRARequest):
        return [choice]
    if isinstance(choice, (list, tuple)):
        return [c for c in choice if isinstance(c, LoRARequest)]
    return []


class LLM:
    """``LLM(model=DIR, enable_lora=True, max_loras=8, ...)``; keyword names follow vLLM."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        known = set(EngineConfig.__dataclass_fields__)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"LLM() got unknown option(s) {unknown}; known: {sorted(known - {'model'})}"
            )
        spec = kwargs.get("speculative_config")
        if isinstance(spec, dict):  # vLLM takes the object itself; the config holds its text
            kwargs["speculative_config"] = json.dumps(spec)
        self.engine = LLMEngine(EngineConfig(model=str(model), **kwargs))
        self._ids = itertools.count()

    def add_lora(self, lora_request: LoRARequest, *, persist_disk: bool = False) -> AdapterRef:
        """Load or push an adapter and make it its name's active revision (see
        :meth:`LLMEngine.add_lora`); ``LoRARequest(name)`` then serves it."""
        return self.engine.add_lora(lora_request, persist_disk=persist_disk)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRAChoice] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        ``lora_request`` is one request for all prompts or a list with one per prompt (None = base).
        A prompt's entry may itself be a list of ``LoRARequest`` s: they compose (vLLM RFC
        #51940), each added at its ``lora_scale``::

            llm.generate(["q1", "q2"], lora_request=[
                [LoRARequest("domain", path=d), LoRARequest("style", path=s, lora_scale=0.5)],
                LoRARequest("domain", path=d, lora_scale=0.8),   # one adapter, scaled
            ])

        At most ``MAX_COMPOSED_ADAPTERS`` (4) distinct adapters per prompt; a bad list (empty,
        too long, an adapter twice, a non-finite or out-of-range scale) raises
        InvalidRequestError.
        Any invalid prompt or adapter raises before anything runs. Every adapter of the call is
        held in host memory until the call ends, so for its duration the ``max_cpu_loras``
        count grows to the number of distinct adapter paths in the call (the byte budget,
        ``max_cpu_lora_bytes``, still holds); afterwards it is ``max_cpu_loras`` again.
        """
        if not isinstance(prompts, (str, dict, list, tuple)):
            prompts = list(prompts)  # e.g. a 1-D array of token ids
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple))
            and prompts
            and isinstance(prompts[0], numbers.Integral)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = [self._unwrap(p) for p in prompts]  # type: ignore[union-attr]
        n = len(prompts)
        params = self._per_prompt(sampling_params or SamplingParams(), n, "sampling_params")
        choices = self._per_prompt(lora_request, n, "lora_request")
        paths = {lr.path or lr.name for c in choices for lr in _lora_requests(c)}
        loras = [self.adapters_of(c) for c in choices]
        ids = [f"gen-{next(self._ids)}" for _ in range(n)]
        cache = self.engine.adapters
        if cache is None:
            return self._generate(ids, prompts, params, loras, use_tqdm)
        with cache.host_copies_at_least(len(paths)):
            return self._generate(ids, prompts, params, loras, use_tqdm)

    def adapters_of(self, choice: LoRAChoice) -> LoRARequest | AdapterComposition | None:
        """A prompt's adapters as the engine takes them: a list of LoRARequests becomes an
        :class:`AdapterComposition` of their specs (the engine's local catalog hashes each
        directory once), each at its ``lora_scale``."""
        if not isinstance(choice, (list, tuple)):
            return choice
        if not choice:
            raise InvalidRequestError(
                "an empty list of LoRA requests for a prompt; pass None for the base model",
                param="lora_request",
            )
        if len(choice) > MAX_COMPOSED_ADAPTERS:
            raise InvalidRequestError(
                f"a prompt composes at most {MAX_COMPOSED_ADAPTERS} adapters, got {len(choice)}",
                param="lora_request",
            )
        bad = next((c for c in choice if not isinstance(c, LoRARequest)), None)
        if bad is not None:
            raise InvalidRequestError(
                f"a prompt's list of adapters holds a {type(bad).__name__}, not a LoRARequest",
                param="lora_request",
            )
        if self.engine.adapters is None:
            raise InvalidRequestError(
                "adapters requested but LoRA is disabled (enable_lora)", param="lora_request"
            )
        specs = [self.engine.intake.adapter_spec(lr) for lr in choice]
        return AdapterComposition(
            tuple(
                ScaledAdapter(spec, lr.lora_scale)
                for spec, lr in zip(specs, choice, strict=True)
                if spec is not None
            )
        )

    def _generate(
        self,
        ids: list[str],
        prompts: list[str | list[int]],
        params: list[SamplingParams],
        loras: list[LoRARequest | AdapterComposition | None],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        n = len(ids)
        added: list[str] = []
        try:
            for rid, prompt, sp, lr in zip(ids, prompts, params, loras, strict=True):
                self.engine.add_request(rid, prompt, sp, lr)
                added.append(rid)
        except Exception:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=n, desc="generate")
        try:
            while len(done) < n:
                for out in self.engine.step():
                    if out.finished and out.request_id in ids:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                if not self.engine.has_unfinished_requests() and len(done) < n:
                    raise RuntimeError(
                        "engine stopped with unfinished requests"
                    )  # pragma: no cover
        except BaseException:  # e.g. KeyboardInterrupt: free what this call queued
            for rid in ids:
                if rid not in done:
                    self.engine.abort_request(rid)
            raise
        if bar is not None:
            bar.close()
        return [done[rid] for rid in ids]

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model directory's chat template to one conversation or a list, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = [
            self.engine.apply_chat_template(conv, add_generation_prompt)  # type: ignore[arg-type]
            for conv in convs  # type: ignore[union-attr]
        ]
        return self.generate(prompts, sampling_params, lora_request)

    @staticmethod
    def _unwrap(prompt: Prompt) -> str | list[int]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return str(prompt["prompt"])
            raise InvalidRequestError(
                f"prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}"
            )
        if isinstance(prompt, str):
            return prompt
        try:  # token ids: a list, tuple or array of integers
            return [int(t) for t in prompt]
        except (TypeError, ValueError) as e:
            raise InvalidRequestError(
                f"a prompt must be a string, token ids or a prompt dict, got {type(prompt).__name__}"
            ) from e

    @staticmethod
    def _per_prompt(value: Any, n: int, what: str) -> list[Any]:
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise InvalidRequestError(f"{what} has {len(value)} entries for {n} prompts")
            return list(value)
        return [value] * n
