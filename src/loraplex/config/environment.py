"""Every environment variable of loraplex's own, declared once (``ENVIRONMENT``) and read through
:func:`env_value`, never ``os.environ``; plus the readers of the native-kernel switches.

One that stands in for a flag is named by that setting's ``env=`` (the command reads it, below
the flag and the config file); the others are not flags.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

ENV_API_KEYS = ("LORAPLEX_API_KEY", "VLLM_API_KEY")  # --api-key (the first one set wins)
ENV_ADMIN_API_KEY = "LORAPLEX_ADMIN_API_KEY"  # --admin-api-key
ENV_METRICS_API_KEY = "LORAPLEX_METRICS_API_KEY"  # --metrics-api-key
ENV_REGISTRY_URL = "LORAPLEX_REGISTRY_URL"  # --registry-url; the registry commands' default
ENV_HOME = "LORAPLEX_HOME"  # the registry's SQLite file, the base-model digest memo
ENV_CACHE_DIR = "LORAPLEX_CACHE_DIR"  # the demo model, built CPU kernels
ENV_LORA_CPU_KERNEL = "LORAPLEX_LORA_CPU_KERNEL"  # "0": never the native CPU LoRA kernel
# "0": never the C layer ops (norms, attention, the gated delta decode step)
ENV_LAYER_CPU_KERNEL = "LORAPLEX_LAYER_CPU_KERNEL"
ENV_TP_SHM = "LORAPLEX_TP_SHM"  # "0": one host's tensor-parallel step traffic via gloo, not shm
# vLLM's own switch of /v1/load_lora_adapter and /v1/unload_lora_adapter (KubeAI sets it):
# --allow-runtime-lora-updating
ENV_ALLOW_RUNTIME_LORA_UPDATING = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
ENVIRONMENT = (
    *ENV_API_KEYS,
    ENV_ADMIN_API_KEY,
    ENV_METRICS_API_KEY,
    ENV_REGISTRY_URL,
    ENV_HOME,
    ENV_CACHE_DIR,
    ENV_LORA_CPU_KERNEL,
    ENV_LAYER_CPU_KERNEL,
    ENV_TP_SHM,
    ENV_ALLOW_RUNTIME_LORA_UPDATING,
)
"""The environment variables above (``loraplex route``'s status key is its setting's ``env=``,
in ``loraplex.router.config``)."""


def env_value(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """Environment variable ``name`` (one of :data:`ENVIRONMENT`) without surrounding
    whitespace; None when it is unset or blank. ``environ`` defaults to ``os.environ``."""
    if name not in ENVIRONMENT:
        raise KeyError(f"{name} is not declared in loraplex.config.ENVIRONMENT")
    value = (os.environ if environ is None else environ).get(name, "").strip()
    return value or None


def lora_cpu_kernel_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the native CPU LoRA kernel may be used: ``$LORAPLEX_LORA_CPU_KERNEL=0`` turns
    it off (any other value, or none, leaves it on)."""
    return env_value(ENV_LORA_CPU_KERNEL, environ) != "0"


def layer_cpu_kernel_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the C layer ops may run on CPU (``loraplex.model.layer_ops``, the gated delta
    decode step of ``loraplex.model.gated_delta_cpu``): ``$LORAPLEX_LAYER_CPU_KERNEL=0`` keeps
    the torch ops."""
    return env_value(ENV_LAYER_CPU_KERNEL, environ) != "0"
