"""The package's import graph, read from the modules' own source (every ``import``, including
those inside functions and ``if TYPE_CHECKING``): no cycles, and no arrow from a lower layer to
a higher one. The layers, lowest first, are listed here on purpose: moving a module between
layers is a design change and shows in this file's diff."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dart_client"

# Lowest first. A module belongs to the first prefix it starts with (longest prefix wins).
LAYERS: list[tuple[str, ...]] = [
    # Foundations: errors, the native module, resources, chat templates, corpora readers.
    (
        "dart_client._native",
        "dart_client.errors",
        "dart_client.devices",
        "dart_client.embedded",
        "dart_client.templates",
        "dart_client.data",
    ),
    ("dart_client.ngram",),  # n-gram model, pruner, builders, the daemon client
    ("dart_client.models",),  # target wrapper, draft head, kernels
    ("dart_client.decoding",),  # config, drafting, tree building, verification, the loop
    ("dart_client.loading",),  # targets, heads and n-grams from names/paths/URLs
    ("dart_client.dart_model",),  # DartModel: target + head + pruner
    ("dart_client.train",),  # head training and evaluation
    ("dart_client.apps",),  # CLIs, demo, bench, UI
    ("dart_client",),  # the package root re-exports the public API
]


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        if "proto" in path.relative_to(PACKAGE).parts:
            continue  # generated gRPC code
        mods[_module_name(path)] = path
    return mods


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The deepest known module that ``name`` names (``a.b.C`` -> ``a.b``)."""
    while name:
        if name in modules or name == "dart_client._native":
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import sub` imports the submodule when there is one.
            names = [f"{base}.{alias.name}" for alias in node.names] or [base]
            names = [n if _resolve(n, modules) == n else base for n in names]
        for name in names:
            if not name.startswith("dart_client"):
                continue
            target = _resolve(name, modules)
            if target is not None and target != module:
                out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def _layer(module: str) -> int:
    best, best_len = None, -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def test_graph_is_read() -> None:
    graph = _graph()
    # The test reads real arrows: the loop imports verification, DartModel the loop.
    assert "dart_client.decoding.verify" in graph["dart_client.decoding.loop"]
    assert "dart_client.decoding.loop" in graph["dart_client.dart_model"]
    assert len(graph) > 40


def test_every_module_has_a_layer() -> None:
    for module in _graph():
        _layer(module)


def test_no_upward_imports() -> None:
    graph = _graph()
    upward = sorted(
        f"{src} (layer {_layer(src)}) imports {dst} (layer {_layer(dst)})"
        for src, dsts in graph.items()
        for dst in dsts
        if _layer(dst) > _layer(src)
    )
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_import_cycles() -> None:
    graph = _graph()
    # A submodule importing its own package's __init__ re-enters the package: count the
    # package as depending on every submodule it imports, as the graph already says.
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        # The generation loop takes a resolved budget: it never runs the tuner.
        ("dart_client.decoding.loop", "dart_client.decoding.autotune"),
    ],
)
def test_specific_arrows_absent(module: str, forbidden: str) -> None:
    assert forbidden not in _graph()[module]
