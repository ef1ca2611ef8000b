"""A throwaway PostgreSQL server for the registry tests.

``postgres_server()`` finds the server binaries (``initdb``/``pg_ctl``/``postgres`` on PATH or
under /usr/lib/postgresql/*/bin), creates a cluster in a temp dir, starts it on a free loopback
port with its unix socket in the same dir, creates a database and yields a
``postgresql+psycopg://`` URL; the server is stopped and the dir removed afterwards. As root
(initdb refuses root) the cluster belongs to the ``postgres`` user (else ``nobody``) and the
binaries run through ``runuser``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

REQUIRE_ENV = "LORAPLEX_REQUIRE_POSTGRES"


def find_pg_bin() -> Path | None:
    """The directory holding initdb, pg_ctl and postgres, or None."""
    candidates: list[Path] = []
    found = shutil.which("initdb")
    if found:
        candidates.append(Path(found).resolve().parent)
    candidates += [Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)]
    for d in candidates:
        if all((d / exe).is_file() for exe in ("initdb", "pg_ctl", "postgres")):
            return d
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_as(user: str | None, cmd: list[str], **kw: object) -> subprocess.CompletedProcess:
    full = ["runuser", "-u", user, "--", *cmd] if user else cmd
    return subprocess.run(full, check=True, capture_output=True, text=True, timeout=120, **kw)  # type: ignore[call-overload]


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """Start a private PostgreSQL; yields the URL of a fresh database in it."""
    bindir = find_pg_bin()
    if bindir is None:
        raise FileNotFoundError("PostgreSQL server binaries (initdb, pg_ctl, postgres) not found")
    user: str | None = None
    if os.geteuid() == 0:
        for name in ("postgres", "nobody"):
            with contextlib.suppress(KeyError):
                pwd.getpwnam(name)
                user = name
                break
        if user is None:
            raise RuntimeError("running as root and no 'postgres' or 'nobody' user to run as")
    tmp = Path(tempfile.mkdtemp(prefix="loraplex-pg-"))
    data, sock = tmp / "data", tmp / "sock"
    sock.mkdir()
    if user:
        pw = pwd.getpwnam(user)
        for p in (tmp, sock):
            os.chown(p, pw.pw_uid, pw.pw_gid)
    port = _free_port()
    log = tmp / "server.log"
    started = False
    try:
        _run_as(
            user,
            [str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust",
             "-E", "UTF8", "--no-sync"],
        )  # fmt: skip
        opts = (
            f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        _run_as(user, [str(bindir / "pg_ctl"), "-D", str(data), "-o", opts, "-l", str(log),
                       "-w", "-t", "60", "start"])  # fmt: skip
        started = True
        import psycopg

        dbname = "loraplex_" + uuid.uuid4().hex[:8]
        with psycopg.connect(
            host="127.0.0.1", port=port, user="postgres", dbname="postgres", autocommit=True
        ) as conn:
            conn.execute(f'CREATE DATABASE "{dbname}"')
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/{dbname}"
    except subprocess.CalledProcessError as e:
        tail = log.read_text()[-2000:] if log.exists() else ""
        raise RuntimeError(
            f"PostgreSQL failed: {' '.join(map(str, e.cmd))}\n{e.stdout}\n{e.stderr}\n{tail}"
        ) from e
    finally:
        if started:
            with contextlib.suppress(subprocess.SubprocessError):
                _run_as(user, [str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"])
        shutil.rmtree(tmp, ignore_errors=True)


def new_database(server_url: str) -> str:
    """A fresh, empty database on the server of ``server_url``; returns its URL."""
    import psycopg
    from sqlalchemy.engine import make_url

    u = make_url(server_url)
    name = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(
        host=u.host, port=u.port, user=u.username, dbname=u.database, autocommit=True
    ) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return u.set(database=name).render_as_string(hide_password=False)


_shared: dict[str, object] = {}


def shared_server_url() -> str:
    """One server per test process (started on first use, stopped at exit); its URL.

    Raises FileNotFoundError when the binaries are missing (callers skip or fail on it)."""
    if "url" not in _shared:
        if "error" in _shared:
            raise _shared["error"]  # type: ignore[misc]
        import atexit

        stack = contextlib.ExitStack()
        try:
            _shared["url"] = stack.enter_context(postgres_server())
        except Exception as e:
            _shared["error"] = e
            raise
        atexit.register(stack.close)
    return str(_shared["url"])


def pg_url_or_skip() -> str:
    """A fresh database URL, or skip the test when PostgreSQL is missing — unless
    ``LORAPLEX_REQUIRE_POSTGRES=1``, where a missing server fails the test."""
    import pytest

    try:
        return new_database(shared_server_url())
    except FileNotFoundError as e:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but PostgreSQL cannot be used: {e}")
        pytest.skip(f"PostgreSQL not installed ({e})")
