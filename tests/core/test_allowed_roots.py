"""loraplex.paths.contained: the one allowed-roots check, resolved and lexical."""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest

from loraplex.paths import contained, first_outside


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    """root/{a/, link-out -> outside, link-in -> root/a}, root-sibling rootx/, outside/."""
    root, outside, sibling = tmp_path / "root", tmp_path / "outside", tmp_path / "rootx"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    sibling.mkdir()
    (root / "link-out").symlink_to(outside, target_is_directory=True)
    (root / "link-in").symlink_to(root / "a", target_is_directory=True)
    return {"root": root, "outside": outside, "sibling": sibling}


def test_resolved_containment(tree: dict[str, Path]) -> None:
    root, outside = tree["root"], tree["outside"]
    assert contained(root, [root]) and contained(root / "a", [root])
    assert contained(root / "a" / "not-yet-there", [root])
    assert contained(root / "link-in", [root])
    assert not contained(root / "link-out", [root])  # a link inside leading out is outside
    assert not contained(root / "a" / ".." / ".." / "outside", [root])
    assert not contained(tree["sibling"], [root])  # /x/root is no prefix of /x/rootx
    assert contained(outside, [root, outside]) and not contained(outside, [])
    # a root that is itself a link is the place it leads to
    alias = root.parent / "alias"
    alias.symlink_to(root, target_is_directory=True)
    assert contained(root / "a", [alias]) and contained(alias / "a", [root])


def test_lexical_containment_names_without_following_links(tree: dict[str, Path]) -> None:
    root = tree["root"]
    assert contained(root / "link-out", [root], resolve=False)  # named under the root
    assert not contained(root / "a" / ".." / ".." / "outside", [root], resolve=False)
    assert not contained(tree["sibling"], [root], resolve=False)
    cwd = os.getcwd()
    try:
        os.chdir(root)
        assert contained("a", [root], resolve=False) and contained("a", ["."], resolve=False)
    finally:
        os.chdir(cwd)


def test_home_is_expanded(tree: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tree["root"]))
    assert contained("~/a", [tree["root"]]) and contained(tree["root"] / "a", ["~"])
    assert not contained("~/link-out", ["~"])


def test_first_outside_names_the_escaping_file(tree: dict[str, Path]) -> None:
    root, outside = tree["root"], tree["outside"]
    d = root / "a"
    (d / "ok").write_text("x")
    (outside / "secret").write_text("x")
    names = ["missing", "ok", "leak", "dangling"]
    assert first_outside(d, names, [root]) is None
    (d / "dangling").symlink_to(outside / "not-there")  # dangling, but pointing out
    assert first_outside(d, names, [root]) == "dangling"
    (d / "leak").symlink_to(outside / "secret")
    assert first_outside(d, names, [root]) == "leak"
    assert first_outside(d, names, [root, outside]) is None


def test_imports_nothing_internal() -> None:
    """Layer 1: the module imports only the standard library and the config layer's declaration
    of its environment variable (config itself is standard-library only: the layering test), so
    every layer may use it."""
    import loraplex.paths

    tree = ast.parse(Path(loraplex.paths.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    internal = {m for m in imported if m.split(".")[0] == "loraplex"}
    assert internal == {"loraplex.config"}, internal
    outside = imported - internal
    assert outside and all(m.split(".")[0] in sys.stdlib_module_names for m in outside), outside
