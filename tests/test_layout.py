"""The shape the code keeps (docs/ and the house style): small files and functions, no import cycle,
a pure core. Each test names what broke it, so a newcomer can fix the place and not the test."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("coordinator", "worker", "shared", "idletrain", "bench")
MAX_FILE_LINES = 400  # "no file over ~400 lines": a few lines of slack before a split is due
MAX_FUNCTION_LINES = 80
SLACK = 10


def _sources() -> dict[str, Path]:
    """Module name -> file, for every module of the project's packages (migrations excluded)."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


SOURCES = _sources()


def _imports(name: str, tree: ast.Module, *, top_level_only: bool) -> set[str]:
    """The project modules `name` imports (relative imports resolved), at module level or anywhere."""
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # a module's top level includes its try/if blocks, but not `if TYPE_CHECKING:`
        nodes = [n for stmt in tree.body if not (isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test))
                 for n in ast.walk(stmt) if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        nodes = [n for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom))
                 and not _inside_function(tree, n)]
    found = set()
    package = name if SOURCES[name].name == "__init__.py" else name.rpartition(".")[0]
    for node in nodes:
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in SOURCES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _inside_function(tree: ast.Module, node: ast.AST) -> bool:
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.lineno <= node.lineno <= fn.end_lineno:
            return True
    return False


TREES = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in SOURCES.items()}


def test_no_file_is_over_the_size_limit():
    big = {str(p.relative_to(REPO)): n for p in SOURCES.values()
           if (n := p.read_text().count("\n")) > MAX_FILE_LINES + SLACK}
    assert not big, f"split these files (lines): {big}"


def test_no_function_is_over_the_size_limit():
    long = {f"{SOURCES[name].relative_to(REPO)}:{node.lineno} {node.name}": node.end_lineno - node.lineno + 1
            for name, tree in TREES.items() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES}
    assert not long, f"split these functions (lines): {long}"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, or None (depth-first search)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_module_import_cycle():
    graph = {name: _imports(name, tree, top_level_only=True) for name, tree in TREES.items()}
    # a package's __init__ may import its own modules (its public surface); those edges are not cycles
    graph = {name: {t for t in targets if not t.startswith(name + ".")} for name, targets in graph.items()}
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


def test_no_package_import_cycle():
    graph: dict[str, set[str]] = defaultdict(set)
    for name, tree in TREES.items():
        src = name.split(".")[0]
        graph[src] |= {t.split(".")[0] for t in _imports(name, tree, top_level_only=False)} - {src}
    assert _cycle(graph) is None, f"packages import each other: {' -> '.join(_cycle(graph))}"


@pytest.mark.parametrize("pkg", ["shared"])
def test_the_core_is_pure(pkg):
    """shared/ is the pure core: no web framework, database or HTTP client, and none of the shells."""
    banned = {"fastapi", "starlette", "sqlalchemy", "httpx", "uvicorn", "coordinator", "worker", "idletrain", "bench"}
    found = {}
    for name, tree in TREES.items():
        if name.split(".")[0] != pkg:
            continue
        for node in ast.walk(tree):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for mod in mods:
                if mod.split(".")[0] in banned:
                    found.setdefault(name, []).append(mod)
    assert not found, f"the pure core imports a shell: {found}"


def test_bench_is_not_in_the_wheel():
    import tomllib

    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert not [p for p in include if p.startswith("bench")], include


def _package_dirs() -> list[Path]:
    return sorted({p.parent for p in SOURCES.values() if p.name == "__init__.py"})


@pytest.mark.parametrize("pkg", _package_dirs(), ids=lambda p: str(p.relative_to(REPO)))
def test_each_package_init_maps_its_modules(pkg: Path):
    """A package's __init__ docstring names each of its modules and sub-packages, and only those."""
    doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text())) or ""
    present = {p.name for p in pkg.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    present |= {f"{d.name}/" for d in pkg.iterdir() if (d / "__init__.py").exists() and d.name != "migrations"}
    missing = sorted(m for m in present if m not in doc and m.removesuffix(".py") + "/" not in doc
                     and not (m.endswith(".py") and re_word(m.removesuffix(".py"), doc)))
    assert not missing, f"{pkg.relative_to(REPO)}/__init__.py's docstring does not map {missing}"
    named = set(re.findall(r"(?m)^\s+([a-z_][a-z0-9_]*\.py)\b", doc))  # the map's entries: one per line
    stale = sorted(n for n in named if not (pkg / n).exists())
    assert not stale, f"{pkg.relative_to(REPO)}/__init__.py's docstring names files that do not exist: {stale}"


def re_word(word: str, text: str) -> bool:
    return re.search(rf"(?m)^\s+{re.escape(word)}\b", text) is not None
