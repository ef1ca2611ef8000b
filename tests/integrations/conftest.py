"""Fixtures of the Ray Serve tests: the tiny fleet workload (model, adapters, shared registry).

Every test module here starts with ``pytest.importorskip("ray.serve", ...)``: without the
``ray`` extra they are skipped with that reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

RAY_MISSING = "needs Ray Serve: pip install 'loraplex[ray]'"


@pytest.fixture(scope="session")
def testbed(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A random tiny Llama, four adapters (a0..a3) and a SQLite registry holding them."""
    from loraplex.integrations.ray_serve.testbed import make_tiny_fleet

    root: Path = tmp_path_factory.mktemp("ray_testbed")
    return make_tiny_fleet(root, 4)
