"""Logging of ``loraplex serve``, in vLLM's manner: a start-up summary (model, dtype, KV blocks,
adapter tiers and budgets, policy, URL), progress while loading, one line per finished request
(unless ``--disable-log-requests``), a periodic stats line (throughput, running/waiting, KV use,
prefix-cache and adapter hit ratios; unless ``--disable-log-stats``), the ``loraplex.usage``
JSON lines, and ``--log-format json`` (one JSON object per line) for log shippers.

:func:`configure_logging` is called once by the serve command (never by ``create_app``: an app
in a test leaves the process's logging alone); it returns a :class:`LogSetup` that puts the
loggers back. A record may carry fields (``log.info(msg, extra=fields_of(d))``): the JSON
format merges them into its object, the text format shows the message only. Torch-free.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loraplex.config import ServerConfig

__all__ = [
    "TEXT_FORMAT",
    "JsonFormatter",
    "LogSetup",
    "StatsLogger",
    "StatsSource",
    "configure_logging",
    "fields_of",
    "startup_summary",
]

TRACE = 5  # uvicorn's "trace" level
TEXT_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
TEXT_DATEFMT = "%m-%d %H:%M:%S"
LOGGERS = ("loraplex", "uvicorn", "uvicorn.error", "uvicorn.access")
"""The loggers ``configure_logging`` owns: loraplex's (``loraplex.usage`` and
``loraplex.requests`` included) and uvicorn's."""


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, the record's
    ``fields`` and, for an exception, its traceback. ASCII-only, so no line separator inside."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update({k: v for k, v in fields.items() if k not in ("time", "level", "logger")})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=True)


def fields_of(fields: dict[str, Any]) -> dict[str, Any]:
    """The ``extra`` argument of a logging call that attaches ``fields`` to its record."""
    return {"fields": fields}


def _level(name: str) -> int:
    return TRACE if name == "trace" else int(logging.getLevelName(name.upper()))


@dataclass
class LogSetup:
    """What :func:`configure_logging` changed, to put back with :meth:`close`."""

    handler: logging.Handler
    saved: dict[str, tuple[int, list[logging.Handler], bool]] = field(default_factory=dict)

    def close(self) -> None:
        for name, (level, handlers, propagate) in self.saved.items():
            logger = logging.getLogger(name)
            logger.handlers = handlers
            logger.setLevel(level)
            logger.propagate = propagate
        self.saved.clear()
        self.handler.close()


def configure_logging(
    level: str = "info",
    fmt: str = "text",
    *,
    stream: IO[str] | None = None,
    access_log: bool = True,
) -> LogSetup:
    """Send loraplex's and uvicorn's records at ``level`` and above to ``stream`` (stderr) as
    ``fmt`` (text or json); ``access_log`` False silences uvicorn's per-request access lines."""
    logging.addLevelName(TRACE, "TRACE")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT, TEXT_DATEFMT))
    setup = LogSetup(handler)
    for name in LOGGERS:
        logger = logging.getLogger(name)
        setup.saved[name] = (logger.level, list(logger.handlers), logger.propagate)
        logger.handlers = [handler] if name in ("loraplex", "uvicorn") else []
        logger.propagate = name not in ("loraplex", "uvicorn")
        logger.setLevel(_level(level))
    if not access_log:
        logging.getLogger("uvicorn.access").setLevel(logging.CRITICAL + 1)
    return setup


# --------------------------------------------------------------------------- start-up summary


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 28 else f"{n / (1 << 20):.1f} MiB"


def startup_summary(config: ServerConfig, info: dict[str, Any]) -> list[str]:
    """The start-up summary lines of a server with ``config``; ``info`` holds what only the
    built engine knows: architecture, parameters, dtype, device, kv_blocks, block_size,
    kv_bytes, max_model_len, lora (bool), policy, generation_defaults, adapters (names)."""
    e = config.engine
    lines = [
        f"model {e.model}: {info['architecture']}, {info['parameters'] / 1e6:.1f}M parameters, "
        f"dtype {info['dtype']}, device {info['device']}, served as "
        f"{', '.join(config.model_names)}",
        f"KV cache: {info['kv_blocks']} blocks x {info['block_size']} tokens = "
        f"{info['kv_blocks'] * info['block_size']} tokens ({_gib(info['kv_bytes'])}), "
        f"max_model_len {info['max_model_len']}, prefix caching "
        f"{'on' if e.enable_prefix_caching else 'off'}",
        f"scheduler: max_num_seqs {e.max_num_seqs}, max_num_batched_tokens "
        f"{e.max_num_batched_tokens}, waiting limit "
        f"{config.max_waiting or 'none (requests queue)'}",
    ]
    if info.get("lora"):
        host = f"{e.max_cpu_loras} adapters"
        if e.max_cpu_lora_bytes:
            host += f" / {_gib(e.max_cpu_lora_bytes)}"
        disk = (
            f"{e.disk_cache_dir} ({_gib(e.disk_cache_bytes or 0)})" if e.disk_cache_dir else "off"
        )
        lines.append(
            f"adapter tiers: device {e.max_loras} slots (rank <= {e.max_lora_rank}), host {host}, "
            f"disk {disk}, object store {e.adapter_store_url or 'none'}; eviction policy "
            f"{info.get('policy', e.adapter_eviction_policy)}"
        )
        names = info.get("adapters") or []
        lines.append(f"adapters at start-up: {', '.join(names) if names else 'none'}")
    else:
        lines.append("LoRA: off (--enable-lora to serve adapters)")
    defaults = info.get("generation_defaults") or {}
    if defaults:
        shown = ", ".join(f"{k}={v}" for k, v in sorted(defaults.items()))
        lines.append(
            f"default sampling parameters from --generation-config {e.generation_config}: {shown}"
        )
    return lines


# --------------------------------------------------------------------------- periodic stats


@dataclass(frozen=True)
class StatsSource:
    """Where the stats line reads its numbers (functions, so the logger needs no server type):
    ``totals()`` -> cumulative counters (prompt_tokens, generation_tokens, prefix_queries,
    prefix_hits, preemptions, and per adapter tier ``<tier>_hits`` / ``<tier>_misses``);
    ``gauges()`` -> running, waiting, kv_usage (0..1). The token counters must move as the
    engine steps (not when requests finish), or the throughputs read 0 while requests run."""

    totals: Callable[[], dict[str, float]]
    gauges: Callable[[], dict[str, float]]


class StatsLogger:
    """The periodic stats line: rates since the previous line. :meth:`log_once` is what the
    server's timer calls every ``--log-stats-interval`` seconds (and what a test calls); an
    interval with nothing done and nothing in flight after an idle one logs nothing."""

    def __init__(
        self,
        source: StatsSource,
        *,
        logger: logging.Logger | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source = source
        self.log = logger or logging.getLogger("loraplex.stats")
        self.clock = clock
        self._last = source.totals()
        self._at = clock()
        self._idle = True  # nothing to report before the first request

    def log_once(self) -> str | None:
        """Log (and return) one stats line, or None when idle twice in a row."""
        now = self.clock()
        totals = self.source.totals()
        gauges = self.source.gauges()
        dt = max(now - self._at, 1e-9)
        d = {k: v - self._last.get(k, 0.0) for k, v in totals.items()}
        self._last, self._at = totals, now
        idle = not any(d.values()) and not gauges.get("running") and not gauges.get("waiting")
        if idle and self._idle:
            return None
        self._idle = idle

        def ratio(hit: float, total: float) -> str:
            return f"{100 * hit / total:.1f}%" if total > 0 else "-"

        line = (
            f"Avg prompt throughput: {d.get('prompt_tokens', 0) / dt:.1f} tokens/s, "
            f"Avg generation throughput: {d.get('generation_tokens', 0) / dt:.1f} tokens/s, "
            f"Running: {gauges.get('running', 0):.0f} reqs, "
            f"Waiting: {gauges.get('waiting', 0):.0f} reqs, "
            f"KV cache usage: {100 * gauges.get('kv_usage', 0):.1f}%, "
            f"Prefix cache hit rate: {ratio(d.get('prefix_hits', 0), d.get('prefix_queries', 0))}"
        )
        tiers = sorted(
            {k.rsplit("_", 1)[0] for k in d if k.endswith(("_hits", "_misses"))} - {"prefix"}
        )
        fields: dict[str, Any] = {
            "prompt_tokens_per_s": d.get("prompt_tokens", 0) / dt,
            "generation_tokens_per_s": d.get("generation_tokens", 0) / dt,
            **gauges,
            "preemptions": d.get("preemptions", 0),
        }
        if tiers:
            parts = []
            for t in tiers:
                hits, misses = d.get(f"{t}_hits", 0), d.get(f"{t}_misses", 0)
                parts.append(f"{t} {ratio(hits, hits + misses)}")
                fields[f"adapter_{t}_hit_rate"] = hits / (hits + misses) if hits + misses else None
            line += ", Adapter hit rate: " + ", ".join(parts)
        if d.get("preemptions"):
            line += f", Preemptions: {d['preemptions']:.0f}"
        self.log.info(line, extra=fields_of(fields))
        return line
