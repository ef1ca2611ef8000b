"""Every registry test gets a fresh ``LORAPLEX_HOME`` (the default registry location, and the
CLI's, starts empty); ``reg`` is a registry over the module's ``root`` of adapters."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplex.registry import Registry, RegistryPolicy


@pytest.fixture(autouse=True)
def _home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_HOME", str(tmp_path / "home"))


@pytest.fixture
def reg(db_url: str, root: Path) -> Iterator[Registry]:
    """A registry on ``db_url`` whose allowed root is the test module's ``root`` fixture."""
    r = Registry.open(db_url, policy=RegistryPolicy(allowed_roots=(str(root),)))
    yield r
    r.close()
