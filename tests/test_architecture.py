"""The house shows the architecture: folders by role, imports that only run downwards, and an
engine that names no model (only the built-in SAM drivers' package does)."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENGINE = REPO / "tools" / "omskills"

# The built-in drivers' package: the one place a model is named (pyproject's import contract
# "engine-without-sam" keeps every other package from importing it).
MODEL_PACKAGE = "sam"
NAMES_A_MODEL = re.compile(r"sam[0-9._]*\b|mask_iou|segment", re.IGNORECASE)


def engine_modules():
    for path in sorted(ENGINE.rglob("*.py")):
        rel = path.relative_to(ENGINE)
        yield rel, path


def omskills_imports(path: Path):
    """Every omskills module a file imports; `from omskills import x` counts as omskills.x."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "omskills" and node.level == 0:
            yield from ((f"omskills.{a.name}", node.lineno) for a in node.names)
        elif (
            isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("omskills.") and node.level == 0
        ):
            yield node.module, node.lineno
        elif isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names if a.name.startswith("omskills"))


def test_stage_modules_do_not_borrow_each_others_record_queries():
    borrowed = []
    for rel, path in engine_modules():
        if rel.parts[0] != "stages":
            continue
        for module, line in omskills_imports(path):
            if module.startswith("omskills.stages.") and module.split(".")[-1] in {
                "toolchain",
                "verify",
                "adapter",
                "delivery",
            }:
                borrowed.append(f"{rel}:{line} imports {module}")
    assert not borrowed, "\n".join(borrowed)


def test_outside_the_sam_package_no_engine_file_names_a_model():
    named = []
    for path in sorted(ENGINE.rglob("*")):
        rel = path.relative_to(ENGINE)
        if path.suffix not in (".py", ".j2") or rel.parts[0] == MODEL_PACKAGE:
            continue
        named += [
            f"{rel}:{n}: {line.strip()}"
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if NAMES_A_MODEL.search(line)
        ]
    assert not named, "\n".join(named)


def test_the_records_hold_no_torch():
    heavy = [
        f"{rel}: imports {name}"
        for rel, path in engine_modules()
        if rel.parts[0] == "records"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for name in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""])
        if name.split(".")[0] in {"torch", "onnx", "onnxruntime"}
    ]
    assert not heavy


def test_the_functions_children_run_import_no_torch():
    """A spawned child imports the module of the function it runs: these run in children for every
    big graph (probes, variant builds and checks, emulation, the plan's emulated graphs), and
    importing torch would add seconds to each start."""
    modules = ["omskills.convert.optimize", "omskills.ascend.precision_fix", "omskills.ascend.emulation"]
    code = f"import sys, {', '.join(modules)}; print([m for m in sys.modules if m.split('.')[0] == 'torch'][:3])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


# lint-imports (pyproject's [tool.importlinter]) checks the layers; these tests show it counts every
# kind of import. Each plants one upward import, records -> stages, in a copy of the checkout.
PLANTED = {
    "absolute": "from omskills.stages import steps\n",
    "relative": "from ..stages import steps\n",
    "dynamic": "def _steps():\n    import importlib\n\n    return importlib.import_module('omskills.stages.steps')\n",
}


def lint_imports(checkout: Path) -> subprocess.CompletedProcess[str]:
    """lint-imports on a copy of the checkout, which alone provides `omskills` (-S keeps the
    editable install's .pth, which names this checkout, off sys.path)."""
    paths = [str(checkout / "tools"), str(checkout / "orchestrator"), sysconfig.get_paths()["purelib"]]
    run = (
        f"import sys; sys.path[:0] = {paths!r}; "
        "from importlinter.cli import lint_imports_command; lint_imports_command()"
    )
    return subprocess.run(
        [sys.executable, "-S", "-c", run, "--no-cache"],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "300"},  # rich wraps a report's lines at the terminal's width
    )


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    copy = tmp_path_factory.mktemp("checkout")
    ignore = shutil.ignore_patterns("__pycache__")
    for folder in ("tools", "orchestrator", "skills"):
        shutil.copytree(REPO / folder, copy / folder, ignore=ignore)
    (copy / "tests").mkdir()
    shutil.copy(REPO / "tests" / "import_contracts.py", copy / "tests")
    shutil.copy(REPO / "pyproject.toml", copy)
    return copy


def test_the_checkout_keeps_its_import_contracts(checkout):
    result = lint_imports(checkout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout


@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_an_upward_import_of_any_kind_breaks_the_layers(checkout, tmp_path, kind):
    planted = tmp_path / "checkout"
    shutil.copytree(checkout, planted)
    task = planted / "tools" / "omskills" / "records" / "task.py"
    task.write_text(task.read_text() + "\n\n" + PLANTED[kind])
    result = lint_imports(planted)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "omskills imports run downwards BROKEN" in result.stdout
    assert "omskills.records.task -> omskills.stages.steps" in result.stdout


def test_a_skill_script_importing_the_agent_side_breaks_the_layers(checkout, tmp_path):
    planted = tmp_path / "checkout"
    shutil.copytree(checkout, planted)
    script = next((planted / "skills").glob("*/scripts/*.py"))
    script.write_text(script.read_text() + "\nfrom omskills.orchestrator import cli\n")
    result = lint_imports(planted)
    assert result.returncode == 1, result.stdout + result.stderr
    assert (
        f"omskills._skills.{script.parent.parent.name.replace('-', '_')}.{script.stem} -> omskills.orchestrator.cli"
        in (result.stdout)
    )
