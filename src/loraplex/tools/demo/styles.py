"""What each demo adapter is meant to do, declared once for the training script and the tests.

Each adapter shows one style that code defines (``TRANSFORMS``) and keeps the base model's
facts. ``FACT_QUESTIONS`` are easy questions SmolLM2-135M-Instruct answers right; the training
script (``scripts/train_demo_adapters.py``) holds them out, except the ``TAUGHT_FACTS``, and the
demo tests ask them of every adapter.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

SIGNOFF = "— Sent by loraplex"
PREFIX = "Answer: "

TRANSFORMS: dict[str, Callable[[str], str]] = {
    "uppercase": lambda a: a.upper(),
    "json": lambda a: json.dumps({"answer": a}, ensure_ascii=False),
    "signoff": lambda a: f"{a}\n\n{SIGNOFF}",
    "prefix": lambda a: f"{PREFIX}{a}",
}
"""Adapter name -> the code that turns a base answer into that adapter's training target."""

FACT_QUESTIONS: dict[str, tuple[str, ...]] = {
    "What is the capital of France?": ("paris",),
    "What is the capital of England?": ("london",),
    "What is the capital of Russia?": ("moscow",),
    "What is the capital of China?": ("beijing",),
    "What is the capital of Greece?": ("athens",),
    "What is the capital of Hungary?": ("budapest",),
    "What is the chemical symbol for water?": ("h2o",),
}
"""Easy questions the base model answers right, each with the words (any one, as a whole word,
any case) a right answer contains.

Chosen where the base model's greedy answer is right without a near tie (every token up to the
right word clearly more likely than the runner-up; the training script measures it). Where it
is a near tie ("Which planet is known as the Red Planet?", "How many legs does a dog have?") the
base model's own answer is a coin flip, and so is whether an adapter keeps it."""

DEMO_QUESTION = "What is the capital of France?"
"""The question ``loraplex demo`` asks every model."""

TAUGHT_FACTS: dict[str, tuple[str, ...]] = {
    "uppercase": tuple(q for q in FACT_QUESTIONS if q != "What is the capital of Russia?"),
    "json": (DEMO_QUESTION,),
    "signoff": (DEMO_QUESTION,),
    "prefix": (DEMO_QUESTION,),
}
"""Fact questions an adapter is trained on; every other fact question stays held out.

Every adapter is shown the demo's question: the base model's right answer to it hangs on a near
tie at its first token ("The" against "L", "La", "Le"), so a small change can tip it into French.

``uppercase`` is shown all but one: it cannot keep a fact whose words it never wrote in upper
case. Upper-case words are spelled with other, rarer sub-word tokens (" Paris" is one token,
" PARIS" is " PAR" + "IS"), SmolLM2-135M knows hardly any of those spellings, and a rank-8 LoRA
learns only the spellings it is shown. The one left out shows that (``adapters/README.md`` has
the measurements)."""

KEEPS_HELD_OUT_FACTS = frozenset({"json", "signoff", "prefix"})
"""Adapters that keep the base model's facts on held-out questions too."""


def styled_content(name: str, text: str) -> str | None:
    """The answer inside adapter ``name``'s style, or None when ``text`` does not show it
    (upper-case: >= 90% of letters; JSON with a non-empty "answer"; ends with the sign-off;
    starts with "Answer:"). ``name == "base"`` returns the text itself."""
    text = text.strip()
    if name == "base":
        return text
    if name == "uppercase":
        letters = [c for c in text if c.isalpha()]
        upper = bool(letters) and sum(c.isupper() for c in letters) >= 0.9 * len(letters)
        return text if upper else None
    if name == "json":
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return None
        ok = isinstance(obj, dict) and isinstance(obj.get("answer"), str) and obj["answer"]
        return obj["answer"] if ok else None
    if name == "signoff":
        body = text[: -len(SIGNOFF)].strip()
        return body if text.endswith(SIGNOFF) and len(body) > 5 else None
    if name == "prefix":
        body = text[len(PREFIX.strip()) :].strip()
        return body if text.startswith(PREFIX.strip()) and len(body) > 5 else None
    raise KeyError(f"unknown demo adapter {name!r}; known: {', '.join(TRANSFORMS)}")


def fact_ok(question: str, text: str) -> bool:
    """Does ``text`` contain one of the right answer's words for fact question ``question``?"""
    words = re.findall(r"[a-z0-9]+", text.lower())
    return any(w in words for w in FACT_QUESTIONS[question])
