"""The configuration of ``loraplex serve``: the engine's settings plus the HTTP layer's (vLLM
flag names), each declared once in its field (:func:`loraplex.config.fields.setting`), and the
rules between them (``validate``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.config.engine import EngineConfig
from loraplex.config.environment import (
    ENV_ADMIN_API_KEY,
    ENV_ALLOW_RUNTIME_LORA_UPDATING,
    ENV_API_KEYS,
    ENV_METRICS_API_KEY,
    ENV_REGISTRY_URL,
)
from loraplex.config.fields import FieldError, check_fields, human_int, seconds, setting, stripped
from loraplex.config.lora_modules import LoRAModule, lora_modules_from_value, parse_lora_module
from loraplex.config.values import (
    LOG_FORMATS,
    LOG_LEVELS,
    TOOL_CALL_PARSERS,
    parse_byte_size,
    parse_endpoint_list,
    parse_json_list,
    parse_log_format,
    parse_log_level,
    parse_vllm_env_flag,
)


@dataclass(frozen=True)
class ServerConfig:
    """Settings of ``loraplex serve``: the engine's plus the HTTP layer's (vLLM flag names).
    Frozen: derive a changed one with ``dataclasses.replace``."""

    engine: EngineConfig  # its settings are serve's too
    host: str = field(
        default="127.0.0.1", metadata=setting("--host", help="address to bind (default: {default})")
    )
    port: int = field(
        default=8000,
        metadata=setting("--port", ge=0, le=65535, help="port to bind (default: {default})"),
    )
    served_model_name: list[str] = field(  # empty: the model path
        default_factory=list,
        metadata=setting(
            "--served-model-name",
            metavar="NAME",
            help="names the base model answers to; the first is reported (default: MODEL_DIR "
            "as given)",
        ),
    )
    lora_modules: list[LoRAModule] = field(
        default_factory=list,
        metadata=setting(
            "--lora-modules",
            parse=parse_lora_module,
            coerce=lora_modules_from_value,
            metavar="SPEC",
            help="adapters to serve at start-up: NAME=PATH or JSON "
            '\'{"name": N, "path": P, "base_model_name": B}\'; needs --enable-lora',
        ),
    )
    api_keys: list[str] = field(  # inference keys; empty: no auth
        default_factory=list,
        metadata=setting(
            "--api-key",
            env=ENV_API_KEYS,
            metavar="KEY",
            help="inference API key(s); repeat or list several (default: {env}; none: no auth)",
        ),
    )
    admin_api_key: str | None = field(  # admin routes are off unless set
        default=None,
        metadata=setting(
            "--admin-api-key",
            env=(ENV_ADMIN_API_KEY,),
            metavar="KEY",
            help="key for the admin routes (default: {env}; none: admin routes off)",
        ),
    )
    metrics_api_key: str | None = field(  # a scrape key that may read /metrics only
        default=None,
        metadata=setting(
            "--metrics-api-key",
            env=(ENV_METRICS_API_KEY,),
            metavar="KEY",
            help="key that may read /metrics (and nothing else); when set, /metrics needs it "
            "or an operator key (default: {env})",
        ),
    )
    allowed_lora_roots: list[str] = field(
        default_factory=list,
        metadata=setting(
            "--allowed-lora-roots",
            metavar="DIR",
            help="directories that runtime-loaded adapters must lie under",
        ),
    )
    # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: /v1/load_lora_adapter and /v1/unload_lora_adapter
    # without an admin key while the server has no key at all (an admin key, once set, is
    # always required; inference keys never load)
    allow_runtime_lora_updating: bool = field(
        default=False,
        metadata=setting(
            "--allow-runtime-lora-updating",
            parse=parse_vllm_env_flag,
            env=(ENV_ALLOW_RUNTIME_LORA_UPDATING,),
            help="vLLM's runtime load/unload routes on a server without keys, as vLLM "
            "(default: {env} = 1 or true; with --admin-api-key they need that key anyway)",
        ),
    )
    max_waiting: int = field(  # waiting sequences above which new calls get 503 + Retry-After
        default=0,  # vLLM queues every request: no cap unless asked for
        metadata=setting(
            "--max-waiting",
            "--max-num-queued-reqs",
            ge=0,
            help="waiting sequences (prompts x n of every admitted call) before 503 + "
            "Retry-After; 0: no limit, queue like vLLM (default: {default})",
        ),
    )
    retry_after_seconds: int = field(default=1, metadata=setting(ge=0))
    # how long a call over its adapter's max_concurrent_requests waits for a slot before 429
    adapter_queue_timeout_s: float = field(default=10.0, metadata=setting(ge=0))
    # -- bounds on what one request may cost (checked before it costs memory) ----------------
    max_request_bytes: int = field(
        default=8 << 20,
        metadata=setting(
            "--max-request-bytes",
            parse=parse_byte_size,
            ge=1,
            metavar="BYTES",
            help="largest request body, checked while reading it and before authentication "
            "work; larger bodies get 413 (default: {default})",
        ),
    )
    max_adapter_push_bytes: int = field(
        default=1 << 30,
        metadata=setting(
            "--max-adapter-push-bytes",
            parse=parse_byte_size,
            ge=1,
            metavar="BYTES",
            help="largest adapter body POST /v1/admin/adapters/{name}/push takes (instead of "
            "--max-request-bytes), checked before and while reading it: 413 (default: {default})",
        ),
    )
    max_pushed_revisions: int = field(
        default=8,
        metadata=setting(
            "--max-pushed-revisions",
            ge=1,
            help="pushed revisions the registry keeps per adapter name; older ones no request "
            "uses (and not active, canary or the rollback target) are deleted (default: {default})",
        ),
    )
    max_prompts_per_request: int = field(
        default=1024,
        metadata=setting(
            "--max-prompts-per-request",
            ge=1,
            help="prompts in one /v1/completions call; more is a 400 (default: {default})",
        ),
    )
    stream_stall_timeout_s: float = field(
        default=30.0,
        metadata=setting(
            "--stream-stall-timeout",
            parse=seconds,
            ge=0,
            metavar="SECONDS",
            help="abort a request whose reader has taken nothing for this long while the "
            "engine kept producing (frees its KV blocks; 0: no time bound; default: {default})",
        ),
    )
    stream_max_unread_tokens: int = field(
        default=4096,
        metadata=setting(
            "--stream-max-unread-tokens",
            parse=human_int,
            ge=0,
            help="abort a request once this many of its tokens were produced and not read "
            "(0: no count bound; default: {default})",
        ),
    )
    prepare_workers: int = field(
        default=4,
        metadata=setting(
            "--prepare-workers",
            ge=1,
            help="threads validating and tokenizing requests whose adapter is in memory "
            "(default: {default})",
        ),
    )
    load_workers: int = field(
        default=4,
        metadata=setting(
            "--load-workers",
            ge=1,
            help="threads preparing requests whose adapter must be loaded first, so cold "
            "loads never delay warm requests (default: {default})",
        ),
    )
    prepare_timeout_s: float = field(
        default=120.0,
        metadata=setting(
            "--prepare-timeout",
            parse=seconds,
            gt=0,
            metavar="SECONDS",
            help="seconds a request may wait for its preparation (adapter load included) "
            "before a 503 + Retry-After (default: {default})",
        ),
    )
    log_level: str = field(
        default="info",
        metadata=setting(
            "--uvicorn-log-level",
            "--log-level",
            parse=parse_log_level,
            choices=LOG_LEVELS,
            metavar="LEVEL",
            help="server log level: {choices} (default: {default})",
        ),
    )
    # adapter registry: None = $LORAPLEX_REGISTRY_URL, else an in-memory one seeded from
    # --lora-modules; "sqlite:///path.db" or "postgresql+psycopg://..." for a shared one
    registry_url: str | None = field(
        default=None,
        metadata=setting(
            "--registry-url",
            parse=stripped,
            env=(ENV_REGISTRY_URL,),
            metavar="URL",
            help="adapter registry: sqlite:///FILE or postgresql+psycopg://... (default: "
            "{env}, else in memory, holding the --lora-modules adapters)",
        ),
    )
    registry_poll_s: float = field(
        default=1.0,
        metadata=setting(
            "--registry-poll-interval",
            parse=seconds,
            gt=0,
            metavar="SECONDS",
            help="seconds between checks for registry changes made elsewhere (default: {default})",
        ),
    )
    require_signatures: bool = field(
        default=False,
        metadata=setting(
            "--require-signatures",
            help="refuse adapters without a valid ed25519 manifest signature (default: {default})",
        ),
    )
    trusted_keys: list[str] = field(
        default_factory=list,
        metadata=setting(
            "--trusted-key",
            metavar="FILE",
            help="ed25519 public key file(s) (PEM) whose signatures are accepted",
        ),
    )
    allowed_store_prefixes: list[str] = field(
        default_factory=list,
        metadata=setting(
            "--allowed-store-prefixes",
            metavar="URI",
            help="object-store prefixes that registered adapter sources must lie under "
            "(e.g. s3://bucket/adapters/)",
        ),
    )
    swap_eviction_delay_s: float = field(
        default=30.0,
        metadata=setting(
            "--swap-eviction-delay",
            parse=seconds,
            ge=0,
            metavar="SECONDS",
            help="seconds after a promote or rollback before the replaced revision's cached "
            "copies are evicted (default: {default})",
        ),
    )

    # -- chat and tools (vLLM's OpenAI frontend flags) ----------------------------------------
    chat_template: str | None = field(  # the template text (the command line reads a file)
        default=None,
        metadata=setting(
            "--chat-template",
            metavar="FILE_OR_TEMPLATE",
            help="Jinja chat template: a file, or the template itself (default: the tokenizer's)",
        ),
    )
    enable_auto_tool_choice: bool = field(
        default=False,
        metadata=setting(
            "--enable-auto-tool-choice",
            help='let the model choose to call tools (tool_choice "auto"; needs '
            "--tool-call-parser; default: {default})",
        ),
    )
    tool_call_parser: str | None = field(
        default=None,
        metadata=setting(
            "--tool-call-parser",
            choices=TOOL_CALL_PARSERS,
            metavar="NAME",
            help="how tool calls are read out of generated text: {choices}",
        ),
    )
    hf_token: str | None = field(  # for hub ids; default: $HF_TOKEN or the stored login
        default=None,
        repr=False,
        metadata=setting(
            "--hf-token",
            metavar="TOKEN",
            help="hub token for hub ids (default: $HF_TOKEN, else huggingface-cli login's)",
        ),
    )
    # -- logging -------------------------------------------------------------------------------
    disable_log_requests: bool = field(
        default=False,
        metadata=setting(
            "--disable-log-requests",
            help="no log line per finished request (default: {default})",
        ),
    )
    max_log_len: int | None = field(
        default=None,
        metadata=setting(
            "--max-log-len",
            ge=0,
            help="characters of the prompt shown in a request's log line at debug level "
            "(default: all)",
        ),
    )
    disable_log_stats: bool = field(
        default=False,
        metadata=setting(
            "--disable-log-stats",
            help="no periodic stats line (throughput, queue, KV, adapter hits; default: {default})",
        ),
    )
    log_stats_interval_s: float = field(
        default=10.0,
        metadata=setting(
            "--log-stats-interval",
            parse=seconds,
            gt=0,
            metavar="SECONDS",
            help="seconds between stats lines (default: {default})",
        ),
    )
    log_format: str = field(
        default="text",
        metadata=setting(
            "--log-format",
            parse=parse_log_format,
            choices=LOG_FORMATS,
            metavar="{text,json}",
            help="log lines as text, or one JSON object per line for log shippers "
            "(default: {default})",
        ),
    )
    disable_uvicorn_access_log: bool = field(
        default=False,
        metadata=setting(
            "--disable-uvicorn-access-log", help="no HTTP access log (default: {default})"
        ),
    )
    disable_access_log_for_endpoints: str | None = field(  # vLLM's comma-separated form
        default=None,
        metadata=setting(
            "--disable-access-log-for-endpoints",
            parse=parse_endpoint_list,
            metavar="PATHS",
            help="no access-log line for these paths, comma-separated, e.g. "
            "/health,/metrics,/ping (query strings ignored)",
        ),
    )
    shutdown_timeout_s: float | None = field(  # None: wait for every open request
        default=None,
        metadata=setting(
            "--shutdown-timeout",
            parse=seconds,
            ge=0,
            metavar="SECONDS",
            help="on SIGTERM, seconds in-flight requests may take to finish before they are "
            "cancelled; 0: at once (default: wait for them)",
        ),
    )
    # -- HTTP (uvicorn / FastAPI) ----------------------------------------------------------------
    root_path: str | None = field(
        default=None,
        metadata=setting(
            "--root-path", help="path prefix of the app behind a path-based proxy (ASGI root_path)"
        ),
    )
    ssl_keyfile: str | None = field(
        default=None, metadata=setting("--ssl-keyfile", metavar="FILE", help="TLS key file")
    )
    ssl_certfile: str | None = field(
        default=None, metadata=setting("--ssl-certfile", metavar="FILE", help="TLS certificate")
    )
    ssl_ca_certs: str | None = field(
        default=None,
        metadata=setting("--ssl-ca-certs", metavar="FILE", help="CA certificates (client certs)"),
    )
    enable_ssl_refresh: bool = field(
        default=False,
        metadata=setting(
            "--enable-ssl-refresh",
            help="reload the certificate, key and CA files when they change, without a "
            "restart (default: {default})",
        ),
    )
    allowed_origins: str | None = field(  # JSON list; None: no CORS headers
        default=None,
        metadata=setting(
            "--allowed-origins",
            parse=parse_json_list,
            metavar="JSON",
            help="CORS origins as a JSON list, e.g. '[\"*\"]' (default: no CORS headers)",
        ),
    )
    allowed_methods: str = field(
        default='["*"]',
        metadata=setting(
            "--allowed-methods", parse=parse_json_list, metavar="JSON", help="CORS methods"
        ),
    )
    allowed_headers: str = field(
        default='["*"]',
        metadata=setting(
            "--allowed-headers", parse=parse_json_list, metavar="JSON", help="CORS headers"
        ),
    )
    allow_credentials: bool = field(
        default=False,
        metadata=setting("--allow-credentials", help="CORS credentials (default: {default})"),
    )
    disable_fastapi_docs: bool = field(
        default=False,
        metadata=setting(
            "--disable-fastapi-docs",
            help="no /docs, /redoc and /openapi.json (default: {default})",
        ),
    )

    @property
    def model_names(self) -> list[str]:
        """Names the base model answers to; the first is reported in responses."""
        return self.served_model_name or [self.engine.model]

    def validate(self) -> None:
        """Raise FieldError (a ValueError) naming the first invalid field."""
        self.engine.validate()
        check_fields(self)
        if self.lora_modules and not self.engine.enable_lora:
            raise FieldError(
                self,
                "lora_modules",
                lambda n: f"LoRA is off: add {n('enable_lora')} to serve LoRA modules",
            )
        seen = dict.fromkeys(self.model_names, "served model name")
        for m in self.lora_modules:
            if not m.name or not m.path:
                raise FieldError(self, "lora_modules", f"{m!r}: name and path are required")
            if m.name in seen:
                raise FieldError(
                    self,
                    "lora_modules",
                    f"name {m.name!r} is used twice (already a {seen[m.name]})",
                )
            seen[m.name] = "LoRA module name"
        if self.admin_api_key is not None and self.admin_api_key in self.api_keys:
            raise FieldError(
                self, "admin_api_key", "the admin key must differ from every inference API key"
            )
        if self.metrics_api_key is not None and (
            self.metrics_api_key in self.api_keys or self.metrics_api_key == self.admin_api_key
        ):
            raise FieldError(
                self,
                "metrics_api_key",
                "the metrics key must differ from the inference and admin keys",
            )
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise FieldError(
                self,
                "enable_auto_tool_choice",
                lambda n: f"needs {n('tool_call_parser')} (one of {', '.join(TOOL_CALL_PARSERS)})",
            )
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise FieldError(
                self,
                "ssl_keyfile" if self.ssl_keyfile is None else "ssl_certfile",
                lambda n: f"{n('ssl_keyfile')} and {n('ssl_certfile')} go together",
            )
        if self.enable_ssl_refresh and self.ssl_certfile is None:
            raise FieldError(
                self,
                "enable_ssl_refresh",
                lambda n: f"needs {n('ssl_certfile')} and {n('ssl_keyfile')}",
            )
        if self.require_signatures and not self.trusted_keys:
            raise FieldError(
                self, "require_signatures", lambda n: f"needs at least one {n('trusted_keys')}"
            )
        for prefix in self.allowed_store_prefixes:
            if "://" not in prefix:
                raise FieldError(
                    self,
                    "allowed_store_prefixes",
                    f"{prefix!r} is not a URI like s3://bucket/path/",
                )
