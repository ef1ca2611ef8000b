"""Choosing the LoRA ops backend once at start-up: Triton on CUDA, the C kernel on CPU, else torch.

Each backend is a ``LoRAOpsBackend`` (a name, a device test, a factory); ``select_lora_ops``
takes the first that supports the device. Factories that compile something (Triton, the CPU
kernel) verify it against the torch path and fall back to it, with a warning, if it fails.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from loraplex.config import lora_cpu_kernel_enabled
from loraplex.lora.ops import LoRAOps, TorchLoRAOps
from loraplex.lora.plan import plan_lora_batch

# ------------------------------------------------------------------------------------ selection


@dataclass(frozen=True, slots=True)
class LoRAOpsBackend:
    """A registrable backend: ``select_lora_ops`` takes the first one that supports the device."""

    name: str
    supports: Callable[[torch.device], bool]
    create: Callable[[torch.device], LoRAOps]


def cpu_slow_matmul_dtypes() -> tuple[torch.dtype, ...]:
    """Low-precision dtypes oneDNN has no fast CPU GEMM for here (both on AVX2)."""
    slow = []
    for dtype, probe in (
        (torch.bfloat16, "_is_mkldnn_bf16_supported"),
        (torch.float16, "_is_mkldnn_fp16_supported"),
    ):
        try:
            fast = bool(getattr(torch.ops.mkldnn, probe)())
        except (AttributeError, RuntimeError):
            fast = False
        if not fast:
            slow.append(dtype)
    return tuple(slow)


def _create_torch_ops(device: torch.device) -> LoRAOps:
    if device.type != "cpu":
        return TorchLoRAOps()
    slow = cpu_slow_matmul_dtypes()
    lowp = (torch.bfloat16, torch.float16)
    return TorchLoRAOps(upcast=lowp, native_runs=[d for d in lowp if d not in slow])


def _triton_available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def _create_triton_ops(device: torch.device) -> LoRAOps:
    """Triton kernels, after a start-up self-check on ``device`` against the torch path;
    if they fail to compile or disagree, the torch path is used instead (with a warning)."""
    from loraplex.lora.triton_ops import TritonLoRAOps

    ops = TritonLoRAOps()
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(5, 32, generator=g).to(device)
        a = torch.randn(24, 32, generator=g).to(device)
        bt = torch.randn(24, 48, generator=g).to(device)
        plan = plan_lora_batch(5, [(0, 2, 0, 8), (3, 5, 8, 24)], torch.float32, device)
        got, want = torch.zeros(5, 48, device=device), torch.zeros(5, 48, device=device)
        ops.apply(x, a, bt, got, plan)
        TorchLoRAOps().apply(x, a, bt, want, plan)
        if not torch.allclose(got, want, atol=1e-3, rtol=1e-3):
            raise RuntimeError(f"max difference {(got - want).abs().max().item():.3g}")
    except Exception as e:  # any compile or launch failure: keep serving on the torch path
        warnings.warn(
            f"Triton LoRA kernels unusable on {device} ({e}); using the torch path", stacklevel=2
        )
        return _create_torch_ops(device)
    return ops


def _create_cpu_kernel_ops(device: torch.device) -> LoRAOps:
    """The C kernel for short segments over the torch path, after its build and self-check;
    if either fails (no compiler, say), the torch path alone (with a warning)."""
    from loraplex.lora.cpu_ops import CPUKernelLoRAOps, load_kernel
    from loraplex.native.build import KernelBuildError

    fallback = _create_torch_ops(device)
    try:
        kernel = load_kernel()
    except KernelBuildError as e:
        warnings.warn(f"LoRA CPU kernel unusable ({e}); using the torch path", stacklevel=2)
        return fallback
    return CPUKernelLoRAOps(kernel, fallback)


TRITON_BACKEND = LoRAOpsBackend(
    name="triton", supports=_triton_available, create=_create_triton_ops
)
TORCH_BACKEND = LoRAOpsBackend(
    name="torch", supports=lambda device: device.type in ("cpu", "cuda"), create=_create_torch_ops
)


def _cpu_kernel_wanted(device: torch.device) -> bool:
    """On CPU unless ``$LORAPLEX_LORA_CPU_KERNEL=0`` keeps the kernel out of the default choice
    (the torch path instead; :func:`loraplex.config.lora_cpu_kernel_enabled`)."""
    return device.type == "cpu" and lora_cpu_kernel_enabled()


CPU_KERNEL_BACKEND = LoRAOpsBackend(
    name="cpu-kernel", supports=_cpu_kernel_wanted, create=_create_cpu_kernel_ops
)
DEFAULT_BACKENDS: tuple[LoRAOpsBackend, ...] = (TRITON_BACKEND, CPU_KERNEL_BACKEND, TORCH_BACKEND)
"""In preference order: Triton kernels on CUDA when triton is installed, the C kernel on CPU
(the torch path if it cannot be built), else the torch path."""


def select_lora_ops(
    device: torch.device | str,
    backends: Sequence[LoRAOpsBackend] = DEFAULT_BACKENDS,
    name: str | None = None,
) -> LoRAOps:
    """Choose the LoRA ops backend once at start-up: ``name`` if given, else the first that fits."""
    device = torch.device(device)
    for backend in backends:
        if (name is None or backend.name == name) and backend.supports(device):
            return backend.create(device)
    wanted = f"{name!r}" if name else "any backend"
    raise ValueError(f"no LoRA ops backend ({wanted}) supports device {device}")
