"""``scripts/train_and_push.py`` runs end to end: a few PEFT training steps on a tiny random Llama,
each pushed to a ``loraplex serve`` it starts on loopback, each step's served greedy tokens equal
to the trainer's own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_and_push.py"


def test_the_training_loop_example_serves_every_revision_it_pushes() -> None:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "3"],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    for step in (1, 2, 3):
        assert f"pushed step-{step}" in out.stdout
    assert out.stdout.count("== trainer") == 3
    for step in (1, 2, 3):
        assert f"(served by revision step-{step})" in out.stdout
    assert "every step served the revision it pushed" in out.stdout
