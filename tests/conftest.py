"""Shared, expensive fixtures: one tiny SAM 3 adaptation reused by every end-to-end test."""

from __future__ import annotations

import json
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


# --- spreading the suite over the xdist workers ----------------------------------------------
#
# `--dist loadscope` (pyproject) with the scopes below: a scope is a unit of work that one worker
# runs in a row. A file whose tests share module-scoped state (a server, a cluster, an export) is
# one unit, as `--dist loadfile` makes it. The tests of a SPREAD file share only the session
# fixtures above (made once per run for every worker) or nothing: each is a unit of its own, so
# every worker takes them. Units start longest first (seconds in durations.json), so that no long
# unit starts last while the other worker has nothing left; before them all comes the longest test
# that needs the tiny adaptation, so that one worker makes it while the others run long units.

SPREAD = {
    "test_adapt_tiny.py",
    "test_drivers.py",
    "test_hostile_inputs.py",
    "test_mcp_long_tools.py",
    "test_optimize.py",
    "test_record_integrity.py",
    "test_skills_admin.py",
    "test_zoo_clip_memo.py",
    "test_zoo_slice.py",
}
DURATIONS = Path(__file__).with_name("durations.json")
UNLISTED_S = 0.3  # a test durations.json does not list (it lists those of a second or more)


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, or itself in a SPREAD file."""
    path = nodeid.split("::", 1)[0]
    return nodeid if path.rsplit("/", 1)[-1] in SPREAD else path


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--store-durations",
        action="store_true",
        help=f"write each test's seconds (setup, call and teardown) to {DURATIONS.name}: the order units start in",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Units longest first, the one that makes the tiny adaptation before them; xdist's workers
    collect in this order and hand units out in it (`--no-loadscope-reorder`)."""
    seconds = json.loads(DURATIONS.read_text())
    cost: dict[str, float] = {}
    for item in items:
        unit = unit_of(item.nodeid)
        cost[unit] = cost.get(unit, 0.0) + seconds.get(item.nodeid, UNLISTED_S)
    tiny = [unit_of(i.nodeid) for i in items if "tiny_adaptation" in getattr(i, "fixturenames", ())]
    first = max(tiny, key=cost.__getitem__, default=None)
    items.sort(key=lambda i: (unit_of(i.nodeid) != first, -cost[unit_of(i.nodeid)]))  # stable: a unit keeps its order


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadscope` with `unit_of` as the scope (xdist's own scopes are files and classes)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return Units(config, log)


_measured: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _measured[report.nodeid] = _measured.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not session.config.getoption("store_durations") or hasattr(session.config, "workerinput"):
        return
    seconds = json.loads(DURATIONS.read_text())
    for nodeid, took in _measured.items():
        seconds.pop(nodeid, None)
        if took >= 1.0:
            seconds[nodeid] = round(took)
    DURATIONS.write_text(json.dumps(dict(sorted(seconds.items())), indent=1) + "\n")
