"""Shared, expensive fixtures: one tiny SAM 3 adaptation reused by every end-to-end test."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

REPO = Path(__file__).resolve().parents[1]
TASK = REPO / "task_records" / "sam3-video-text.yaml"


def omskills(
    *args: str, cwd: Path | None = None, check: bool = False, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "import sys; from omskills.orchestrator.cli import main; sys.exit(main())", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=check,
        env=env,
    )


@pytest.fixture(scope="session")
def tiny_adaptation(tmp_path_factory, worker_id: str) -> Path:
    """`omskills adapt` on tiny SAM 3, 2 frames: the run folder (task.yaml, onnx/, verify/...).

    Made once per test run, not once per xdist worker: the workers share the base temp folder's
    parent, and a file lock lets the first one adapt while the others wait for its folder.
    Tests read it; a test that changes a run works on a copy.
    """
    base = tmp_path_factory.getbasetemp()
    shared = base if worker_id == "master" else base.parent
    out = shared / "tiny-adaptation" / "run"
    finished = out.parent / "adapt-finished"
    with FileLock(str(shared / "tiny-adaptation.lock")):
        if not finished.exists():
            result = omskills("adapt", str(TASK), "--scale", "tiny", "--frames", "2", "--out", str(out))
            assert result.returncode == 0, result.stderr[-3000:]
            finished.write_text(result.stderr)
    return out


def copy_run(run: Path, dest: Path) -> Path:
    """A copy of a run folder with fresh mtimes (as `cp -r` makes), without its lock files: for a
    test that changes a run, so the shared `tiny_adaptation` stays as adapt left it."""
    shutil.copytree(run, dest, copy_function=shutil.copy, ignore=shutil.ignore_patterns(".*.lock"))
    return dest


BENCHMARKS = REPO / "benchmarks"


def zoo_benchmark():
    """benchmarks/zoo.py, the zoo's runner, imported as a module."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    import zoo

    return zoo


@pytest.fixture(scope="session")
def zoo_adaptation(tmp_path_factory, worker_id: str):
    """`zoo_adaptation(name)`: the zoo model adapted as benchmarks/zoo.py does it (adapt, then its
    held-out inputs through load_adapted): (its row, its run folder). Made once per test run, like
    `tiny_adaptation`: the first worker to ask adapts while another waits for the folder."""
    base = tmp_path_factory.getbasetemp()
    shared = (base if worker_id == "master" else base.parent) / "zoo"
    shared.mkdir(exist_ok=True)
    zoo = zoo_benchmark()
    models = {m.name: m for m in zoo.zoo_models()}

    def adapted(name: str):
        out, row_file = shared / name, shared / f"{name}.row.json"
        with FileLock(str(shared / f"{name}.lock")):
            if not row_file.exists():
                row_file.write_text(zoo.run_model(models[name], out).model_dump_json())
        return zoo.ZooRow.model_validate_json(row_file.read_text()), out

    return adapted
