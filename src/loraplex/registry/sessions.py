"""The registry's one session factory: opens (and migrates) the database at a URL and hands out
read sessions and write transactions, with the locking each dialect needs.

Every write transaction bumps ``generation`` first, which serialises writers (a row lock on
PostgreSQL, ``BEGIN IMMEDIATE`` on SQLite); readers poll :meth:`Database.generation` to know when
to re-read.

Errors: a database that cannot be reached or used (the driver's ``OperationalError`` /
``InterfaceError``, a lost connection, a pool time-out; PostgreSQL down, a SQLite file that
cannot be opened) is :class:`RegistryUnavailableError`, whose message has no driver text and no
password; anything else SQLAlchemy raises is a plain :class:`RegistryError`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import (
    ArgumentError,
    DBAPIError,
    InterfaceError,
    OperationalError,
    SQLAlchemyError,
)
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.orm import Session, sessionmaker

from loraplex.registry.db import RegistryState, make_engine, run_migrations
from loraplex.registry.errors import RegistryError, RegistryUnavailableError

log = logging.getLogger(__name__)


def safe_url(url: str) -> str:
    """``url`` with its password hidden (for messages and ``repr``)."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # an unparsable URL is shown as given (it has no parsable password)
        return url


def unreachable(e: BaseException) -> bool:
    """Whether ``e`` means the database cannot be reached or used (not a bad statement)."""
    if isinstance(e, (OperationalError, InterfaceError, PoolTimeoutError)):
        return True
    return isinstance(e, DBAPIError) and bool(e.connection_invalidated)


def _driver_line(e: BaseException) -> str:
    reason = getattr(e, "orig", None) or e
    lines = str(reason).strip().splitlines()
    return lines[0] if lines else type(reason).__name__


class Database:
    """Sessions over one database URL; thread-safe (a session per call)."""

    def __init__(self, url: str) -> None:
        """Open and migrate; any failure is a :class:`RegistryError` without the password."""
        self.url = url
        try:
            self._engine = make_engine(url)
            run_migrations(self._engine)
        except RegistryError:
            raise
        except (ArgumentError, ValueError) as e:
            raise RegistryError(f"bad registry URL {safe_url(url)!r}: {e}") from e
        except (SQLAlchemyError, OSError, ImportError) as e:
            if unreachable(e) or isinstance(e, OSError):
                raise RegistryUnavailableError(
                    f"cannot open registry {safe_url(url)}: the database cannot be reached",
                    detail=_driver_line(e),
                ) from e
            raise RegistryError(f"cannot open registry {safe_url(url)}: {_driver_line(e)}") from e
        self._sessions = sessionmaker(self._engine, expire_on_commit=False)
        dialect = self._engine.dialect.name
        self._dialect = dialect
        database = self._engine.url.database
        memory = dialect == "sqlite" and database in (None, "", ":memory:")
        # one shared in-memory connection: every session must take turns
        self._all_lock: threading.RLock | None = threading.RLock() if memory else None
        # SQLite allows one writer: queue in-process writers here instead of busy-waiting
        self._write_lock: threading.Lock | None = threading.Lock() if dialect == "sqlite" else None
        # reads run without BEGIN/ROLLBACK round trips (each query sees committed data)
        self._read_options: dict[str, Any] = (
            {"loraplex_read": True} if dialect == "sqlite" else {"isolation_level": "AUTOCOMMIT"}
        )

    def close(self) -> None:
        self._engine.dispose()

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A read-only session (its transaction is rolled back)."""
        lock = self._all_lock or _NULL_LOCK
        try:
            with lock, self._sessions() as s:
                s.connection(execution_options=self._read_options)
                yield s
                s.rollback()
        except SQLAlchemyError as e:
            raise self._error(e) from e

    @contextmanager
    def write(self) -> Iterator[Session]:
        """A write transaction that has already bumped the generation (and so holds the
        writer lock of the database); commits on success, rolls back on any error."""
        lock = self._all_lock or self._write_lock or _NULL_LOCK
        try:
            with lock, self._sessions() as s:
                s.connection(execution_options={"loraplex_write": True})
                s.execute(
                    update(RegistryState)
                    .where(RegistryState.id == 1)
                    .values(generation=RegistryState.generation + 1)
                )
                try:
                    yield s
                    s.commit()
                except BaseException:
                    s.rollback()
                    raise
        except SQLAlchemyError as e:
            raise self._error(e) from e

    def _error(self, e: SQLAlchemyError) -> RegistryError:
        """The registry error for a database failure: unavailable (no driver text) when the
        database cannot be reached, else a plain one naming the driver's reason."""
        if unreachable(e):
            detail = _driver_line(e)
            log.warning("registry database %s unavailable: %s", safe_url(self.url), detail)
            return RegistryUnavailableError(
                f"the adapter registry ({self._dialect}) cannot be reached; retry later",
                detail=detail,
            )
        return RegistryError(f"registry database error: {_driver_line(e)}")

    def generation(self) -> int:
        """A counter bumped by every mutation: poll it to know when to re-read."""
        with self.read() as s:
            return int(s.execute(select(RegistryState.generation)).scalar_one())


class _NullLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NULL_LOCK = _NullLock()
