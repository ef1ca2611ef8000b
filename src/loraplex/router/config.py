"""``RouterConfig``: everything ``loraplex route`` can set, each field declaring its flag,
config-file key, bounds and help once (:mod:`loraplex.config.fields`). Torch- and FastAPI-free,
so the command line parses without the HTTP stack."""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.config import LOG_LEVELS, parse_byte_size, parse_log_level
from loraplex.config.fields import check_fields, setting
from loraplex.router.homes import HomeSettings
from loraplex.router.replicas import normalize_url
from loraplex.router.scoring import POLICIES, Thresholds, Weights

_HEALTH = "health and retries"  # an argparse group of `loraplex route --help`
ENV_STATUS_API_KEY = "LORAPLEX_ROUTER_STATUS_API_KEY"
ENV_PUSH_API_KEY = "LORAPLEX_ROUTER_PUSH_API_KEY"
PUSH_TARGETS = ("all", "holders")
"""Where ``loraplex route`` sends an adapter push (``--push-targets``)."""


@dataclass(frozen=True)
class RouterConfig:
    """Everything ``loraplex route`` can set; each field declares its flag, config-file key,
    bounds and help once (``loraplex.config.fields``)."""

    replicas: list[str] = field(
        default_factory=list,
        metadata=setting(
            "--replica",
            keys=("replicas",),
            parse=normalize_url,
            nargs=None,
            metavar="URL",
            group="replicas",
            help="a replica's base URL (repeat for more)",
        ),
    )
    replicas_file: str | None = field(
        default=None,
        metadata=setting(
            "--replicas-file",
            metavar="FILE",
            group="replicas",
            help="file of replica URLs, one per line; re-read when it changes",
        ),
    )
    replicas_dns: str | None = field(  # NAME:PORT, re-resolved on every poll
        default=None,
        metadata=setting(
            "--replicas-dns",
            metavar="NAME:PORT",
            group="replicas",
            help="DNS name whose addresses are the replicas (a headless Service); "
            "re-resolved on every poll",
        ),
    )
    policy: str = field(
        default="home",
        metadata=setting(
            "--policy",
            choices=POLICIES,
            group="routing",
            help="routing policy: home (every adapter a stable home set sized by its traffic, "
            "a warm member first, spilling only when the set is saturated), residency "
            "(wherever it is warm), round-robin, least-loaded (default: {default})",
        ),
    )
    weights: Weights = field(
        default_factory=Weights,
        metadata=setting(
            "--weight",
            keys=("weights",),
            nargs=None,
            metavar="NAME=VALUE",
            group="routing",
            help="score weight, e.g. --weight device=1 --weight waiting=0.1",
        ),
    )
    thresholds: Thresholds = field(default_factory=Thresholds)  # its settings are route's too
    homes: HomeSettings = field(default_factory=HomeSettings)  # the home policy's (--home-*)
    poll_interval_s: float = field(
        default=1.0,
        metadata=setting(
            "--poll-interval",
            gt=0,
            metavar="SECONDS",
            group=_HEALTH,
            help="seconds between polls of every replica (default: {default})",
        ),
    )
    poll_timeout_s: float = field(
        default=2.0,
        metadata=setting(
            "--poll-timeout",
            gt=0,
            metavar="SECONDS",
            group=_HEALTH,
            help="timeout of one poll request (default: {default})",
        ),
    )
    readmit_after: int = field(
        default=2,
        metadata=setting(
            "--readmit-after",
            ge=1,
            metavar="N",
            group=_HEALTH,
            help="good health checks before an ejected replica is used again (default: {default})",
        ),
    )
    eject_after: int = field(  # failed health checks in a row (a refused connection: at once)
        default=2,
        metadata=setting(
            "--eject-after",
            ge=1,
            metavar="N",
            group=_HEALTH,
            help="failed or timed-out health checks in a row that eject a replica "
            "(default: {default}; a refused connection ejects at once)",
        ),
    )
    max_retries: int = field(
        default=2,
        metadata=setting(
            "--max-retries",
            ge=0,
            metavar="N",
            group=_HEALTH,
            help="other replicas tried when one cannot have begun the request: refused or "
            "timed-out connection, request not fully sent, 503 (default: {default})",
        ),
    )
    keepalive_expiry_s: float = field(  # below the replicas' keep-alive: no close-under-us race
        default=2.0,
        metadata=setting(
            "--keepalive-expiry",
            gt=0,
            metavar="SECONDS",
            group=_HEALTH,
            help="idle connections to replicas are not reused after this; keep it below the "
            "replicas' keep-alive timeout (uvicorn's: 5 s) (default: {default})",
        ),
    )
    connect_timeout_s: float = field(
        default=5.0,
        metadata=setting(
            "--connect-timeout",
            gt=0,
            metavar="SECONDS",
            group=_HEALTH,
            help="(default: {default})",
        ),
    )
    read_timeout_s: float = field(  # longest silence from a replica before the request fails
        default=300.0,
        metadata=setting(
            "--read-timeout",
            gt=0,
            metavar="SECONDS",
            group=_HEALTH,
            help="longest silence from a replica (default: {default})",
        ),
    )
    retry_after_s: int = field(
        default=1,
        metadata=setting(
            "--retry-after",
            ge=0,
            metavar="SECONDS",
            group=_HEALTH,
            help="Retry-After of the router's 503s (default: {default})",
        ),
    )
    replica_api_key: str | None = field(  # the router's own polls of the replicas
        default=None,
        metadata=setting(
            "--replica-api-key",
            env=("LORAPLEX_API_KEY",),
            metavar="KEY",
            group="replicas",
            help="API key for the router's own polls of /v1/adapters, /v1/models and /metrics "
            "(an operator key; default: {env}); "
            "clients' Authorization headers are passed through",
        ),
    )
    status_api_key: str | None = field(  # /v1/replicas shows every adapter name
        default=None,
        metadata=setting(
            "--status-api-key",
            env=(ENV_STATUS_API_KEY,),
            metavar="KEY",
            group="server",
            help="key for GET /v1/replicas, the router's view with every adapter name "
            "(default: {env}; none: that route is off)",
        ),
    )
    push_api_key: str | None = field(  # adapter pushes: up to --max-push-bytes each
        default=None,
        metadata=setting(
            "--push-api-key",
            env=(ENV_PUSH_API_KEY,),
            metavar="KEY",
            group="server",
            help="key for POST /v1/admin/adapters/{name}/push, checked before the body is "
            "read (the replicas' admin key, whose Authorization header is passed on to them; "
            "default: {env}; none: that route is off)",
        ),
    )
    max_request_bytes: int = field(
        default=16 << 20,
        metadata=setting(
            "--max-request-bytes",
            parse=parse_byte_size,
            ge=1,
            metavar="BYTES",
            group="server",
            help="largest request body, counted while reading (413 beyond it), e.g. 16MiB "
            "(default: 16MiB)",
        ),
    )
    max_push_bytes: int = field(
        default=1 << 30,
        metadata=setting(
            "--max-push-bytes",
            parse=parse_byte_size,
            ge=1,
            metavar="BYTES",
            group="server",
            help="largest adapter push body (POST /v1/admin/adapters/NAME/push), read once and "
            "sent to every target replica, 413 beyond it (default: 1GiB)",
        ),
    )
    push_targets: str = field(
        default="all",
        metadata=setting(
            "--push-targets",
            choices=PUSH_TARGETS,
            group="replicas",
            help="which replicas an adapter push goes to: all (every known replica, the "
            "default: a name pushed anywhere is served the same everywhere) or holders (the "
            "replicas whose residency lists the name; every replica while none does)",
        ),
    )
    host: str = field(
        default="127.0.0.1",
        metadata=setting("--host", group="server", help="address to bind (default: {default})"),
    )
    port: int = field(
        default=8080,
        metadata=setting(
            "--port", ge=0, le=65535, group="server", help="port to bind (default: {default})"
        ),
    )
    log_level: str = field(
        default="info",
        metadata=setting(
            "--log-level",
            parse=parse_log_level,
            choices=LOG_LEVELS,
            group="server",
            help="(default: {default})",
        ),
    )

    def validate(self) -> None:
        """Raise ValueError naming the first bad setting."""
        if not (self.replicas or self.replicas_file or self.replicas_dns):
            raise ValueError("no replicas: give --replica URL, --replicas-file or --replicas-dns")
        check_fields(self)  # the declared choices and bounds
        self.weights.validate()
        self.thresholds.validate()
        self.homes.validate()
        if self.replicas_dns is not None:
            host, sep, port = self.replicas_dns.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"replicas_dns: expected NAME:PORT, got {self.replicas_dns!r}")
