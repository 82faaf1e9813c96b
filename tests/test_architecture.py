"""The layout rules of docs/architecture.md that a linter does not check: module and
function sizes, no import cycle between modules (function-local imports included), and no
comparison with a registry's names outside the registry (code asks roles and
capabilities)."""

import ast
import importlib
import re
import subprocess
import sys
from dataclasses import dataclass
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


REGISTRY_OWNERS = (
    "kareus.backends.registry", "kareus.plans.methods", "kareus.compose.options",
    "kareus.search", "kareus.search.acquisition", "kareus.job.hardware", "kareus.job.nodes",
    "kareus.gpu.runtimes",
)
"""Every module that makes a registry (imported, so the registries are filled)."""

NOT_REGISTRY_NAMES: dict[tuple[str, str], str] = {
    ("kareus.integrations.megatron.overhead", "megatron"):
        "the arms of a timing: Megatron's own layer against the Kareus layer (local keys)",
    ("kareus.integrations.megatron.overhead", "kareus"): "the same timing's other arm",
    ("kareus.integrations.megatron.overhead", "kernels"):
        "the arms of a runtime timing: the project's kernels against Megatron's modules",
    ("kareus.integrations.megatron.te_check", "megatron"):
        "the arms of a timing: Megatron's own layer against the Kareus layer (local keys)",
    ("kareus.plans.execution", "sequential"):
        "a plan file's field (ExecutionPlan.sequential), read from its JSON",
}
"""(module, literal) pairs compared or looked up that are not a registry's name where
they are, each with why."""



@dataclass(frozen=True)
class Names:
    """One registry's names and the modules allowed to compare them: the one that makes
    the registry and those that define its things."""

    registry: str
    names: frozenset[str]
    owners: frozenset[str]


def _registries() -> list[Names]:
    """Every registry a kareus module makes (found by its ``NAME ... = Registry(`` line),
    once the modules that make them are imported."""
    from kareus.core.registry import Registry

    for owner in REGISTRY_OWNERS:
        importlib.import_module(owner)
    out = []
    for module, path in _modules().items():
        loaded = sys.modules.get(module)
        if loaded is None:
            continue
        source = path.read_text()
        for attr, reg in vars(loaded).items():
            if isinstance(reg, Registry) and re.search(
                    rf"^{attr}\b[^=\n]*= Registry\(", source, re.M):
                names = reg.all_names()
                defined = {reg.module_of(n) for n in names}
                out.append(Names(f"{module}.{attr}", frozenset(names),
                                 frozenset({module, *(m for m in defined if m)})))
    return out


def _compared(node: ast.expr) -> list[str]:
    """The string literals ``node`` is (a constant, or a tuple, list or set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [v for e in node.elts for v in _compared(e)]
    return []


def _literal_comparisons(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, literal, how) of every comparison with a string literal: "==" for ==, !=,
    in, not in, is, is not, ``match``/``case`` patterns and lookups by a literal key
    (``d["kareus"]``, ``d.get("perseus")``: choosing by name as much as ``==`` is);
    "startswith"/"endswith"."""
    ops = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(o, ops) for o in node.ops):
            for e in (node.left, *node.comparators):
                out += [(node.lineno, v, "==") for v in _compared(e)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith")):
            out += [(node.lineno, v, node.func.attr) for a in node.args for v in _compared(a)]
        elif isinstance(node, ast.MatchValue):
            out += [(node.lineno, v, "==") for v in _compared(node.value)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "get" and node.args):
            out += [(node.lineno, v, "==") for v in _compared(node.args[0])]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            out += [(node.lineno, v, "==") for v in _compared(node.slice)]
    return out


def _matches(literal: str, how: str, names: frozenset[str]) -> bool:
    """``literal`` compared ``how`` picks out a name (case ignored: catalogs are looked
    up so; a prefix or suffix of a name for startswith / endswith)."""
    lit = literal.casefold()
    if how == "==":
        return any(lit == n.casefold() for n in names)
    return any(getattr(n.casefold(), how)(lit) for n in names)


def name_comparisons(module: str, source: str, registries: list[Names]) -> list[str]:
    """Each comparison in ``source`` (the module ``module``) with a name of a registry
    that module does not own: "module:line 'name' (registry)"."""
    found = []
    for line, literal, how in _literal_comparisons(ast.parse(source)):
        if (module, literal) in NOT_REGISTRY_NAMES:
            continue
        found += [f"{module}:{line} {literal!r} ({r.registry})" for r in registries
                  if module not in r.owners and _matches(literal, how, r.names)]
    return found


def test_no_module_compares_a_registry_name_it_does_not_own():
    registries = _registries()
    found = [hit for name, path in _modules().items()
             for hit in name_comparisons(name, path.read_text(), registries)]
    assert not found, found


def test_every_registry_is_checked():
    from kareus.core.registry import Registry, all_registries

    checked = {r.registry for r in _registries()}
    assert {"kareus.backends.registry.BACKENDS", "kareus.plans.methods.METHODS",
            "kareus.plans.methods.OPTION_SOURCES", "kareus.compose.options.SOURCE_RECIPES",
            "kareus.search.config.STRATEGIES", "kareus.search.acquisition.PASSES",
            "kareus.job.hardware.GPUS", "kareus.job.nodes.NODES",
            "kareus.gpu.runtimes.RUNTIMES"} <= checked
    # every registry kareus's modules make is checked (tests make their own ones)
    in_kareus = {id(r) for m, mod in list(sys.modules.items()) if m.split(".")[0] == "kareus"
                 for r in vars(mod).values() if isinstance(r, Registry)}
    assert len(checked) == len(in_kareus & {id(r) for r in all_registries()})


def test_the_name_check_finds_a_comparison():
    registries = _registries()

    def hits(code: str) -> list[str]:
        return name_comparisons("kareus.somewhere", code, registries)

    assert hits('if gpu.name.startswith("A100"): pass') == [
        "kareus.somewhere:1 'A100' (kareus.job.hardware.GPUS)"]
    assert hits('if gpu.name == "H200": pass') == [
        "kareus.somewhere:1 'H200' (kareus.job.hardware.GPUS)"]
    assert hits('x = "megatron" in plans') == [
        "kareus.somewhere:1 'megatron' (kareus.plans.methods.METHODS)",
        "kareus.somewhere:1 'megatron' (kareus.gpu.runtimes.RUNTIMES)"]
    assert hits('x = m.name not in ("kareus", "other")') == [
        "kareus.somewhere:1 'kareus' (kareus.plans.methods.METHODS)"]
    assert hits('x = spec.kind != "nvml"') == [
        "kareus.somewhere:1 'nvml' (kareus.backends.registry.BACKENDS)"]
    assert hits('x = source == "searched"') == [
        "kareus.somewhere:1 'searched' (kareus.plans.methods.OPTION_SOURCES)",
        "kareus.somewhere:1 'searched' (kareus.compose.options.SOURCE_RECIPES)"]
    assert hits('x = n.endswith("a40")') == [
        "kareus.somewhere:1 'a40' (kareus.job.hardware.GPUS)"]
    assert hits('match cfg.strategy:\n    case "exhaustive":\n        pass') == [
        "kareus.somewhere:2 'exhaustive' (kareus.search.config.STRATEGIES)"]
    assert hits('x = b.kind != other; y = d.get(name); z = "B100" in text') == []
    assert hits('y = t.get("kareus"); z = plans["perseus"]') == [  # chosen by name
        "kareus.somewhere:1 'kareus' (kareus.plans.methods.METHODS)",
        "kareus.somewhere:1 'perseus' (kareus.plans.methods.METHODS)"]
    assert hits('x = "A100" in device_name') == [  # a catalog alias, case ignored
        "kareus.somewhere:1 'A100' (kareus.job.hardware.GPUS)"]
    assert hits('x = key.startswith("fwd_") or name.endswith("_bwd")') == []
    # the module that makes a registry, or defines a thing of it, may compare its names
    assert name_comparisons("kareus.job.hardware", 'x = n == "H200"', registries) == []


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
