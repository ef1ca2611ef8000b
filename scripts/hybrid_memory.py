"""The memory one sequence holds on a hybrid (Qwen3.5) against a pure-attention model of the same
size, at 8k and 32k tokens; the byte model checked against what the engine really holds.

    python scripts/hybrid_memory.py [--check-tokens 2048]

1. The byte model (``loraplex plan``'s): a Qwen3.5 layout (transformers' ``Qwen3_5TextConfig``
   defaults: 32 layers, hidden 4096, 16 heads / 4 KV heads of 256, linear attention 16 key /
   32 value heads of 128, three linear layers per full one) and its twin with every layer full
   attention, same heads and widths, in bfloat16 with 16-token blocks: KV blocks of the
   attention layers plus the fixed state pages of the linear ones.
2. The check: a small random Qwen3.5 through the engine (float32), one sequence of
   ``--check-tokens`` prompt tokens decoding; the KV blocks and state pages it holds, times their
   page bytes, equal the byte model's figure for its shape.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from transformers import Qwen3_5TextConfig

from loraplex import LLM, SamplingParams
from loraplex.testing import make_random_model
from loraplex.tools.plan.model_shape import model_from_config

CONTEXTS = (8192, 32768)


def _config(all_attention: bool) -> dict:
    raw = Qwen3_5TextConfig().to_dict()
    raw["architectures"] = ["Qwen3_5ForCausalLM"]
    raw["dtype"] = "bfloat16"
    if all_attention:
        raw["layer_types"] = ["full_attention"] * raw["num_hidden_layers"]
    return raw


def modelled() -> None:
    hybrid = model_from_config(_config(False), "qwen3.5 (3 linear : 1 full)")
    twin = model_from_config(_config(True), "same size, all full attention")
    print(f"{'model':<34}{'params':>8}" + "".join(f"{n:>12,}" for n in CONTEXTS))
    for m in (hybrid, twin):
        row = [m.kv_bytes_per_sequence(n, 2) / 2**20 for n in CONTEXTS]
        print(f"{m.name:<34}{m.params() / 1e9:>7.2f}B" + "".join(f"{v:>9,.0f} MiB" for v in row))
    for n in CONTEXTS:
        h, t = hybrid.kv_bytes_per_sequence(n, 2), twin.kv_bytes_per_sequence(n, 2)
        state = hybrid.state_bytes_per_sequence(n, 2)
        print(
            f"{n:>6,} tokens: hybrid {h / 2**20:,.0f} MiB ({state / 2**20:,.0f} MiB of it "
            f"recurrent state) = {h / t:.3f} of the twin's {t / 2**20:,.0f} MiB ({t / h:.2f}x less)"
        )


def checked(tokens: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        model = make_random_model(
            Path(d) / "m", "qwen3_5", num_layers=8, full_attention_interval=4,
            with_tokenizer=False, vocab_size=512, max_position_embeddings=tokens + 64,
        )  # fmt: skip
        import json

        shape = model_from_config(json.loads((model / "config.json").read_text()), "small")
        llm = LLM(str(model), enable_lora=False, dtype="float32", skip_tokenizer_init=True,
                  max_num_batched_tokens=512, enable_prefix_caching=False)  # fmt: skip
        eng = llm.engine
        bs = eng.cache.block_size
        prompt = [3 + i % 500 for i in range(tokens)]
        eng.add_request("r", prompt, SamplingParams(max_tokens=4))
        kv_page = (eng.cache.k.nbytes + eng.cache.v.nbytes) // eng.cache.num_pages
        st_page = (eng.cache.conv.nbytes + eng.cache.recurrent.nbytes) // eng.cache.num_state_pages
        state = [g.state for g in eng.cache.groups]
        peak = {"bytes": 0}
        after_step = eng.scheduler.after_step

        def measured(batch: object) -> None:  # before the step's released pages go back
            for seq in eng.scheduler.running:
                if seq.num_computed_tokens >= tokens:  # decoding
                    live = [len([b for b in t if b >= 0]) for t in seq.block_tables]
                    kv = sum(n for n, s in zip(live, state, strict=True) if not s)
                    st = sum(n for n, s in zip(live, state, strict=True) if s)
                    peak["bytes"] = max(peak["bytes"], kv * kv_page + st * st_page)
            after_step(batch)

        eng.scheduler.after_step = measured  # type: ignore[method-assign]
        while eng.has_unfinished_requests():
            eng.step()
        held = peak["bytes"]
        n = tokens + 1
        want = shape.kv_bytes_per_sequence(n, 4, bs)
        print(
            f"engine check ({tokens:,}-token prompt, 8 layers, float32): holds at most "
            f"{held:,} bytes decoding; byte model {want:,}: {'equal' if held == want else 'DIFFERENT'}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check-tokens", type=int, default=2048)
    args = ap.parse_args()
    modelled()
    checked(args.check_tokens)


if __name__ == "__main__":
    main()
