"""The package's import graph: every module imports, no module takes part in an import cycle, and imports
point one way through the layers of docs/architecture.md (cli/serve → runtime → models → quant/kernels).

The graph is read statically (ast) from every `import` statement, also those inside functions; imports under
`if TYPE_CHECKING:` are left out, since they never run.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import edgellm

ROOT = Path(edgellm.__file__).parent

# Lowest first: a module may import modules of its own layer and of the layers before it, never after.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("types", ("edgellm", "edgellm.errors", "edgellm.paths", "edgellm.catalog", "edgellm.generation",
               "edgellm.response_format", "edgellm.structured.loop_guard",
               "edgellm.loop_guard_config", "edgellm.progress",
               "edgellm.tomlfile", "edgellm.structured.loop_members", "edgellm.structured.loop_copies",
               "edgellm.structured.string_close")),
    ("kernels", ("edgellm.quant", "edgellm.kernels")),
    ("models", ("edgellm.models",)),
    ("artifacts", ("edgellm.artifact", "edgellm.convert", "edgellm.pull", "edgellm.resolve", "edgellm.store")),
    ("structured", ("edgellm.structured",)),
    # the generation session and what it uses: tokens and logits only, below the Engine facade
    ("session", ("edgellm.runtime.generation_session", "edgellm.runtime.sampling", "edgellm.runtime.context",
                 "edgellm.runtime.power", "edgellm.runtime.allocator", "edgellm.runtime.prompt_cache",
                 "edgellm.runtime.prompt_store", "edgellm.runtime.speculative")),
    ("runtime", ("edgellm.runtime", "edgellm.telemetry")),
    ("apps", ("edgellm.cli", "edgellm.__main__", "edgellm.serve", "edgellm.eval", "edgellm.bench",
              "edgellm.bench.constrained", "edgellm.router", "edgellm.select", "edgellm.doctor",
              "edgellm.chat_repl", "edgellm.store.update", "edgellm.store.repair", "edgellm.store.cli",
              "edgellm.telemetry.cli", "edgellm.bench.schema_corpus", "edgellm.bench.device",
              "edgellm.bench.memory_probe", "edgellm.compress", "edgellm.inventory", "edgellm.inventory_cli")),
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


def _layer(module: str) -> int:
    """Index in LAYERS of the longest prefix naming `module`; a package nobody placed counts as an app."""
    best, rank = -1, len(LAYERS) - 1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    return rank


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str, path: Path) -> set[str]:
    """The edgellm modules `module` imports at run time (a `from pkg import name` of a submodule counts)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
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
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in out if m in MODULES and m != module}


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def test_every_module_imports() -> None:
    """One test, not one per module: the count of tests should say how much is checked."""
    failed = {}
    for module in sorted(set(MODULES) - {"edgellm.__main__"}):  # that one runs the CLI
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - every failing module is listed, not just the first
            failed[module] = f"{type(exc).__name__}: {exc}"
    assert not failed, failed


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


def test_imports_point_down_the_layers() -> None:
    upward = [f"{m} ({LAYERS[_layer(m)][0]}) imports {d} ({LAYERS[_layer(d)][0]})"
              for m, deps in sorted(GRAPH.items()) for d in sorted(deps) if _layer(d) > _layer(m)]
    assert not upward, "imports pointing up the layers:\n" + "\n".join(upward)


def test_the_check_sees_imports_inside_functions() -> None:
    assert "edgellm.convert.pipeline" in GRAPH["edgellm.resolve"]  # imported inside resolve_model()
    assert "edgellm.tokenizer" not in GRAPH["edgellm.structured.processor"]  # only under TYPE_CHECKING
    assert _layer("edgellm.models.blocks") < _layer("edgellm.runtime.engine") < _layer("edgellm.serve.app")
    assert _layer("edgellm.runtime.generation_session") < _layer("edgellm.runtime.engine")
    assert "edgellm.runtime.generation_session" in GRAPH["edgellm.runtime.engine"]
