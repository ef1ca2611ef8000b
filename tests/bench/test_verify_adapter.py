"""``loraplex verify`` on the tiny model: a good adapter passes; a silent no-op (targets that
match nothing, or all-zero B) and an adapter trained for another base fail with a clear report."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from loraplex.testing import make_random_adapter, make_random_model
from loraplex.tools import verify


def test_good_adapter_passes(tiny_model: Path, adapters: dict[str, Path], capsys) -> None:
    rc = verify.main([str(adapters["all_r8"]), "--model", str(tiny_model), "--max-tokens", "6",
                      "--prompt", "Hello world", "--prompt", "def add(a, b):"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.splitlines()[-1].startswith("OK: the engine (adapter unmerged) equals")
    assert "rank 8, 21 modules" in out  # 3 layers x 7 projections
    # JSON, rank_pattern/rsLoRA adapter: numbers, not just a verdict
    rc = verify.main([str(adapters["attn_r4_rslora"]), "--model", str(tiny_model), "--json",
                      "--max-tokens", "4", "--prompt", "Once upon a time"])  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["ok"] and doc["verdict"] == "ok"
    assert doc["max_diff"] < 1e-3 and doc["effect"] > 1e-2
    assert doc["prompts"][0]["agree"] + doc["prompts"][0]["ties"] == 4


def test_activated_lora_is_checked_after_its_invocation(
    tiny_model: Path, tmp_path: Path, capsys
) -> None:
    """An aLoRA: each prompt ends with its invocation (else the base model would run and it
    would look like a no-op), the reference is PEFT unmerged with ``alora_offsets``."""
    path = make_random_adapter(tiny_model, tmp_path / "al", r=8, std=0.1, seed=3,
                               alora_invocation_tokens=[21, 22])  # fmt: skip
    rc = verify.main([str(path), "--model", str(tiny_model), "--json", "--max-tokens", "4",
                      "--prompt", "Hello world"])  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["verdict"] == "ok", doc
    assert doc["max_diff"] < 1e-3 and doc["effect"] > 1e-2


def test_silent_no_op(tiny_model: Path, adapters: dict[str, Path], tmp_path: Path, capsys) -> None:
    # targets named for another architecture (GPT-2's c_attn): nothing in a Llama matches
    gpt2 = tmp_path / "gpt2-style"
    shutil.copytree(adapters["all_r8"], gpt2)
    cfg = json.loads((gpt2 / "adapter_config.json").read_text())
    cfg["target_modules"] = ["c_attn", "c_proj"]
    (gpt2 / "adapter_config.json").write_text(json.dumps(cfg))
    assert verify.main([str(gpt2), "--model", str(tiny_model)]) == 1
    out = capsys.readouterr().out
    assert (
        "FAIL (silent_no_op): silent no-op: target_modules ['c_attn', 'c_proj'] match none" in out
    )
    # an untrained adapter: B all zero
    zero = tmp_path / "zero-b"
    shutil.copytree(adapters["all_r8"], zero)
    sd = load_file(str(zero / "adapter_model.safetensors"))
    save_file({k: v * 0 if "lora_B" in k else v for k, v in sd.items()},
              str(zero / "adapter_model.safetensors"))  # fmt: skip
    assert verify.main([str(zero), "--model", str(tiny_model)]) == 1
    assert "every lora_B matrix is zero" in capsys.readouterr().out


def test_wrong_base(tiny_model: Path, tmp_path: Path, capsys) -> None:
    other = make_random_model(tmp_path / "other", hidden_size=32, num_layers=2, num_heads=4,
                              num_kv_heads=2, intermediate_size=96, seed=1)  # fmt: skip
    foreign = make_random_adapter(other, tmp_path / "foreign", r=4, target_modules=["q_proj"])
    assert verify.main([str(foreign), "--model", str(tiny_model)]) == 1
    out = capsys.readouterr().out
    assert "FAIL (wrong_base): wrong base: 4 LoRA tensors do not fit" in out, out
    assert "d_in=64" in out and "shapes fit" not in out


def test_bad_input(tiny_model: Path, tmp_path: Path, capsys) -> None:
    for argv, msg in [
        ([str(tmp_path), "--model", str(tiny_model)], "not a PEFT adapter directory"),
        ([str(tmp_path), "--model", str(tmp_path / "nope")], "not a PEFT adapter directory"),
    ]:
        assert verify.main(argv) == 2
        assert msg in capsys.readouterr().err
    assert verify.main(["--model"]) == 2  # argparse: usage on stderr
    capsys.readouterr()


def test_lm_head_and_embedding_adapter_on_a_tied_model(tmp_path: Path, capsys) -> None:
    """LoRA on lm_head and embed_tokens of a tied model: checked against PEFT unmerged (a merge
    would write the one shared matrix, giving the lookup the head's delta and the head the
    embedding's)."""
    tied = make_random_model(tmp_path / "tied", num_layers=2, tie_word_embeddings=True, seed=2)
    vocab = make_random_adapter(
        tied, tmp_path / "vocab", r=4, target_modules=["q_proj", "lm_head", "embed_tokens"],
        std=0.1,
    )  # fmt: skip
    rc = verify.main([str(vocab), "--model", str(tied), "--max-tokens", "4", "--json",
                      "--prompt", "Hello world"])  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["verdict"] == "ok", doc
    assert doc["targets"] == ["embed_tokens", "lm_head", "q_proj"] and doc["modules"] == 4
