"""A step whose process is gone is never shown as running: it reads as failed, interrupted, with the
command that redoes it, and that command redoes it.

Real processes and real signals: `omskills tool profile_main_path` on a two-function driver of a
small net whose main path waits at a gate file (so the test signals it while the step runs, and
the rerun opens the gate), and `omskills serve` answering a real MCP client. Seconds each.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
import yaml
from conftest import omskills
from mcp.shared.exceptions import MCPError
from omskills.records.stages import StageResult
from omskills.records.task import load_record, save_record

CLI = "import sys; from omskills.orchestrator.cli import main; sys.exit(main())"

GATED_DRIVER = """\
import os
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent


def build_model(spec):
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def run_main_path(model, inputs):
    (HERE / "started").write_text(str(os.getpid()))
    while not (HERE / "go").exists():  # the test signals the process here, mid-step
        time.sleep(0.05)
    return {"scores": model(torch.ones(3, 4))}
"""


def _gated_run(folder: Path) -> Path:
    """A run folder whose record names the gated driver (the gate closed)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "gated_driver.py").write_text(GATED_DRIVER)
    task = folder / "task.yaml"
    task.write_text("id: gated\nintake:\n  model:\n    driver: gated_driver.py\n  inputs: {}\n")
    return task


def _start_study(folder: Path) -> subprocess.Popen:
    """`omskills tool profile_main_path` on the run, returned once its step is in the main path."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CLI, "tool", "profile_main_path", "--task", "task.yaml"],
        cwd=folder,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for(lambda: (folder / "started").exists() or proc.poll() is not None)
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    return proc


def _wait_for(condition, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _rerun(error: str, folder: Path) -> subprocess.CompletedProcess:
    """The rerun command the error names, run through the real CLI with the gate open."""
    [command] = re.findall(r"rerun `([^`]+)`", error)
    words = shlex.split(command)
    assert words[:3] == ["omskills", "tool", "profile_main_path"], command
    (folder / "go").touch()
    return omskills(*words[1:], cwd=folder)


def test_ctrl_c_during_a_step_records_it_interrupted_and_the_command_it_names_redoes_it(tmp_path):
    task = _gated_run(tmp_path / "run")
    proc = _start_study(task.parent)
    assert load_record(task).stages["study"].status == "running"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)

    assert proc.returncode == 130 and "omskills: interrupted" in err, err[-2000:]
    study = load_record(task).stages["study"]
    assert study.status == "failed" and study.pid is None
    assert study.error == (
        "interrupted: by SIGINT (Ctrl-C); rerun `omskills tool profile_main_path --task task.yaml` "
        "(or `omskills adapt`) to redo it"
    )
    rerun = _rerun(study.error, task.parent)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    record = load_record(task)
    assert record.stages["study"].status == "done" and record.profile is not None


def test_sigterm_during_a_step_records_it_interrupted_and_exits_143(tmp_path):
    task = _gated_run(tmp_path / "run")
    proc = _start_study(task.parent)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)

    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    study = load_record(task).stages["study"]
    assert study.status == "failed" and study.error.startswith("interrupted: by SIGTERM; rerun `omskills tool ")


def test_a_step_killed_with_sigkill_reads_as_interrupted_to_every_reader_and_its_rerun_redoes_it(tmp_path):
    task = _gated_run(tmp_path / "run")
    proc = _start_study(task.parent)
    proc.kill()  # SIGKILL: nothing of the process runs, nothing is recorded
    proc.wait(timeout=30)

    assert "status: running" in task.read_text()  # the file says what the killed process left
    study = load_record(task).stages["study"]  # every reader loads it
    assert study.status == "failed" and study.error == (
        f"interrupted: the process that ran it (pid {proc.pid}) stopped before it finished (killed, cancelled, "
        "or out of disk); rerun `omskills tool profile_main_path --task "
        f"{task}` (or `omskills adapt`) to redo it"
    )
    # A client reading the record's text through the MCP server reads it interrupted too.
    text = anyio.run(_read_resource, task.parent, "task://task.yaml")
    assert "status: failed" in text and "status: running" not in text and "rerun `omskills tool" in text
    rerun = _rerun(study.error, task.parent)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert load_record(task).stages["study"].status == "done"


async def _read_resource(workspace: Path, uri: str) -> str:
    from omskills.orchestrator.mcp_client import connect

    async with connect(workspace) as client:
        return await client.read_text(uri)


def test_a_tool_server_stopped_by_sigterm_records_the_step_it_was_running_as_interrupted(tmp_path):
    """As when a client (Ctrl-C in `omskills chat`, `omskills fleet`, the MCP Inspector) ends the
    server while a step is deep in a model call that reaches no progress point."""
    from omskills.orchestrator.mcp_client import connect

    task = _gated_run(tmp_path / "run")
    outcome: dict[str, object] = {}

    async def scenario() -> None:
        async with connect(task.parent) as client:
            async with anyio.create_task_group() as group:

                async def call() -> None:
                    try:
                        outcome["call"] = await client.call("profile_main_path", {"task": "task.yaml"})
                    except MCPError as err:
                        outcome["call"] = err

                group.start_soon(call)
                with anyio.fail_after(120):
                    while not (task.parent / "started").exists():
                        await anyio.sleep(0.05)
                server = int((task.parent / "started").read_text())  # the main path runs in the server
                outcome["server"] = server
                os.kill(server, signal.SIGTERM)

    anyio.run(scenario)
    assert isinstance(outcome["call"], MCPError) or outcome["call"].is_error, outcome
    study = load_record(task).stages["study"]
    assert study.status == "failed" and study.error == (
        "interrupted: the tool server stopped (signal SIGTERM); rerun `omskills tool profile_main_path --task "
        f"{task.resolve()}` (or `omskills adapt`) to redo it"
    )


# -- what tells a live step from a dead one ---------------------------------------------------------


def _record_with_study(tmp_path: Path, **owner: object) -> Path:
    task = tmp_path / "task.yaml"
    task.write_text(yaml.safe_dump({"id": "t", "intake": {"model": {"family": "sam3"}}}))
    record = load_record(task)
    record.stages["study"] = StageResult(status="running", started="earlier", **owner)
    save_record(record, task)
    return task


def test_a_step_whose_process_still_runs_reads_as_running(tmp_path):
    from omskills.records.step_owner import HOST, process_started

    alive = os.getppid()
    task = _record_with_study(tmp_path, pid=alive, pid_started=process_started(alive), host=HOST)
    assert load_record(task).stages["study"].status == "running"


def test_a_pid_a_later_process_was_given_does_not_keep_a_dead_step_running(tmp_path):
    from omskills.records.step_owner import HOST, process_started

    alive = os.getppid()  # alive, but it started long after the process the record names
    task = _record_with_study(tmp_path, pid=alive, pid_started=process_started(alive) - 3600, host=HOST)
    study = load_record(task).stages["study"]
    assert study.status == "failed" and study.error.startswith(f"interrupted: the process that ran it (pid {alive})")


def test_a_step_running_on_another_host_is_not_judged_from_here(tmp_path):
    task = _record_with_study(tmp_path, pid=os.getppid(), pid_started=1.0, host="another-node-of-the-cluster")
    assert load_record(task).stages["study"].status == "running"


def test_in_the_stage_table_a_killed_step_is_failed_naming_the_command_that_redoes_it_a_live_one_running(tmp_path):
    from omskills.records.plan import Candidate, Plan
    from omskills.records.step_owner import HOST, process_started
    from omskills.report.stage_status import stage_status

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    task = _record_with_study(tmp_path)
    record = load_record(task)
    record.stages.pop("study")
    head = Candidate(
        name="head",
        module_path="head",
        module_class="Linear",
        description="the head",
        share=0.5,
        calls=2,
        calls_per_frame=1.0,
        params=10,
        boundary_clarity=1.0,
        state_dependent=False,
        score=0.5,
        rank=1,
        status="selected",
        reason="test",
    )
    record.plan = Plan(candidates=[head], first_batch=["head"], rationale="test")
    record.stages["export:head"] = StageResult(status="running", pid=int(dead.stdout))
    alive = os.getppid()
    owner = {"pid": alive, "pid_started": process_started(alive), "host": HOST}
    record.stages["optimize:head"] = StageResult(status="running", **owner)
    save_record(record, task)

    [row] = stage_status(load_record(task), None)
    export, probe, optimize = row.cells[:3]
    assert export.stage == "export" and export.status == "failed"
    assert export.detail.startswith("interrupted: the process that ran it")
    assert f"rerun `omskills tool export_onnx --task {task} --candidate head`" in export.detail
    assert probe.detail == "not reached: export failed"
    assert (optimize.status, optimize.detail) == ("not_run", f"running now (pid {alive} on {HOST})")


@pytest.mark.parametrize(
    ("key", "arguments"),
    [
        ("study", ["--task", "t.yaml"]),
        ("probe:g:onnxslim", ["--task", "t.yaml", "--candidate", "g", "--variant", "onnxslim"]),
        ("verify:emulated", ["--task", "t.yaml", "--precision", "emulated"]),
        ("boundaries:g", ["--task", "t.yaml", "--candidate", "g"]),
    ],
)
def test_the_rerun_command_of_a_step_passes_its_graph_and_variant_as_its_tool_takes_them(key, arguments):
    import inspect

    from omskills.host.toolkit import discover_tools
    from omskills.records.stage_order import rerun_command, step

    words = shlex.split(rerun_command(key, "t.yaml"))
    tool = step(key.split(":")[0]).tool
    assert words == ["omskills", "tool", tool, *arguments]
    parameters = inspect.signature(discover_tools().get(tool).func).parameters
    assert {w.removeprefix("--") for w in words if w.startswith("--")} <= set(parameters)
