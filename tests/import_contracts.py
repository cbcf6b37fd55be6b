"""import-linter contract types that count every import the house rules care about.

grimp's graph holds `import` statements, absolute and relative. Two kinds of import it cannot
see are added to it before a contract checks it:

- `importlib.import_module("omskills...")` and `__import__("omskills...")` with a literal name
  (relative names resolved against the importing module's package);
- the skill scripts (`skills/<skill>/scripts/*.py`): files outside any package, loaded by path by
  the MCP server. They stand in the graph as `omskills._skills.<skill>.<script>`.

`lint-imports` runs from the checkout root (it reads pyproject.toml there), so the skills are
`./skills`.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import grimp
from importlinter.contracts.acyclic_siblings import AcyclicSiblingsContract
from importlinter.contracts.forbidden import ForbiddenContract
from importlinter.contracts.layers import LayersContract
from importlinter.domain.contract import ContractCheck

ROOT = "omskills"
SKILLS_MODULE = f"{ROOT}._skills"


def source_portions() -> list[Path]:
    """The folders the `omskills` namespace package is made of (found without importing it)."""
    spec = importlib.util.find_spec(ROOT)
    if spec is None or spec.submodule_search_locations is None:
        raise RuntimeError(f"cannot find the {ROOT} package on sys.path")
    return [Path(location) for location in spec.submodule_search_locations]


def module_file(module: str, portions: list[Path]) -> Path | None:
    if "." not in module:
        return None  # the namespace package itself has no file
    relative = Path(*module.split(".")[1:])
    for portion in portions:
        for candidate in (portion / relative / "__init__.py", portion / relative.with_suffix(".py")):
            if candidate.is_file():
                return candidate
    return None


def _literal_import_name(call: ast.Call) -> str | None:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in {"import_module", "__import__"} or not call.args:
        return None
    first = call.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def _resolve(name: str, package: str) -> str:
    if not name.startswith("."):
        return name
    dots = len(name) - len(name.lstrip("."))
    base = package.split(".")[: len(package.split(".")) - dots + 1]
    return ".".join([*base, name.lstrip(".")]).rstrip(".")


def dynamic_imports(module: str, path: Path, is_package: bool) -> Iterator[tuple[str, int, str]]:
    """(imported module, line, line text) for each dynamic import of a literal name in a file."""
    source = path.read_text()
    lines = source.splitlines()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and (name := _literal_import_name(node)):
            yield _resolve(name, package), node.lineno, lines[node.lineno - 1].strip()


def static_imports(path: Path) -> Iterator[tuple[str, int, str]]:
    """(imported module, line, line text) for each absolute import statement of a script."""
    source = path.read_text()
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            yield name, node.lineno, lines[node.lineno - 1].strip()


def _add(graph: grimp.ImportGraph, importer: str, found: Iterator[tuple[str, int, str]]) -> None:
    for imported, line, text in found:
        # `from omskills.x import name` names a module or an attribute: keep the longest module.
        while imported not in graph.modules and "." in imported:
            imported = imported.rpartition(".")[0]
        if imported.startswith(f"{ROOT}.") and imported in graph.modules and imported != importer:
            graph.add_import(importer=importer, imported=imported, line_number=line, line_contents=text)


def skill_module(script: Path) -> str:
    skill = script.parent.parent.name.replace("-", "_")
    return f"{SKILLS_MODULE}.{skill}.{script.stem}"


def add_hidden_imports(graph: grimp.ImportGraph, skills: Path) -> None:
    """Dynamic imports of the package's modules, and the skill scripts with their imports."""
    portions = source_portions()
    for module in sorted(graph.modules):
        path = module_file(module, portions)
        if path is not None:
            _add(graph, module, dynamic_imports(module, path, path.name == "__init__.py"))
    scripts = sorted(skills.glob("*/scripts/*.py"))
    for script in scripts:
        module = skill_module(script)
        for name in (SKILLS_MODULE, module.rpartition(".")[0], module):
            if name not in graph.modules:
                graph.add_module(name)
    for script in scripts:
        module = skill_module(script)
        _add(graph, module, static_imports(script))
        _add(graph, module, dynamic_imports(module, script, False))


class LayersWithDynamicImports(LayersContract):
    type_name = "omskills_layers"

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        add_hidden_imports(graph, Path.cwd() / "skills")
        return super().check(graph, verbose)


class AcyclicWithDynamicImports(AcyclicSiblingsContract):
    type_name = "omskills_acyclic"

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        add_hidden_imports(graph, Path.cwd() / "skills")
        return super().check(graph, verbose)


class ForbiddenWithDynamicImports(ForbiddenContract):
    type_name = "omskills_forbidden"

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        add_hidden_imports(graph, Path.cwd() / "skills")
        return super().check(graph, verbose)
