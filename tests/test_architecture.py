"""The layout rules of docs/architecture.md that a linter does not check: module and
function sizes, and no import cycle between modules (function-local imports included)."""

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx

SRC = Path(__file__).resolve().parents[1] / "src" / "kareus"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def test_no_module_over_400_lines():
    long = {name: n for name, p in _modules().items()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long


def test_no_function_over_80_lines():
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {n} lines")
    assert not long


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Kareus modules that ``name`` imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def test_no_import_cycles():
    mods = _modules()
    graph = nx.DiGraph()
    for name, path in mods.items():
        for target in _imports(name, path, set(mods)):
            # a package's __init__ re-exporting its own submodules is not a cycle
            if not target.startswith(name + "."):
                graph.add_edge(name, target)
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, cycles[:5]


BACKEND_REGISTRY = "kareus.backends.registry"


def _backend_names() -> set[str]:
    from kareus.backends.registry import backend_kinds

    return set(backend_kinds())


def _name_comparisons(tree: ast.AST, names: set[str]) -> list[int]:
    """Lines where a value is compared (==, !=, in, not in, is) with a backend's name."""

    def mentions(node: ast.expr) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(mentions(e) for e in node.elts)
        return False

    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
            and any(mentions(e) for e in (node.left, *node.comparators))]


def test_no_module_outside_the_backend_registry_compares_a_backend_name():
    names = _backend_names()
    found = [f"{name}:{line}" for name, path in _modules().items() if name != BACKEND_REGISTRY
             for line in _name_comparisons(ast.parse(path.read_text()), names)]
    assert not found, found


def test_the_name_check_finds_a_comparison():
    names = _backend_names()
    assert _name_comparisons(ast.parse('if spec.name == "nvml": pass'), names) == [1]
    assert _name_comparisons(ast.parse('x = b.name in ("fakegpu", "other")'), names) == [1]
    assert _name_comparisons(ast.parse('x = b.kind != other'), names) == []


def test_the_top_level_holds_at_most_ten_modules():
    modules = [p.stem for p in SRC.glob("*.py") if p.stem != "__init__"]
    assert len(modules) <= 10, modules


def test_only_the_megatron_integration_imports_megatron():
    """`import kareus` (and the CLI, the runtime) never imports Megatron-Core: it is an
    optional extra, and kareus.runtime stays free of framework imports (issue 22)."""
    offenders = []
    for path in SRC.rglob("*.py"):
        if "integrations" in path.relative_to(SRC).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(SRC)}: {n}" for n in names
                          if n.split(".")[0] == "megatron"]
    assert not offenders
    code = ("import sys, kareus, kareus.cli, kareus.integrations, "
            "kareus.integrations.megatron, kareus.runtime.layer_plan; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
