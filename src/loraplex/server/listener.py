"""Options of the HTTP listener that ``vllm serve`` has and uvicorn lacks: an access log quiet
for polled paths (``--disable-access-log-for-endpoints``, :class:`AccessLogFilter`) and TLS
files reloaded while serving (``--enable-ssl-refresh``, :class:`CertRefresher`), which KServe
passes when it mounts rotating certificates.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from collections.abc import Iterable
from typing import Protocol

log = logging.getLogger("loraplex.server.app")  # the server's log lines keep one logger name

ACCESS_LOGGER = "uvicorn.access"


class AccessLogFilter(logging.Filter):
    """Drops uvicorn access-log records whose path (query string ignored) is one of ``paths``.

    uvicorn logs ``(client, method, path?query, http_version, status)`` as the record's args:
    ``keep(record) = record.args[2].split("?")[0] not in paths``."""

    def __init__(self, paths: Iterable[str]) -> None:
        super().__init__()
        self.paths = frozenset(paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) < 3 or not isinstance(args[2], str):
            return True
        return args[2].split("?", 1)[0] not in self.paths


class _CertContext(Protocol):
    def load_cert_chain(self, certfile: str, keyfile: str | None = None) -> None: ...
    def load_verify_locations(self, cafile: str | None = None) -> None: ...


class CertRefresher:
    """Reloads ``certfile``/``keyfile`` (and ``ca_certs``) into the listener's SSL context when
    any of them changes (mtime, size or inode: Kubernetes swaps a Secret's files through a
    symlink), so new connections get the new certificate without a restart; connections
    already open keep theirs. A reload that fails (files half written) is logged and the old
    certificate stays until the next change.

    :meth:`check` looks once (tests call it); :meth:`start` polls every ``interval_s`` in a
    daemon thread until :meth:`stop`."""

    def __init__(
        self,
        context: _CertContext,
        certfile: str,
        keyfile: str | None,
        ca_certs: str | None = None,
        *,
        interval_s: float = 2.0,
    ) -> None:
        self.context = context
        self.certfile, self.keyfile, self.ca_certs = certfile, keyfile, ca_certs
        self.interval_s = interval_s
        self.reloads = 0
        self._seen = self._stamps()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _stamps(self) -> tuple[tuple[int, int, int] | None, ...]:
        out = []
        for f in (self.certfile, self.keyfile, self.ca_certs):
            if f is None:
                out.append(None)
                continue
            try:
                st = os.stat(f)  # follows the symlink to the current file
            except OSError:
                out.append(None)
                continue
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(out)

    def check(self) -> bool:
        """Reload if a file changed since the last look; whether a reload succeeded."""
        now = self._stamps()
        if now == self._seen:
            return False
        self._seen = now
        try:
            self.context.load_cert_chain(self.certfile, self.keyfile)
            if self.ca_certs is not None:
                self.context.load_verify_locations(self.ca_certs)
        except (OSError, ssl.SSLError, ValueError) as e:
            log.warning("TLS files changed but could not be loaded (keeping the old ones): %s", e)
            return False
        self.reloads += 1
        log.info("reloaded the TLS certificate from %s", self.certfile)
        return True

    def start(self) -> None:
        def poll() -> None:
            while not self._stop.wait(self.interval_s):
                try:
                    self.check()
                except Exception:  # never let a watcher bug end the listener
                    log.exception("TLS certificate refresh failed")

        self._thread = threading.Thread(target=poll, name="loraplex-ssl-refresh", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 1)
