"""The house's rules, checked on the source: `app/` is the engine library (no Ray, no
FastAPI, no deployments), no dialect imports another, no import circles, and files and
functions stay small enough to read (migrations and GPU kernels aside)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_LINES, MAX_FUNCTION_LINES = 350, 70
EXEMPT = ("migrations", "triton_kernels")


def _modules() -> dict[str, Path]:
    found = {}
    for base in ("app", "deployments"):
        for path in (ROOT / base).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> list[str]:
    """Every module `path` imports, at the top or inside a function."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names += [f"{node.module}.{a.name}" for a in node.names] + [node.module]
    return names


def _ours(name: str) -> str | None:
    """The module of this tree that an imported name lives in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _graph() -> dict[str, set[str]]:
    graph = {}
    for module, path in MODULES.items():
        targets = {_ours(n) for n in _imports(path)} - {None, module}
        # A module imports its package's __init__ on the way: not an edge of its own.
        graph[module] = {t for t in targets if not module.startswith(f"{t}.")}
    return graph


def test_app_imports_neither_ray_fastapi_nor_deployments():
    for module, path in MODULES.items():
        if not module.startswith("app") or module == "app":  # app:graph is lazy, by design
            continue
        roots = {n.split(".")[0] for n in _imports(path)}
        assert not roots & {"ray", "fastapi", "starlette", "deployments"}, module


def test_no_dialect_imports_another():
    for module, targets in _graph().items():
        parts = module.split(".")
        if parts[:2] != ["deployments", "api"] or len(parts) < 4:
            continue
        for target in targets:
            other = target.split(".")
            if other[:2] == ["deployments", "api"] and len(other) >= 4:
                assert other[2] == parts[2], f"{module} imports {target}"


def test_no_import_circles():
    graph, seen, done = _graph(), [], set()

    def visit(module: str) -> None:
        if module in done:
            return
        assert module not in seen, " -> ".join([*seen[seen.index(module) :], module])
        seen.append(module)
        for target in sorted(graph[module]):
            visit(target)
        seen.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_files_and_functions_stay_small():
    for module, path in MODULES.items():
        if any(part in EXEMPT for part in path.parts):
            continue
        text = path.read_text()
        assert text.count("\n") <= MAX_FILE_LINES, f"{module}: {text.count(chr(10))} lines"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                assert lines <= MAX_FUNCTION_LINES, f"{module}.{node.name}: {lines} lines"
