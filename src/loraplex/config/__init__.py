"""Typed engine and server configuration, passed explicitly (no module-level singletons).

Each field that ``loraplex serve`` can set declares it once in its metadata
(:func:`loraplex.config.fields.setting`): flags, value parser, bounds and help. The serve
command's flags, config-file keys and constructor call come from there
(:mod:`loraplex.config.settings`, used by ``loraplex.server.args``), and ``validate()`` checks
the same declared bounds plus the cross-field rules written beside each config class.

One module per job:

- ``fields``: how a field declares its setting (``setting``, ``FieldError``, ``check_fields``)
  and the scalar value parsers (``integer``, ``seconds``, ``human_int``, ...);
- ``settings``: one command's table read from those declarations (``Settings``, ``Values``,
  the config-file reader);
- ``values``: the value lists (dtypes, quantization methods, policy names, log levels, ...),
  each once, and the text parsers of the settings' values;
- ``environment``: every environment variable of loraplex's own (``ENVIRONMENT``), read
  through ``env_value``;
- ``engine_fields`` + ``engine``: ``EngineConfig`` (its flag table, then its rules and derived
  values); ``parallel``: the tensor-parallel ``Rendezvous``;
- ``lora_modules`` + ``server``: ``LoRAModule`` and ``ServerConfig``;
- ``argtypes``: argparse value types for the commands' hand-written flags.

The config objects are frozen (``dataclasses.replace`` derives a changed one). An adapter's
``warm`` syntax is ``loraplex.warm``'s. This package imports nothing of loraplex but
``loraplex.warm``, and no torch.
"""

from loraplex.config.engine import EngineConfig
from loraplex.config.engine_fields import DEFAULT_MAX_CPU_LORAS
from loraplex.config.environment import (
    ENV_ADMIN_API_KEY,
    ENV_ALLOW_RUNTIME_LORA_UPDATING,
    ENV_API_KEYS,
    ENV_CACHE_DIR,
    ENV_HOME,
    ENV_LAYER_CPU_KERNEL,
    ENV_LORA_CPU_KERNEL,
    ENV_METRICS_API_KEY,
    ENV_REGISTRY_URL,
    ENV_TP_SHM,
    ENVIRONMENT,
    env_value,
    layer_cpu_kernel_enabled,
    lora_cpu_kernel_enabled,
)
from loraplex.config.fields import FieldError
from loraplex.config.lora_modules import LoRAModule, lora_modules_from_value, parse_lora_module
from loraplex.config.parallel import Rendezvous
from loraplex.config.server import ServerConfig
from loraplex.config.values import (
    ADAPTER_EVICTION_POLICIES,
    DTYPE_ALIASES,
    DTYPES,
    LOG_FORMATS,
    LOG_LEVELS,
    QUANTIZATION_METHODS,
    QUANTIZE_AT_LOAD,
    QUANTIZED_CHECKPOINT_FORMATS,
    SCHEDULING_POLICIES,
    TOOL_CALL_PARSERS,
    WHITESPACE_MODES,
    endpoint_paths,
    parse_byte_size,
    parse_device,
    parse_dtype,
    parse_endpoint_list,
    parse_eviction_policy,
    parse_generation_config,
    parse_json_list,
    parse_json_object,
    parse_log_format,
    parse_log_level,
    parse_rank_budgets,
    parse_scheduling_policy,
    parse_slo_classes,
    parse_store_url,
    parse_tenant_classes,
    parse_vllm_env_flag,
    rank_budget_map,
    slo_class_table,
    tenant_class_map,
)

__all__ = [
    "ADAPTER_EVICTION_POLICIES",
    "DEFAULT_MAX_CPU_LORAS",
    "DTYPES",
    "DTYPE_ALIASES",
    "ENVIRONMENT",
    "ENV_ADMIN_API_KEY",
    "ENV_ALLOW_RUNTIME_LORA_UPDATING",
    "ENV_API_KEYS",
    "ENV_CACHE_DIR",
    "ENV_HOME",
    "ENV_LAYER_CPU_KERNEL",
    "ENV_LORA_CPU_KERNEL",
    "ENV_METRICS_API_KEY",
    "ENV_REGISTRY_URL",
    "ENV_TP_SHM",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "QUANTIZATION_METHODS",
    "QUANTIZED_CHECKPOINT_FORMATS",
    "QUANTIZE_AT_LOAD",
    "SCHEDULING_POLICIES",
    "TOOL_CALL_PARSERS",
    "WHITESPACE_MODES",
    "EngineConfig",
    "FieldError",
    "LoRAModule",
    "Rendezvous",
    "ServerConfig",
    "endpoint_paths",
    "env_value",
    "layer_cpu_kernel_enabled",
    "lora_cpu_kernel_enabled",
    "lora_modules_from_value",
    "parse_byte_size",
    "parse_device",
    "parse_dtype",
    "parse_endpoint_list",
    "parse_eviction_policy",
    "parse_generation_config",
    "parse_json_list",
    "parse_json_object",
    "parse_log_format",
    "parse_log_level",
    "parse_lora_module",
    "parse_rank_budgets",
    "parse_scheduling_policy",
    "parse_slo_classes",
    "parse_store_url",
    "parse_tenant_classes",
    "parse_vllm_env_flag",
    "rank_budget_map",
    "slo_class_table",
    "tenant_class_map",
]
