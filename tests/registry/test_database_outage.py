"""A registry whose database goes away (issue 14): every registry call then raises
:class:`RegistryUnavailableError` (a :class:`RegistryError`; the server answers 503 with
Retry-After), whose message carries neither the driver's text nor the URL's password, while its
``detail`` keeps the driver's reason for the operator. Other database errors stay plain
:class:`RegistryError` s."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from loraplex.registry import Registry, RegistryError, RegistryUnavailableError
from tests.pg import REQUIRE_ENV, postgres_server

PASSWORD = "s3cret-pw-for-the-test"


@contextlib.contextmanager
def private_postgres() -> Iterator[tuple[str, contextlib.ExitStack]]:
    """A PostgreSQL server of this test alone (so it can be stopped): its database URL with a
    password (the server trusts local connections, so any password works) and the stack whose
    ``close()`` stops the server."""
    stack = contextlib.ExitStack()
    try:
        url = stack.enter_context(postgres_server())
    except FileNotFoundError as e:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but PostgreSQL cannot be used: {e}")
        pytest.skip(f"PostgreSQL not installed ({e})")
    with stack:
        yield make_url(url).set(password=PASSWORD).render_as_string(hide_password=False), stack


def _check_unavailable(e: RegistryUnavailableError) -> None:
    msg = str(e)
    assert isinstance(e, RegistryError) and "cannot be reached" in msg
    assert PASSWORD not in msg and PASSWORD not in e.detail
    for driver_text in ("psycopg", "Connection refused", "connection failed", "127.0.0.1"):
        assert driver_text not in msg, msg
    assert e.detail  # the driver's reason, for logs


def test_postgres_going_down_is_registry_unavailable() -> None:
    with private_postgres() as (url, server):
        reg = Registry.open(url)
        try:
            reg.create_tenant("acme", actor="test")
            assert [t.name for t in reg.list_tenants()] == ["acme"]
            server.close()  # the database server stops
            calls = [
                reg.list_tenants,
                reg.generation,
                lambda: reg.create_tenant("bravo", actor="test"),
                lambda: reg.authenticate("lpx-whatever"),
            ]
            for call in calls:
                with pytest.raises(RegistryUnavailableError) as info:
                    call()
                _check_unavailable(info.value)
            with pytest.raises(RegistryUnavailableError) as info:
                Registry.open(url)  # opening it now: the same cause, the same error
            assert PASSWORD not in str(info.value)
        finally:
            reg.close()


def test_a_sqlite_file_that_cannot_be_opened_is_registry_unavailable(tmp_path: Path) -> None:
    db = tmp_path / "registry.db"
    with Registry.open(f"sqlite:///{db}") as reg:
        reg.create_tenant("acme", actor="test")
    db.unlink()
    db.mkdir()  # the path is now a directory: SQLite cannot open it
    with pytest.raises(RegistryUnavailableError) as info:
        Registry.open(f"sqlite:///{db}")
    assert "cannot be reached" in str(info.value) and info.value.detail
    assert "unable to open" not in str(info.value)  # the driver's words stay in ``detail``


def test_other_database_errors_stay_plain_registry_errors(tmp_path: Path) -> None:
    reg = Registry.open(f"sqlite:///{tmp_path / 'r.db'}")
    try:
        reg.create_tenant("acme", actor="test")
        with pytest.raises(RegistryError) as info:
            reg.create_tenant("acme", actor="test")  # a duplicate: not an outage
        assert not isinstance(info.value, RegistryUnavailableError)
    finally:
        reg.close()
