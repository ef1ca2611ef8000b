"""The package layering, checked on the source: no import cycle between modules, and no package
importing one it may not (lower layers never import higher ones, the server never imports the
cache, the router only the config layer and the pages' shared head). ``ALLOWED`` below is the
layering itself, one entry per package of ``src/loraplex`` (``docs/architecture.md`` describes
the packages).

Every ``import`` statement counts, also inside functions and under ``TYPE_CHECKING``: a lazy or
type-only import upward is still a dependency a reader has to know about.
"""

from __future__ import annotations

import ast
from pathlib import Path

import loraplex

SRC = Path(loraplex.__file__).parent

BASE = {"types", "config", "paths", "outputs", "requests", "workers", "warm"}
"""The value types and configuration: importable from anywhere."""

ALLOWED: dict[str, set[str]] = {
    # layer 1: no internal imports beyond each other
    "types": set(),
    "paths": {"config"},  # its environment variable is declared there
    "config": {"warm"},  # the package: declarations, value lists, environment, config objects
    "outputs": {"types"},
    "requests": {"types"},
    "client": set(),  # the push client's wire format (httpx; torch and peft only when called)
    "hub": set(),  # hub ids -> local snapshot directories (huggingface_hub only)
    "workers": set(),  # a background thread that exits when idle (threading only)
    "warm": set(),  # an adapter's warm policy or window schedule (the standard library only)
    "pages": set(),  # what the server's and the router's HTML pages share (package data only)
    "logs": BASE,  # logging set-up, start-up summary, stats line (no server types)
    # the C kernels and their build (torch and ctypes, no loraplex layer above the base):
    # below both ``lora`` and ``model``, so neither reads the other's internals for it
    "native": BASE,
    # layer 2: checkpoint facts (safetensors headers, module names and shapes) under both
    # the adapter side and the model side, torch-free
    "checkpoint": BASE,
    "lora": BASE | {"checkpoint", "native"},
    "kv": BASE,
    # the torch-free format and digest modules of lora only (tested below)
    "registry": BASE | {"lora", "checkpoint"},
    # layer 3: of lora, only the adapter binding's needs and the batch plan (tested below)
    "model": BASE | {"kv", "lora", "checkpoint", "native"},
    "cache": BASE | {"lora", "registry", "checkpoint"},
    # layer 4
    "engine": BASE | {"kv", "lora", "model", "cache", "registry", "checkpoint"},
    "entrypoints": BASE | {"engine", "lora", "model"},
    # layer 5: talks to the engine through its client interface, never to the cache
    "server": BASE | {"engine", "registry", "lora", "hub", "logs", "pages"},
    # layer 6: HTTP only, never torch
    "router": BASE | {"pages", "client"},
    # layer 7: on top; nothing imports them. The user tools (``tools/``) are layered one by one.
    "tools": set(),  # the package's own docstring
    "tools.sim": BASE | {"cache"},
    "tools.plan": BASE | {"lora", "model", "entrypoints", "checkpoint", "kv"},
    "tools.verify": BASE | {"lora", "model", "entrypoints", "tools.plan", "checkpoint"},
    "tools.bench": BASE
    | {
        "cache",
        "engine",
        "entrypoints",
        "lora",
        "model",
        "registry",
        "server",
        "tools.sim",
        "testing",
        "kv",
        "checkpoint",
        "native",
    },
    "testing": BASE | {"engine", "lora", "model", "kv", "native"},
    "tools.demo": BASE | {"engine", "entrypoints", "lora", "model", "server", "testing"},
    "cli": BASE
    | {
        "tools.bench",
        "tools.demo",
        "tools.plan",
        "tools.sim",
        "tools.verify",
        "engine",
        "entrypoints",
        "registry",
        "router",
        "server",
        "testing",
        "lora",
        "model",
    },
    "__main__": {"cli"},
    # on top too: other serving systems' entry points (Ray Serve) over a whole loraplex server
    "integrations": BASE | {"server", "registry", "router", "testing", "client"},
}

TORCH_FREE_LORA = {
    "loraplex.lora.digest",
    "loraplex.lora.peft",
    "loraplex.lora.peft.activation",
    "loraplex.lora.peft.config",
    "loraplex.lora.peft.errors",
    "loraplex.lora.peft.experts",
    "loraplex.lora.peft.files",
    "loraplex.lora.peft.layout",
    "loraplex.lora.peft.merging",
    "loraplex.lora.peft.targets",
    "loraplex.lora.peft.tensors",
}
"""The modules of ``lora`` that the registry may import (they import no torch)."""

MODEL_LORA = {
    "loraplex.lora.plan",
    "loraplex.lora.ops",
    "loraplex.lora.slots",
}
"""The modules of ``lora`` that ``model`` may import: the batch plan, and what the adapter
binding reads (the slot bank and the op protocol). Facts about the base's checkpoint come from
``checkpoint``, never from the adapter format."""


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every ``loraplex.*`` module imported by the file (relative imports resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("loraplex")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            if not mod.startswith("loraplex"):
                continue
            out.add(mod)
            for a in node.names:  # ``from loraplex.cache import adapters`` imports a module
                if (SRC.parent / Path(*f"{mod}.{a.name}".split("."))).with_suffix(".py").exists():
                    out.add(f"{mod}.{a.name}")
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in SRC.rglob("*.py") if "migrations" not in p.parts}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        deps = set()
        for dep in _imports(path):
            while dep not in files and "." in dep:  # a name imported from a module
                dep = dep.rpartition(".")[0]
            if dep in files and dep != mod and dep != "loraplex":
                deps.add(dep)
        graph[mod] = deps
    return graph


def _package(mod: str) -> str:
    """``loraplex.X...`` -> ``X``; a user tool (``loraplex.tools.X...``) -> ``tools.X``."""
    parts = mod.split(".")
    if len(parts) > 2 and parts[1] == "tools":
        return f"tools.{parts[2]}"
    return parts[1] if len(parts) > 1 else "loraplex"


def test_no_import_cycles() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    cycles: list[list[str]] = []

    def visit(mod: str, stack: list[str]) -> None:
        state[mod] = 1
        stack.append(mod)
        for dep in sorted(graph[mod]):
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep) :], dep])
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_package_imports_upward() -> None:
    bad = []
    for mod, deps in sorted(_graph().items()):
        pkg = _package(mod)
        if pkg == "loraplex":  # the package's own __init__: the public facade
            continue
        assert pkg in ALLOWED, f"{mod}: package {pkg!r} has no layer in ALLOWED (add it)"
        for dep in sorted(deps):
            dpkg = _package(dep)
            if dpkg == pkg:
                continue
            if dpkg not in ALLOWED[pkg]:
                bad.append(f"{mod} imports {dep} ({pkg} may import {sorted(ALLOWED[pkg])})")
            elif pkg == "registry" and dpkg == "lora" and dep not in TORCH_FREE_LORA:
                bad.append(f"{mod} imports {dep} (the registry may use only {TORCH_FREE_LORA})")
            elif pkg == "model" and dpkg == "lora" and dep not in MODEL_LORA:
                bad.append(f"{mod} imports {dep} (the model may use only {MODEL_LORA})")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_imports() -> None:
    """The walk itself works: known edges are found (a checker that sees nothing passes all)."""
    graph = _graph()
    assert "loraplex.types" in graph["loraplex.engine.llm_engine"]
    assert "loraplex.kv.block_pool" in graph["loraplex.engine.scheduler"]
    assert len(graph) > 60


def test_adapter_identity_is_typed_end_to_end() -> None:
    """No untyped adapter side-channel is left: ``LoRARequest`` carries no ``extra`` dict, and
    no source mentions the old ``AdapterManager`` alias or reads adapter keys out of a dict."""
    import re

    from loraplex.requests import LoRARequest

    assert not hasattr(LoRARequest("a", "/x"), "extra")
    pattern = re.compile(r"AdapterManager|\.extra\[|\.extra\.get\(|\bextra=\{")
    hits = [
        f"{p.relative_to(SRC.parent)}:{i}: {line.strip()}"
        for p in SRC.rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, "\n".join(hits)
