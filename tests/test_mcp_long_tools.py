"""Long tools seen from clients that cut requests off, and a server that ends with its client.

Real processes throughout: the SDK's stdio client against `omskills serve`, tiny SAM 3 profile
runs started as jobs that outlive their server (one followed to its end from another server, one
cancelled from a third), a job whose process is killed, and `kill -9` of the process that started
the server.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
import yaml
from conftest import TASK
from mcp_helpers import write_tool, write_toy_skill
from omskills.orchestrator.mcp_client import OmskillsClient, connect
from omskills.records.task import load_record

# Every request of these tests must answer within this, as in a client with a short timeout.
REQUEST_TIMEOUT = 10.0
_CLI = "import sys; from omskills.orchestrator.cli import main; sys.exit(main())"


def _tiny_task(folder: Path, frames: int) -> Path:
    data = yaml.safe_load(TASK.read_text())
    data["intake"]["model"]["scale"] = "tiny"
    data["intake"]["inputs"]["frames"] = frames
    folder.mkdir(parents=True, exist_ok=True)
    task = folder / "task.yaml"
    task.write_text(yaml.safe_dump(data, sort_keys=False))
    return task


async def _call(client: OmskillsClient, tool: str, args: dict[str, Any], messages: list[str]) -> dict[str, Any]:
    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        messages.append(message or "")

    outcome = await client.call(tool, args, on_progress)
    assert not outcome.is_error, outcome.text
    return outcome.structured


async def _until_ended(client: OmskillsClient, job: dict[str, Any], messages: list[str]) -> dict[str, Any]:
    deadline = time.monotonic() + 1800
    while job["state"] == "running":
        assert time.monotonic() < deadline, job
        job = await _call(client, "job_status", {"job_id": job["job_id"], "wait_seconds": 5}, messages)
    return job


def test_a_job_outlives_the_server_that_started_it_and_any_server_follows_or_cancels_it(tmp_path):
    """As the Inspector's CLI or a restarted Claude Desktop does it: every connection a server of its
    own. A tiny profile run started in the first server finishes after that server is gone and its
    result is read from the second; a run the second starts is cancelled from a third, and its step
    is recorded cancelled."""
    # Two frames: SAM 3's tracker (memory attention) first runs on frame 2.
    task = _tiny_task(tmp_path / "ws", frames=2)
    other = _tiny_task(tmp_path / "ws" / "other", frames=2)
    messages: list[str] = []
    seen: dict[str, Any] = {}

    async def first() -> None:
        async with connect(task.parent, read_timeout_seconds=REQUEST_TIMEOUT) as client:
            env = await _call(
                client, "start_job", {"tool": "check_environment", "arguments": {"task": "task.yaml"}}, messages
            )
            seen["environment"] = await _until_ended(client, env, messages)
            seen["job"] = await _call(
                client, "start_job", {"tool": "profile_main_path", "arguments": {"task": "task.yaml"}}, messages
            )
            seen["servers"] = {p.pid for p in psutil.Process().children(recursive=True)}

    async def second() -> None:
        async with connect(task.parent, read_timeout_seconds=REQUEST_TIMEOUT) as client:
            seen["listed"] = (await _call(client, "list_jobs", {}, messages))["jobs"]
            seen["ended"] = await _until_ended(client, seen["job"], messages)
            seen["to cancel"] = await _call(
                client, "start_job", {"tool": "profile_main_path", "arguments": {"task": "other/task.yaml"}}, messages
            )

    async def third() -> None:
        async with connect(task.parent, read_timeout_seconds=REQUEST_TIMEOUT) as client:
            job = seen["to cancel"]
            # Cancel once the study step runs (the model is built; frame 1 is under way).
            while job["state"] == "running" and "study run" not in job["progress"]["message"]:
                job = await _call(client, "job_status", {"job_id": job["job_id"], "wait_seconds": 0.5}, messages)
            assert job["state"] == "running", job
            job = await _call(client, "cancel_job", {"job_id": job["job_id"], "wait_seconds": 5}, messages)
            seen["cancelled"] = await _until_ended(client, job, messages)

    anyio.run(first)
    assert not any(
        psutil.pid_exists(pid)
        and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        and "serve" in " ".join(psutil.Process(pid).cmdline())
        for pid in seen["servers"]
    )  # the first server is gone
    anyio.run(second)
    anyio.run(third)

    assert seen["environment"]["state"] == "succeeded", seen["environment"]
    assert seen["job"]["job_id"] in {j["job_id"] for j in seen["listed"]}  # a new server lists it
    ended = seen["ended"]
    assert ended["state"] == "succeeded", ended["error"]
    assert ended["result"]["frames"] == 2 and ended["result"]["top_modules"]
    record = load_record(task)
    assert record.stages["study"].status == "done" and record.profile is not None and record.contracts

    cancelled = seen["cancelled"]
    assert cancelled["state"] == "cancelled" and "cancelled" in cancelled["error"], cancelled
    interrupted = load_record(other)  # loads: every save was atomic
    assert interrupted.stages["study"].status == "failed" and interrupted.stages["study"].error.startswith(
        "interrupted: cancelled (Cancelled"
    )
    assert interrupted.profile is None and not interrupted.contracts
    # Progress reached the clients while they polled: the tool's phases and heartbeats.
    assert any("profile_main_path: study run" in m for m in messages), messages[-20:]
    assert any(m.startswith("profile_main_path: running for ") for m in messages), messages[-20:]


def test_a_job_whose_process_died_is_failed_with_why_and_its_step_is_not_left_running(tmp_path):
    from mcp_helpers import write_task_record

    skills, workspace = tmp_path / "skills", tmp_path / "ws"
    write_toy_skill(skills)
    record = write_task_record(workspace / "rec" / "task.yaml")
    messages: list[str] = []

    async def scenario() -> dict[str, Any]:
        async with connect(workspace, skills, read_timeout_seconds=REQUEST_TIMEOUT) as client:
            job = await _call(
                client,
                "start_job",
                {"tool": "toy_stage", "arguments": {"task": "rec/task.yaml", "seconds": 120}},
                messages,
            )
            while job["progress"]["message"] != "toy work":
                job = await _call(client, "job_status", {"job_id": job["job_id"], "wait_seconds": 0.5}, messages)
            runner = next(
                p for p in psutil.process_iter(["cmdline"]) if job["job_id"] in " ".join(p.info["cmdline"] or [])
            )
            runner.kill()  # kill -9: it writes nothing
            runner.wait(10)
            return await _call(client, "job_status", {"job_id": job["job_id"], "wait_seconds": 0}, messages)

    dead = anyio.run(scenario)
    assert dead["state"] == "failed" and "ended without a result" in dead["error"], dead
    step = load_record(record).stages["toy_stage"]
    assert step.status == "failed" and step.error, step


# --------------------------------------------------------------------------- the server ends with its parent

_SPAWNING_TOOL = '''
    """A tool that starts a child process and works until cancelled."""

    import subprocess
    import time

    from pydantic import BaseModel

    from omskills import progress
    from omskills.host.toolkit import tool_hints


    class Spawned(BaseModel):
        pid: int


    @tool_hints(title="Spawn a child and work", read_only=True, long_running=True)
    def toy_spawn(seconds: float = 600) -> Spawned:
        """Start `sleep` as a child process, then work with progress for `seconds`."""
        child = subprocess.Popen(["sleep", "600"])
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            progress.report(time.monotonic() - started, seconds, "spawned")
            time.sleep(0.2)
        return Spawned(pid=child.pid)
'''

_PARENT = """
import sys, anyio
from omskills.orchestrator.mcp_client import connect

async def main():
    async with connect(sys.argv[1], sys.argv[2]) as client:
        print("connected", flush=True)
        await client.call("toy_spawn", {})

anyio.run(main)
"""


def _tree(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _command_line(proc: psutil.Process) -> list[str]:
    """Its command line, or nothing for a process that ended (or is a zombie) while being looked at."""
    try:
        return proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


def _wait_for(condition, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _working_in(workspace: Path) -> list[psutil.Process]:
    """Live processes of this workspace, whenever they started: a server for it (`serve` and the
    workspace on its command line) or anything running in it (a server's children inherit its cwd)."""
    where = str(workspace.resolve())
    found = []
    for proc in psutil.process_iter():
        try:
            cmdline = proc.cmdline()
            cwd = proc.cwd()
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if ("serve" in cmdline and where in cmdline) or Path(cwd).is_relative_to(where):
            found.append(proc)
    return found


def _kill_and_expect_no_survivors(parent: subprocess.Popen, tree: list[psutil.Process], workspace: Path) -> None:
    parent.kill()  # SIGKILL: no clean-up of its own
    parent.wait(timeout=10)
    _, alive = psutil.wait_procs(tree, timeout=5)
    survivors = [
        f"{p.pid} {' '.join(p.cmdline()[:6])}" for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    ]
    # Processes started after the snapshot of the tree are not in it: look for them by workspace.
    late = [p for p in _working_in(workspace) if p.pid != os.getpid()]
    for proc in [*alive, *late]:  # leave nothing behind whatever the outcome
        with contextlib.suppress(psutil.Error):
            proc.kill()
    assert not survivors, f"still running 5 s after kill -9 of their ancestor: {survivors}"
    assert not late, f"still working in {workspace} 5 s after kill -9: {[' '.join(p.cmdline()[:6]) for p in late]}"


def test_kill_9_of_the_client_ends_the_server_and_its_children(tmp_path):
    skills = tmp_path / "skills"
    write_toy_skill(skills, tools={})
    write_tool(skills / "toy-skill", "toy_spawn", textwrap.dedent(_SPAWNING_TOOL))
    (tmp_path / "ws").mkdir()
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    parent = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "ws"), str(skills)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert parent.stdout.readline().strip() == "connected"

        # The server (child) and the tool's `sleep` (grandchild) both exist.
        def spawned() -> list[psutil.Process] | None:
            tree = _tree(parent.pid)
            return tree if any(p.name() == "sleep" for p in tree) else None

        tree = _wait_for(spawned, 60, "the tool's child process")
        _kill_and_expect_no_survivors(parent, tree, tmp_path / "ws")
    finally:
        if parent.poll() is None:
            parent.kill()


def test_kill_9_of_omskills_adapt_leaves_no_process(tmp_path):
    run = tmp_path / "run"
    adapt = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _CLI,
            "adapt",
            str(_tiny_task(tmp_path / "in", frames=1)),
            "--scale",
            "tiny",
            "--frames",
            "1",
            "--out",
            str(run),
        ],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def serving() -> list[psutil.Process] | None:
            tree = _tree(adapt.pid)
            servers = [p for p in tree if "serve" in _command_line(p)]
            # Past start-up and inside the tools: the record has a step of its own.
            try:
                working = bool(load_record(run / "task.yaml").stages)
            except Exception:  # not written yet
                working = False
            return tree if servers and working else None

        tree = _wait_for(serving, 300, "the MCP server at work")
        _kill_and_expect_no_survivors(adapt, tree, run)
    finally:
        if adapt.poll() is None:
            adapt.kill()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-n", "0", "-q"]))
