"""Karotte's import structure: the layers of .importlinter (import-linter), no import cycle
among karotte's modules, and no import inside a function unless it must stay lazy.

Every import counts, including those inside functions and under TYPE_CHECKING: an import
hidden in a function is still a dependency, and two of them made the cycles of issue 8.
"""
from __future__ import annotations

import ast
import os
from pathlib import Path

from importlinter import cli as importlinter_cli

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "karotte"

# Imports that stay inside a function, by (module, function), and why; all point down.
LAZY_OK = {
    ("karotte.probe.evidence", "_create_sandbox"):
        "a missing C build becomes a reported failure of the check, not a crash of "
        "`karotte-sandbox check`",
}
# Modules whose imports inside functions all stay there: the CLI imports a command's
# modules when that command runs, so that `--help` and the light commands start fast.
LAZY_MODULES = {"karotte.cli.main", "karotte.cli.sandbox"}


def _modules() -> dict[str, Path]:
    """karotte's modules by name, the C extension (karotte._native) included."""
    found = {}
    for path in PACKAGE.rglob("*"):
        if path.suffix not in (".py", ".so") or "rootfs" in path.parts:
            continue
        parts = [*path.relative_to(REPO).parent.parts, path.name.split(".")[0]]
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(modules: dict[str, Path]) -> list[tuple[str, str, int, str | None]]:
    """Every import of a karotte module by another: (importer, imported, line, the
    function it is in or None)."""
    out = []
    for name, path in modules.items():
        if path.suffix != ".py":
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]

        def visit(node: ast.AST, function: str | None) -> None:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                function = node.name
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules
                           else base for alias in node.names]
            else:
                targets = []
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    out.append((name, target, node.lineno, function))
            for child in ast.iter_child_nodes(node):
                visit(child, function)

        visit(ast.parse(path.read_text(), str(path)), None)
    return out


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_module_imports_only_from_the_layers_below_its_own():
    # The contract and its layer list are in .importlinter; this prints what breaks it.
    cwd = os.getcwd()
    os.chdir(REPO)  # lint-imports finds karotte from the current directory
    try:
        status = importlinter_cli.lint_imports(config_filename=str(REPO / ".importlinter"),
                                               no_cache=True, no_logo=True)
    finally:
        os.chdir(cwd)
    assert status == importlinter_cli.EXIT_STATUS_SUCCESS, \
        "an import points up the layers of .importlinter (see the captured output)"


def test_no_import_cycle_among_karottes_modules():
    imports = _imports(_modules())
    edges: dict[str, set[str]] = {}
    for importer, imported, _, _ in imports:
        edges.setdefault(importer, set()).add(imported)
    cycles = _cycles(edges)
    where = sorted({f"{a} -> {b} (line {line}{f', in {fn}()' if fn else ''})"
                    for cycle in cycles for a, b, line, fn in imports
                    if a in cycle and b in cycle})
    assert not cycles, f"import cycles {cycles}, through:\n" + "\n".join(where)


def test_imports_inside_functions_are_only_those_that_must_stay_lazy():
    found = sorted({(a, b, line, fn) for a, b, line, fn in _imports(_modules())
                    if fn and a not in LAZY_MODULES and (a, fn) not in LAZY_OK})
    assert not found, ("imports inside a function that could be at the top of the module "
                       "(or need a reason in LAZY_OK): " + "; ".join(
                           f"{a} -> {b} (line {line}, in {fn}())" for a, b, line, fn in found))


def test_docs_architecture_shows_the_layer_list_and_every_file_in_it():
    doc = (REPO / "docs" / "architecture.md").read_text()
    layers = (REPO / ".importlinter").read_text().split("layers =\n", 1)[1]
    listed = "\n".join(line.strip() for line in layers.strip().splitlines())
    assert f"```\n{listed}\n```" in doc, "docs/architecture.md must show .importlinter's list"
    files = [p for p in PACKAGE.rglob("*.py")
             if not {"rootfs", "examples", "templates"} & set(p.relative_to(PACKAGE).parts)]
    files += sorted((REPO / "csrc").rglob("*.[ch]"))
    missing = [str(p.relative_to(REPO)) for p in files if f"`{p.relative_to(REPO)}`" not in doc]
    missing += [d for d in ("karotte/examples/", "karotte/templates/") if f"`{d}`" not in doc]
    assert not missing, f"docs/architecture.md names no line for {missing}"
