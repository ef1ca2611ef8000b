"""Request bodies of the OpenAI-compatible API (pydantic), and their mapping to SamplingParams.

Field names, defaults and meanings follow vLLM's ``protocol.py`` (OpenAI's fields plus vLLM's
extensions). Every field of vLLM's completion and chat requests is either honoured or, where
we cannot honour a value (beam search, logits processors, ``allowed_token_ids``, ...), refused
with a 400 naming the field; no field is silently ignored. Fields neither OpenAI nor vLLM
define are accepted (clients send ``metadata``, ``store``, ...) and logged once per name
(:class:`UnknownFields`).

One module per part: ``base`` (what every body shares), ``sampling`` (the fields completions
and chat share, their bounds and their SamplingParams), ``structured`` (structured outputs:
``response_format``, ``guided_*``, ``structured_outputs``, all one
:class:`~loraplex.requests.StructuredOutput`; more than one source in a request is a 400),
``composition`` (the adapters a call composes beyond ``model``: ``lora_scale``,
``merged_adapters``, ``lora_requests``), ``completions``, ``chat`` (messages, tools, the chat
template's options), ``tokenizer``
(``/tokenize``, ``/detokenize``) and ``admin`` (the adapter routes' bodies).

Everything the engine would scan per token or keep per sequence is bounded per request, a 400
naming the field before anything is queued (``MAX_N``, ``MAX_STOP``, ``MAX_STOP_CHARS``,
``MAX_STOP_TOKEN_IDS``, ``MAX_LOGPROBS``, ``MAX_CHOICES``, ``MAX_TOOLS``). The number of prompts
per call is the server's ``--max-prompts-per-request``.
"""

from loraplex.server.protocol.admin import (
    AdapterFeedbackRequest,
    CanaryAdapterRequest,
    CanaryPolicyBody,
    DisableAdapterRequest,
    EvictLoRAAdapterRequest,
    LoadLoRAAdapterRequest,
    PinLoRAAdapterRequest,
    PromoteAdapterRequest,
    RegisterAdapterRequest,
    RollbackAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from loraplex.server.protocol.base import Text, UnknownFields, unknown_fields
from loraplex.server.protocol.chat import (
    MAX_TOOLS,
    RESERVED_TEMPLATE_KWARGS,
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    Tool,
    template_tools,
)
from loraplex.server.protocol.completions import CompletionRequest
from loraplex.server.protocol.composition import (
    MAX_LORA_SCALE,
    AdapterFields,
    LoRAComponent,
    MergedAdapters,
)
from loraplex.server.protocol.sampling import (
    MAX_CACHE_SALT,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    StreamOptions,
)
from loraplex.server.protocol.structured import (
    MAX_CHOICES,
    JsonSchemaFormat,
    ResponseFormat,
    StructuredOutputsBody,
)
from loraplex.server.protocol.tokenizer import DetokenizeRequest, TokenizeRequest

__all__ = [
    "MAX_CACHE_SALT",
    "MAX_CHOICES",
    "MAX_LOGPROBS",
    "MAX_LORA_SCALE",
    "MAX_N",
    "MAX_STOP",
    "MAX_STOP_CHARS",
    "MAX_STOP_TOKEN_IDS",
    "MAX_TOOLS",
    "MIN_TEMPERATURE",
    "MIN_TOP_P",
    "RESERVED_TEMPLATE_KWARGS",
    "AdapterFeedbackRequest",
    "AdapterFields",
    "CanaryAdapterRequest",
    "CanaryPolicyBody",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ContentPart",
    "DetokenizeRequest",
    "DisableAdapterRequest",
    "EvictLoRAAdapterRequest",
    "FunctionDefinition",
    "JsonSchemaFormat",
    "LoRAComponent",
    "LoadLoRAAdapterRequest",
    "MergedAdapters",
    "NamedFunction",
    "NamedToolChoice",
    "PinLoRAAdapterRequest",
    "PromoteAdapterRequest",
    "RegisterAdapterRequest",
    "ResponseFormat",
    "RollbackAdapterRequest",
    "StreamOptions",
    "StructuredOutputsBody",
    "Text",
    "TokenizeRequest",
    "Tool",
    "UnknownFields",
    "UnloadLoRAAdapterRequest",
    "template_tools",
    "unknown_fields",
]
