"""The package's import graph: every module imports, no module takes part in an import cycle, no two folders
import each other, and imports point one way through the layers of docs/architecture.md (apps → runtime →
session → structured → models → artifacts → families → quant → kernels → types).

The graph is read statically (ast) from every `import` statement: those inside functions and those under
`if TYPE_CHECKING:` too (a type-only import is still a dependency: the types it names have to live below).
The unit of layering is a folder (a subpackage of edgellm) or a module at the top of the package; each is placed
once in LAYERS, and every module of a folder is in its folder's layer.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import edgellm

ROOT = Path(edgellm.__file__).parent

# Lowest first: a unit may import units of its own layer and of the layers before it, never after.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("types", ("edgellm", "edgellm.errors", "edgellm.paths", "edgellm.catalog", "edgellm.generation",
               "edgellm.response_format", "edgellm.loop_guard_config", "edgellm.progress", "edgellm.tomlfile",
               "edgellm.tokenizer", "edgellm.openmp", "edgellm.leases")),
    ("kernels", ("edgellm.kernels",)),  # the C library's bindings
    ("quant", ("edgellm.quant",)),  # storage formats and the matmuls over them
    ("families", ("edgellm.families",)),  # what each architecture is: config, tensor names and shapes
    ("artifacts", ("edgellm.artifact", "edgellm.convert", "edgellm.pull", "edgellm.resolve", "edgellm.store")),
    ("models", ("edgellm.models",)),  # the code that runs a model: the native model, torch's Transformer
    ("structured", ("edgellm.structured",)),
    # the generation session and what it uses: tokens and logits only, below the Engine facade
    ("session", ("edgellm.session",)),
    ("runtime", ("edgellm.runtime", "edgellm.telemetry")),
    ("apps", ("edgellm.cli", "edgellm.__main__", "edgellm.serve", "edgellm.eval", "edgellm.bench", "edgellm.router",
              "edgellm.select", "edgellm.doctor", "edgellm.chat_repl", "edgellm.updates", "edgellm.compress",
              "edgellm.inventory", "edgellm.inventory_cli")),
]


def _modules() -> dict[str, Path]:
    """Every module of the package, found on disk (folders without __init__.py are not packages)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent)
        if all((ROOT.parent / d / "__init__.py").is_file() for d in rel.parents if d != Path(".")):
            found[".".join(rel.with_suffix("").parts).removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def unit(module: str) -> str:
    """The folder (edgellm.X for edgellm/X/...) or top-level module a module belongs to."""
    return ".".join(module.split(".")[:2])


UNITS = sorted({unit(m) for m in MODULES})
RANK = {u: i for i, (_, units) in enumerate(LAYERS) for u in units}


def imports_in(module: str, source: str, is_package: bool) -> set[str]:
    """The edgellm modules `source` (the text of `module`) imports anywhere, a `from pkg import name` of a
    submodule counted as that submodule."""
    package = module if is_package else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("edgellm"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.startswith("edgellm"):
                out.add(base)
                out.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES)
    return {m for m in out if m in MODULES and m != module}


GRAPH = {m: imports_in(m, p.read_text(encoding="utf-8"), p.name == "__init__.py") for m, p in MODULES.items()}


def _unit_edges() -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) → the module imports that make the edge."""
    edges: dict[tuple[str, str], list[str]] = {}
    for m, deps in sorted(GRAPH.items()):
        for d in sorted(deps):
            if unit(m) != unit(d):
                edges.setdefault((unit(m), unit(d)), []).append(f"{m} → {d}")
    return edges


def test_every_module_imports() -> None:
    """One test, not one per module: the count of tests should say how much is checked."""
    failed = {}
    for module in sorted(set(MODULES) - {"edgellm.__main__"}):  # that one runs the CLI
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - every failing module is listed, not just the first
            failed[module] = f"{type(exc).__name__}: {exc}"
    assert not failed, failed


def test_every_folder_has_one_place_in_the_layers() -> None:
    placed = [u for _, units in LAYERS for u in units]
    twice = sorted({u for u in placed if placed.count(u) > 1})
    not_units = sorted(set(placed) - set(UNITS))  # a module inside a folder, or a name that no longer exists
    missing = sorted(set(UNITS) - set(placed))
    assert not (twice or not_units or missing), f"placed twice: {twice}; not a folder or top-level module: " \
                                                f"{not_units}; not placed: {missing}"


def test_no_import_cycles() -> None:
    cycles, state = [], dict.fromkeys(GRAPH, 0)  # 0 unseen, 1 on the current path, 2 done

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(GRAPH[node]):
            if state[nxt] == 1:
                cycles.append(" → ".join(path[path.index(nxt):] + [node, nxt]) if nxt in path else f"{node} → {nxt}")
            elif state[nxt] == 0:
                walk(nxt, path + [node])
        state[node] = 2

    for m in sorted(GRAPH):
        if state[m] == 0:
            walk(m, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_two_folders_import_each_other() -> None:
    edges = _unit_edges()
    both = [f"{a} ↔ {b}:\n    {'; '.join(edges[a, b])}\n    {'; '.join(edges[b, a])}"
            for a, b in sorted(edges) if a < b and (b, a) in edges]
    assert not both, "folders that import each other:\n" + "\n".join(both)


def test_imports_point_down_the_layers() -> None:
    upward = [f"{'; '.join(why)} ({LAYERS[RANK[a]][0]} imports {LAYERS[RANK[b]][0]})"
              for (a, b), why in sorted(_unit_edges().items()) if a in RANK and b in RANK and RANK[b] > RANK[a]]
    assert not upward, "imports pointing up the layers:\n" + "\n".join(upward)


@pytest.mark.parametrize("source, expected", [
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from edgellm.runtime.engine import Engine\n",
     {"edgellm.runtime.engine"}),
    ("import typing\nif typing.TYPE_CHECKING:\n    import edgellm.runtime.engine\n", {"edgellm.runtime.engine"}),
    ("def f():\n    from edgellm.convert import pipeline\n", {"edgellm.convert", "edgellm.convert.pipeline"}),
    ("from ..runtime import engine\n", {"edgellm.runtime", "edgellm.runtime.engine"}),
])
def test_the_check_sees_type_only_and_deferred_imports(source: str, expected: set[str]) -> None:
    assert imports_in("edgellm.structured.api", source, is_package=False) == expected


def test_the_graph_holds_the_edges_it_should() -> None:
    assert "edgellm.convert.pipeline" in GRAPH["edgellm.resolve"]  # imported inside resolve_model()
    assert "edgellm.tokenizer" in GRAPH["edgellm.structured.processor"]  # only under TYPE_CHECKING
    assert "edgellm.session.generation_session" in GRAPH["edgellm.runtime.engine"]
    assert RANK["edgellm.families"] < RANK["edgellm.artifact"] < RANK["edgellm.models"] < RANK["edgellm.session"] \
        < RANK["edgellm.runtime"] < RANK["edgellm.serve"]
    assert unit("edgellm.structured.loop_guard.scanner") == "edgellm.structured" and unit("edgellm") == "edgellm"
