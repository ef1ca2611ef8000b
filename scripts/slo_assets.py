"""Benchmark assets: a small random Llama and 124 distinct rank-8 adapters (copies of one PEFT
adapter with re-randomised weights, so every digest differs)."""

import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from loraplex.testing import make_random_adapter, make_random_model

root = Path(sys.argv[1])
model = make_random_model(
    root / "model",
    hidden_size=256,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    intermediate_size=768,
    seed=0,
    max_position_embeddings=1024,
)
proto = make_random_adapter(model, root / "proto", r=8, target_modules=["q_proj", "v_proj"], seed=1)
names = ["gold", "flood-a", "flood-b"] + [f"batch-{i:03d}" for i in range(120)]
g = torch.Generator().manual_seed(5)
base = load_file(str(proto / "adapter_model.safetensors"))
for n in names:
    d = root / "adapters" / n
    shutil.copytree(proto, d, dirs_exist_ok=True)
    t = {k: 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    save_file(t, str(d / "adapter_model.safetensors"))
print(model)
