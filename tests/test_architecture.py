"""The house shows the architecture: folders by role, imports that only run downwards, and an
engine that names no model (only the drivers do)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "tools" / "omskills"

# Lower layers never import higher ones. Mechanisms (one layer) may use each other.
LAYERS = {
    "errors": 0,
    "progress": 0,
    "stdio": 0,
    "registry": 0,
    "isolation": 0,
    "files": 0,
    "version": 0,
    "records": 1,
    "contracts": 2,
    "boundary": 2,
    "convert": 2,
    "ascend": 2,
    "runtime": 2,
    "compare": 2,
    "source": 2,
    "profiling": 2,
    "report": 2,
    "host": 2,
    "models": 3,
    "deploy": 4,
    "stages": 5,
}
DRIVER_FILES = {"models/sam3.py", "models/sam31.py"}
NAMES_A_MODEL = re.compile(r"sam[0-9._]*\b|mask_iou|segment", re.IGNORECASE)


def part_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


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


def test_every_engine_module_belongs_to_a_layer():
    unknown = {
        str(rel)
        for rel, _ in engine_modules()
        if rel.parts[0] != "__init__.py" and Path(rel.parts[0]).stem not in LAYERS
    }
    assert not unknown


def test_no_import_runs_upward():
    upward = []
    for rel, path in engine_modules():
        own = Path(rel.parts[0]).stem
        if own == "__init__":
            continue
        for module, line in omskills_imports(path):
            target = part_of(module)
            if target in LAYERS and LAYERS[target] > LAYERS[own]:
                upward.append(f"{rel}:{line} ({own}) imports {module} ({target})")
    assert not upward, "\n".join(upward)


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


def test_outside_the_drivers_no_engine_file_names_a_model():
    named = []
    for path in sorted(ENGINE.rglob("*")):
        rel = path.relative_to(ENGINE).as_posix()
        if path.suffix not in (".py", ".j2") or rel in DRIVER_FILES:
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
