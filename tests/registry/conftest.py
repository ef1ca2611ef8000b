"""Every registry test gets a fresh ``LORAPLEX_HOME``: the default registry location (and the
CLI's) starts empty."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_HOME", str(tmp_path / "home"))
