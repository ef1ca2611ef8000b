"""The embedded demo: a real small model (SmolLM2-135M-Instruct) and LoRA adapters trained on it.

``prepare_demo_model()`` fetches and converts the model once into a cache directory;
``demo_adapter_dirs()`` lists the adapters shipped inside this package.
"""

from loraplex.tools.demo.prepare import (
    DEMO_ADAPTER_NAMES,
    DEMO_MODEL_ID,
    default_cache_dir,
    demo_adapter_dirs,
    demo_model_dir,
    is_prepared,
    prepare_demo_model,
)

__all__ = [
    "DEMO_ADAPTER_NAMES",
    "DEMO_MODEL_ID",
    "default_cache_dir",
    "demo_adapter_dirs",
    "demo_model_dir",
    "is_prepared",
    "prepare_demo_model",
]
