"""Incremental detokenization through ``tokenizers``' DecodeStream equals a full decode, for a
byte-level BPE and a SentencePiece-style (Metaspace + byte fallback) tokenizer, and outputs
carry per-token text offsets (``token_text_ends``) for one-chunk-per-token streaming."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from loraplex import LLM, SamplingParams
from loraplex.engine.detokenizer import (
    IncrementalDetokenizer,
    StreamDetokenizer,
    make_detokenizer,
)
from loraplex.testing import _CORPUS

TEXTS = [" é😀 ünï ", "日本語のテキスト", " naïve café — ok", "\u2028line\u0085next"]


def _sentencepiece_like() -> PreTrainedTokenizerFast:
    """A Llama-style tokenizer: BPE over Metaspace pieces, <0xNN> byte fallback tokens."""
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tr = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    t.train_from_iterator(_CORPUS * 4, tr)
    model = json.loads(t.to_str())["model"]
    vocab = model["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    sp = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    sp.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    sp.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=sp, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def tokenizer(request: pytest.FixtureRequest, tiny_model: Path) -> Any:
    if request.param == "byte_level":
        return AutoTokenizer.from_pretrained(str(tiny_model))
    return _sentencepiece_like()


def test_stream_equals_full_decode_for_valid_text(tokenizer: Any) -> None:
    rnd = random.Random(0)
    for trial in range(60):
        prompt = tokenizer(rnd.choice(_CORPUS)[: rnd.randrange(3, 40)]).input_ids
        text = rnd.choice(TEXTS) + rnd.choice(_CORPUS)[: rnd.randrange(1, 30)]
        out = tokenizer(text, add_special_tokens=False).input_ids
        if trial % 3 == 0:
            out.append(tokenizer.eos_token_id)  # a special token, skipped or not
        for skip in (True, False):
            d = make_detokenizer(tokenizer, prompt, skip)
            assert isinstance(d, StreamDetokenizer)
            pieces = [d.add([t]) for t in out]
            pieces.append(d.flush())
            full = tokenizer.decode(prompt + out, skip_special_tokens=skip)
            want = full[len(tokenizer.decode(prompt, skip_special_tokens=skip)) :]
            assert d.text == "".join(pieces) == want
            assert "\ufffd" not in d.text
            if any(ord(c) > 0xFFF for c in text):  # 3-4 byte characters take byte tokens:
                assert "" in pieces[:-1]  # tokens ending mid-character add no text yet


def test_stream_matches_window_detokenizer_on_arbitrary_ids(tokenizer: Any) -> None:
    """Arbitrary id runs (invalid UTF-8 included, which makes DecodeStream give up) give the
    same append-only text as the window detokenizer, apart from how many U+FFFD an invalid run
    becomes."""
    rnd = random.Random(1)
    vocab = len(tokenizer)
    for _ in range(80):
        prompt = tokenizer(rnd.choice(_CORPUS)[:20]).input_ids
        out = [rnd.randrange(0, vocab) for _ in range(rnd.randrange(1, 25))]
        d = make_detokenizer(tokenizer, prompt, True)
        w = IncrementalDetokenizer(tokenizer, prompt, True)
        grown = ""
        for t in out:
            d.add([t])
            w.add([t])
            assert d.text.startswith(grown)  # append-only
            grown = d.text
        d.flush()
        w.flush()
        assert d.text.replace("\ufffd", "") == w.text.replace("\ufffd", "")


def test_token_text_ends_cut_the_text_per_token(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), dtype="float32", enable_lora=False)
    eng = llm.engine
    sp = SamplingParams(temperature=1.3, seed=4, max_tokens=40, ignore_eos=True, n=2)
    eng.add_request("r", "Hello", sp)
    sent = [0, 0]  # per completion: tokens whose text was handed out
    texts = ["", ""]
    while eng.has_unfinished_requests():
        for out in eng.step():
            for o in out.outputs:
                ends = o.token_text_ends
                assert len(ends) == len(o.token_ids)
                assert ends == sorted(ends) and (not ends or ends[-1] <= len(o.text))
                prev = ends[sent[o.index] - 1] if sent[o.index] else 0
                for e in ends[sent[o.index] :]:  # one chunk per new token, possibly empty
                    texts[o.index] += o.text[prev:e]
                    prev = e
                sent[o.index] = len(ends)
                if out.finished:
                    assert ends[-1] == len(o.text) and texts[o.index] == o.text
    assert all(texts)
    # stop strings truncate the text: the offsets never point past it
    full = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    text = full[0].outputs[0].text
    stop = text[3:5]
    out = llm.generate(
        "Hello", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop])
    )[0].outputs[0]
    assert out.text == text[: text.find(stop)]
    assert len(out.token_text_ends) == len(out.token_ids)
    assert max(out.token_text_ends) == len(out.text)
