"""loraplex: one base LLM, many LoRA adapters, served with a measured adapter lifecycle."""

from loraplex.config import EngineConfig
from loraplex.outputs import CompletionOutput, RequestOutput, TokenLogprob
from loraplex.requests import LoRARequest, SamplingParams
from loraplex.types import (
    AdapterError,
    AdapterRef,
    InvalidRequestError,
    LoraplexError,
    ModelLoadError,
)

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "AdapterError",
    "AdapterRef",
    "CompletionOutput",
    "EngineConfig",
    "InvalidRequestError",
    "LoRARequest",
    "LoraplexError",
    "ModelLoadError",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
    "__version__",
]


def __getattr__(name: str) -> object:
    # LLM pulls in torch; keep ``import loraplex`` light for the router and CLI.
    if name == "LLM":
        from loraplex.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
