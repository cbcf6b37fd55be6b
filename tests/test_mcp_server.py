"""`omskills serve` seen from real MCP clients (the SDK's stdio and streamable-HTTP clients).

One server on toy skills serves the module (started once, through a blocking portal);
the real skills' listing and the HTTP transport get servers of their own.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from mcp.shared.exceptions import MCPError
from mcp_helpers import TOY_SKILL, toy_tool_names, write_task_record, write_toy_skill
from omskills import progress
from omskills.errors import InputError, OmskillsError
from omskills.host.jobs import JobRegistry
from omskills.host.mcp_server import JOB_TOOLS, build_server, is_path_parameter, parse_http_address
from omskills.host.toolkit import WorkspacePath, skills_root, tool_files
from omskills.orchestrator.mcp_client import OmskillsClient, ToolCallOutcome, connect, connect_http
from omskills.records.task import load_record


@dataclass
class Served:
    portal: BlockingPortal
    client: OmskillsClient
    workspace: Path
    task: Path
    outside: Path
    errlog: Path

    def call(self, name: str, args: dict[str, Any], on_progress=None) -> ToolCallOutcome:
        return self.portal.call(self.client.call, name, args, on_progress)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("mcp")
    skills = root / "skills"
    write_toy_skill(skills)
    workspace = root / "ws"
    task = write_task_record(workspace / "rec" / "task.yaml")
    outside = write_task_record(root / "elsewhere" / "task.yaml", record_id="outside")
    errlog = root / "server.stderr"
    with errlog.open("w") as err, start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(connect(workspace, skills, errlog=err)) as client:
            yield Served(portal, client, workspace.resolve(), task.resolve(), outside.resolve(), errlog)


def test_every_toy_tool_is_listed_with_its_skill_and_typed_schemas(served):
    listed = served.portal.call(served.client.session.list_tools).tools
    by_name = {t.name: t for t in listed}
    assert sorted(by_name) == sorted(toy_tool_names() + list(JOB_TOOLS))
    # Every tool carries a title and annotations; the server's own job tools too.
    assert all(t.title and t.annotations is not None for t in listed)
    assert by_name["job_status"].annotations.read_only_hint and not by_name["start_job"].annotations.read_only_hint
    add = by_name["toy_add"]
    assert add.description.startswith(f"[skill: {TOY_SKILL}] Add a and b.")
    assert add.meta["omskills/skill"] == TOY_SKILL
    assert add.input_schema["properties"]["a"]["type"] == "integer"
    assert add.input_schema["required"] == ["a"]
    # The pydantic return type is published as the output schema.
    assert add.output_schema["properties"]["total"]["type"] == "integer"


def test_a_call_returns_structured_content_and_the_model_reads_it_as_compact_json(served):
    outcome = served.call("toy_add", {"a": 2, "b": 3})
    assert not outcome.is_error
    assert outcome.structured == {"total": 5}
    assert outcome.text == '{"total":5}'  # the server's text is indented; tokens for nothing


def test_bad_arguments_come_back_as_one_readable_line_per_argument(served):
    outcome = served.call("toy_add", {"a": "two", "b": [1]})
    assert outcome.is_error
    lines = outcome.text.splitlines()
    assert len(lines) == 2, outcome.text
    assert lines[0].startswith("toy_add: argument 'a': ") and "valid integer" in lines[0]
    assert lines[1].startswith("toy_add: argument 'b': ")
    assert "pydantic" not in outcome.text and "http" not in outcome.text


def test_a_missing_argument_is_named(served):
    outcome = served.call("toy_add", {})
    assert outcome.is_error and outcome.users_error and outcome.text == "toy_add: argument 'a': required"


def test_unknown_arguments_are_refused_as_the_cli_refuses_them(served):
    outcome = served.call("toy_add", {"a": 1, "c": 2})
    assert outcome.is_error
    assert outcome.text == "toy_add: argument 'c': unknown (this tool takes a, b)"


def test_an_omskills_error_reaches_the_client_with_its_message(served):
    outcome = served.call("toy_fail", {"name": "ghost"})
    assert outcome.is_error and outcome.users_error  # what the tool's CLI exits 2 for: so does `omskills adapt`
    assert outcome.text.endswith("argument 'name': no model called 'ghost'")


def test_the_server_survives_a_crashing_tool_and_keeps_serving(served):
    crash = served.call("toy_crash", {"x": 3})
    assert crash.is_error and crash.text.endswith("RuntimeError: boom at 3") and not crash.users_error
    assert served.call("toy_add", {"a": 1}).structured == {"total": 2}


def test_progress_notifications_arrive_during_a_long_tool(served):
    seen: list[tuple[float, float | None, str | None]] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        seen.append((done, total, message))

    outcome = served.call("toy_slow", {"steps": 5, "pause": 0.3}, on_progress)
    assert outcome.structured == {"steps": 5}
    # At once, before the tool says anything; then its phases with their counts.
    assert seen[0][2] == "toy_slow: started"
    values = [done for done, _, _ in seen]
    assert values == sorted(values) and len(set(values)) == len(values)  # strictly increasing
    assert any("toy steps (2/5)" in (message or "") for _, _, message in seen)


def test_paths_inside_the_workspace_are_resolved_against_it(served):
    outcome = served.call("toy_write", {"out": "made/here.txt", "text": "hi"})
    assert not outcome.is_error
    assert outcome.structured["out"] == str(served.workspace / "made" / "here.txt")
    assert (served.workspace / "made" / "here.txt").read_text() == "hi"


@pytest.mark.parametrize("where", ["../escaped.txt", "/tmp/omskills-escaped.txt", "~/omskills-escaped.txt"])
def test_a_path_outside_the_workspace_is_refused(served, where):
    outcome = served.call("toy_write", {"out": where, "text": "no"})
    assert outcome.is_error
    assert f"argument 'out': {where} is outside the workspace {served.workspace}" in outcome.text
    assert not Path(where).expanduser().exists() and not (served.workspace.parent / "escaped.txt").exists()


def test_a_symlink_out_of_the_workspace_is_refused(served):
    link = served.workspace / "link-out"
    link.symlink_to(served.outside.parent, target_is_directory=True)
    outcome = served.call("toy_write", {"out": "link-out/x.txt", "text": "no"})
    assert outcome.is_error and "outside the workspace" in outcome.text
    assert not (served.outside.parent / "x.txt").exists()


def test_a_path_argument_confined_only_by_its_marker_is_refused_outside_the_workspace(served):
    # `source` has no path-like name: only its WorkspacePath marker tells the server to confine it.
    outcome = served.call("toy_read", {"source": str(served.outside)})
    assert outcome.is_error and f"argument 'source': {served.outside} is outside the workspace" in outcome.text
    started = served.call("start_job", {"tool": "toy_read", "arguments": {"source": "../elsewhere/task.yaml"}})
    assert started.is_error and "argument 'source': ../elsewhere/task.yaml is outside the workspace" in started.text
    assert served.call("toy_read", {"source": "rec/task.yaml"}).structured == {"bytes": served.task.stat().st_size}


def test_a_task_record_outside_the_workspace_is_refused_and_left_alone(served):
    outcome = served.call("toy_stage", {"task": str(served.outside)})
    assert outcome.is_error and "argument 'task'" in outcome.text
    assert load_record(served.outside).stages == {}
    inside = served.call("toy_stage", {"task": "rec/task.yaml"})
    assert not inside.is_error
    assert load_record(served.task).stages["toy_stage"].status == "done"


def test_stdout_noise_from_a_tool_goes_to_stderr_not_the_protocol(served):
    outcome = served.call("toy_write", {"out": "noise.txt", "text": "x"})
    assert not outcome.is_error  # the stdio stream stayed parseable
    log = served.errlog.read_text()
    for noise in (
        "import-time noise",
        "import-time fd noise",
        "python-level noise",
        "fd-level noise",
        "child-process noise",
    ):
        assert noise in log


def test_skill_documents_and_task_records_are_resources(served):
    listed = {r.uri: r for r in served.portal.call(served.client.session.list_resources).resources}
    assert {f"skill://{TOY_SKILL}/SKILL.md", f"skill://{TOY_SKILL}/references/toy.md", "task://rec/task.yaml"} <= set(
        listed
    )
    # Described from the frontmatter / first heading, not left empty.
    assert "Toy tools for testing" in listed[f"skill://{TOY_SKILL}/SKILL.md"].description
    assert "Toy reference" in listed[f"skill://{TOY_SKILL}/references/toy.md"].description
    assert "toy-task" in listed["task://rec/task.yaml"].description
    assert "name: toy-skill" in served.portal.call(served.client.read_text, f"skill://{TOY_SKILL}/SKILL.md")
    assert "id: toy-task" in served.portal.call(served.client.read_text, "task://rec/task.yaml")


def test_path_parameters_are_recognised_by_name_or_marker():
    assert all(is_path_parameter(n, str) for n in ["task", "path", "out", "onnx_path", "work_dir", "input_paths"])
    assert not any(is_path_parameter(n, str) for n in ["prompt", "soc", "dir_count", "outline"])
    assert is_path_parameter("checkpoint", WorkspacePath)
    assert is_path_parameter("checkpoint", WorkspacePath | None)


def test_http_is_loopback_only():
    assert parse_http_address("127.0.0.1:8765") == ("127.0.0.1", 8765)
    assert parse_http_address("[::1]:9000") == ("::1", 9000)
    with pytest.raises(InputError, match="only a loopback address"):
        parse_http_address("0.0.0.0:8765")
    with pytest.raises(InputError, match="HOST:PORT"):
        parse_http_address("8765")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _list_and_call_over_http(url: str, deadline: float) -> tuple[list[str], ToolCallOutcome]:
    while True:
        try:
            async with connect_http(url) as client:
                names = [t.name for t in await client.list_tools()]
                return names, await client.call("toy_add", {"a": 40, "b": 2})
        except Exception:
            if time.monotonic() > deadline:
                raise
            await anyio.sleep(0.5)


@contextlib.contextmanager
def _http_server(workspace: Path) -> Iterator[str]:
    """`omskills serve --http` on the toy skills (written to workspace/skills) in a process of its own; its URL."""
    skills = workspace / "skills"
    write_toy_skill(skills)
    port = _free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from omskills.orchestrator.cli import main; sys.exit(main())",
            "serve",
            "--http",
            f"127.0.0.1:{port}",
            "--workspace",
            str(workspace),
            "--skills-dir",
            str(skills),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_streamable_http_lists_and_calls_tools(tmp_path):
    with _http_server(tmp_path) as url:
        names, outcome = anyio.run(_list_and_call_over_http, url, time.monotonic() + 90)
    assert sorted(names) == toy_tool_names()
    assert outcome.structured == {"total": 42}


def test_every_tool_file_of_the_real_skills_is_listed():
    """Whatever stage tools exist right now, the server lists exactly those (no hand-kept list)."""
    expected = {(path.parent.parent.name, path.stem) for path in tool_files(skills_root())}

    async def listed() -> set[tuple[str, str]]:
        async with connect(skills_root().parent) as client:
            return {(t.skill, t.name) for t in await client.list_tools()}

    assert anyio.run(listed) == expected


# --------------------------------------------------------------------------- jobs, cancellation


def _status(served, tool: str, args: dict[str, Any]) -> dict[str, Any]:
    outcome = served.call(tool, args)
    assert not outcome.is_error, outcome.text
    return outcome.structured


def _assert_step_cancelled(record: Path) -> None:
    """toy_stage was stopped inside its running step: the record says failed (Cancelled), never done."""
    step = load_record(record).stages["toy_stage"]
    assert step.status == "failed" and step.error.startswith("interrupted: cancelled (Cancelled"), step


def test_a_heartbeat_arrives_while_a_tool_reports_nothing(served):
    seen: list[str] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        seen.append(message or "")

    # One step of 4.5 s: the tool itself says nothing between "toy steps (0/1)" and the end.
    served.call("toy_slow", {"steps": 1, "pause": 4.5}, on_progress)
    assert any(m.startswith("toy_slow: running for ") and m.endswith("last: toy steps") for m in seen), seen


def test_start_job_answers_at_once_and_job_status_gives_the_result(served):
    started = _status(served, "start_job", {"tool": "toy_slow", "arguments": {"steps": 3, "pause": 0.5}})
    assert started["state"] == "running" and started["tool"] == "toy_slow" and started["origin"] == "start_job"
    status = _status(served, "job_status", {"job_id": started["job_id"], "wait_seconds": 20})
    assert status["state"] == "succeeded" and status["result"] == {"steps": 3} and status["error"] is None
    listed = _status(served, "list_jobs", {})["jobs"]
    mine = next(j for j in listed if j["job_id"] == started["job_id"])
    assert mine["state"] == "succeeded" and mine["result"] is None  # list_jobs leaves results to job_status


def test_start_job_checks_arguments_exactly_as_a_direct_call(served):
    bad = served.call("start_job", {"tool": "toy_add", "arguments": {"a": "two", "zz": 1}})
    assert bad.is_error
    assert bad.text.splitlines() == [
        "toy_add: argument 'zz': unknown (this tool takes a, b)",
        "toy_add: argument 'a': input should be a valid integer, unable to parse string as an integer",
    ]
    outside = served.call("start_job", {"tool": "toy_write", "arguments": {"out": "../escaped.txt", "text": "no"}})
    assert outside.is_error and "argument 'out': ../escaped.txt is outside the workspace" in outside.text
    assert not (served.workspace.parent / "escaped.txt").exists()
    unknown = served.call("start_job", {"tool": "start_job", "arguments": {}})
    assert unknown.is_error and unknown.text.startswith("start_job: argument 'tool': ")


def test_a_failing_job_reports_its_one_line_error(served):
    started = _status(served, "start_job", {"tool": "toy_fail", "arguments": {"name": "ghost"}})
    status = _status(served, "job_status", {"job_id": started["job_id"], "wait_seconds": 10})
    assert status["state"] == "failed" and status["error"] == "argument 'name': no model called 'ghost'"
    missing = served.call("job_status", {"job_id": "job-999"})
    assert missing.is_error and "argument 'job_id': no job 'job-999'" in missing.text


def _until_message(served, job: dict, message: str) -> dict:
    """The job's status once its progress says `message` (a started job's process takes a moment to start)."""
    deadline = time.monotonic() + 30
    while job["progress"]["message"] != message:
        assert job["state"] == "running" and time.monotonic() < deadline, job
        job = _status(served, "job_status", {"job_id": job["job_id"], "wait_seconds": 0.3})
    return job


def test_cancel_job_stops_the_work_and_a_rerun_finishes_it(served):
    record = served.workspace / "rec" / "cancelled.yaml"
    write_task_record(record)
    started = _status(
        served, "start_job", {"tool": "toy_stage", "arguments": {"task": "rec/cancelled.yaml", "seconds": 60}}
    )
    assert started["task"] == "rec/cancelled.yaml"
    # One job per task record: a second start says which job holds it.
    second = served.call("start_job", {"tool": "toy_stage", "arguments": {"task": "rec/cancelled.yaml"}})
    assert second.is_error and f"held by job {started['job_id']} (toy_stage" in second.text
    _until_message(served, started, "toy work")  # its process is at work inside its step (it starts in a second or two)
    cancelled = _status(served, "cancel_job", {"job_id": started["job_id"], "wait_seconds": 10})
    assert cancelled["state"] == "cancelled" and cancelled["cancel_requested"]
    assert cancelled["elapsed_seconds"] < 30
    _assert_step_cancelled(record)  # the interrupted step was recorded as failed, not done
    rerun = _status(served, "start_job", {"tool": "toy_stage", "arguments": {"task": "rec/cancelled.yaml"}})
    assert _status(served, "job_status", {"job_id": rerun["job_id"], "wait_seconds": 20})["state"] == "succeeded"
    assert load_record(record).stages["toy_stage"].status == "done"


def test_exclusive_jobs_take_turns_first_come_first_served_and_others_do_not_wait():
    registry = JobRegistry()
    release = threading.Event()

    def hold() -> str:
        while not release.wait(0.05):
            progress.check_cancelled()
        return "held"

    first = registry.start("toy_stage", hold, {}, origin="start_job")
    second = registry.start("toy_write", lambda: "second", {}, origin="start_job")
    third = registry.start("toy_write", lambda: "third", {}, origin="call")
    reader = registry.start("toy_add", lambda: "read", {}, origin="call", exclusive=False)
    assert reader.finished.wait(5) and reader.result == "read"
    deadline = time.monotonic() + 5
    while second.progress.message.startswith("started") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert second.progress.message == f"waiting for toy_stage (job {first.id}) to finish"
    assert third.progress.message == f"waiting for toy_stage (job {first.id}) to finish"
    third.cancel()  # a waiting job ends at once, and leaves the queue
    assert third.finished.wait(1) and third.state == "cancelled" and not first.finished.is_set()
    release.set()
    assert second.finished.wait(5) and second.result == "second" and first.result == "held"
    assert first.ended <= second.ended


def test_a_writing_tool_waits_for_the_running_writer_and_says_for_whom(served):
    write_task_record(served.workspace / "rec" / "turns.yaml")
    holder = _status(served, "start_job", {"tool": "toy_stage", "arguments": {"task": "rec/turns.yaml", "seconds": 60}})
    _until_message(served, holder, "toy work")  # at work in its own process
    waiting = _status(served, "start_job", {"tool": "toy_write", "arguments": {"out": "turns.txt", "text": "x"}})
    waiting = _until_message(served, waiting, f"waiting for toy_stage (job {holder['job_id']}) to finish")
    assert waiting["state"] == "running"
    assert served.call("toy_add", {"a": 1}).structured == {"total": 2}  # a quick read-only tool does not wait
    cancelled = _status(served, "cancel_job", {"job_id": waiting["job_id"], "wait_seconds": 5})
    assert cancelled["state"] == "cancelled" and cancelled["elapsed_seconds"] < 5
    assert not (served.workspace / "turns.txt").exists()
    again = _status(served, "start_job", {"tool": "toy_write", "arguments": {"out": "turns.txt", "text": "x"}})
    assert _status(served, "cancel_job", {"job_id": holder["job_id"], "wait_seconds": 10})["state"] == "cancelled"
    assert _status(served, "job_status", {"job_id": again["job_id"], "wait_seconds": 10})["state"] == "succeeded"
    assert (served.workspace / "turns.txt").read_text() == "x"


def test_a_client_cancel_of_a_direct_call_stops_its_job(served):
    record = served.workspace / "rec" / "timed-out.yaml"
    write_task_record(record)

    async def call_with_timeout() -> None:
        # The SDK client sends notifications/cancelled when its request times out.
        with pytest.raises(MCPError, match="[Tt]imed out"):
            await served.client.session.call_tool(
                "toy_stage", {"task": "rec/timed-out.yaml", "seconds": 60}, read_timeout_seconds=1.5
            )

    served.portal.call(call_with_timeout)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        jobs = [j for j in _status(served, "list_jobs", {})["jobs"] if j["task"] == "rec/timed-out.yaml"]
        if jobs and jobs[0]["state"] != "running":
            break
        time.sleep(0.2)
    assert jobs[0]["origin"] == "call" and jobs[0]["state"] == "cancelled", jobs
    _assert_step_cancelled(record)


# --------------------------------------------------------------------------- resources, prompts, completions


def _write_run(served) -> Path:
    """A run folder as `omskills adapt` leaves it: record, delivery note, report, pictures, JSON, a hidden file."""
    run = served.workspace / "runs" / "r1"
    (run / "verify").mkdir(parents=True, exist_ok=True)
    (run / "pictures").mkdir(exist_ok=True)
    record = {
        "id": "r1",
        "intake": {"model": {"family": "sam3"}},
        "plan": {"candidates": [{"name": "vision_backbone"}, {"name": "mask_decoder"}]},
        "stages": {
            "export:vision_backbone": {"status": "failed", "error": "StageError: aten::roll has no ONNX translation"}
        },
    }
    import yaml

    (run / "task.yaml").write_text(yaml.safe_dump(record))
    (run / "DELIVERY.md").write_text("# Delivery\n")
    (run / "verify" / "main_path.html").write_text("<html>report</html>")
    (run / "verify" / "main_path.json").write_text('{"ok": true}')
    (run / "pictures" / "frame_0000.png").write_bytes(b"\x89PNG\r\n\x1a\nfake")
    (run / ".secret.md").write_text("no")
    return run


def test_run_outputs_are_listed_and_read_with_their_mime_types(served):
    _write_run(served)
    listed = {r.uri: r for r in served.portal.call(served.client.session.list_resources).resources}
    delivery = listed["run://runs/r1/DELIVERY.md"]
    assert delivery.mime_type == "text/markdown" and delivery.description.startswith("Delivery note")
    assert listed["run://runs/r1/verify/main_path.html"].mime_type == "text/html"
    assert listed["run://runs/r1/pictures/frame_0000.png"].mime_type == "image/png"
    assert "run://runs/r1/.secret.md" not in listed
    templates = served.portal.call(served.client.session.list_resource_templates).resource_templates
    assert all(t.description for t in templates) and {"task://{+path}", "run://{+path}.png"} <= {
        t.uri_template for t in templates
    }

    read = served.portal.call(served.client.session.read_resource, "run://runs/r1/pictures/frame_0000.png").contents[0]
    assert read.mime_type == "image/png" and base64.b64decode(read.blob) == b"\x89PNG\r\n\x1a\nfake"
    html = served.portal.call(served.client.session.read_resource, "run://runs/r1/verify/main_path.html").contents[0]
    assert html.mime_type == "text/html" and html.text == "<html>report</html>"
    note = served.portal.call(served.client.session.read_resource, "run://runs/r1/DELIVERY.md").contents[0]
    assert note.mime_type == "text/markdown" and note.text == "# Delivery\n"


@pytest.mark.parametrize(
    "uri",
    [
        "run://runs/r1/.secret.md",
        "task://linked-out.yaml",
        "run://runs/r1/linked-out.yaml",
        "task://../elsewhere/task.yaml",
    ],
)
def test_resources_outside_the_workspace_or_hidden_are_refused(served, uri):
    run = _write_run(served)
    for link in (served.workspace / "linked-out.yaml", run / "linked-out.yaml"):
        if not link.is_symlink():
            link.symlink_to(served.outside)
    with pytest.raises(MCPError):
        served.portal.call(served.client.session.read_resource, uri)
    listed = {r.uri for r in served.portal.call(served.client.session.list_resources).resources}
    assert "task://linked-out.yaml" not in listed and "task://runs/r1/linked-out.yaml" not in listed


def test_prompts_guide_to_the_tools_and_complete_their_arguments(served):
    _write_run(served)
    prompts = {p.name: p for p in served.portal.call(served.client.session.list_prompts).prompts}
    assert prompts["adapt_task"].title == "Adapt this task record"
    assert prompts["why_candidate_failed"].title == "Why did this candidate fail?"
    assert all(a.description for p in prompts.values() for a in p.arguments)

    adapt = served.portal.call(served.client.session.get_prompt, "adapt_task", {"task": "runs/r1/task.yaml"})
    text = adapt.messages[0].content.text
    assert "check_environment" in text and "start_job" in text and "task://runs/r1/task.yaml" in text
    why = served.portal.call(
        served.client.session.get_prompt,
        "why_candidate_failed",
        {"task": "runs/r1/task.yaml", "candidate": "vision_backbone"},
    )
    text = why.messages[0].content.text
    assert "export:vision_backbone: failed — StageError: aten::roll has no ONNX translation" in text
    assert "run://runs/r1/onnx/vision_backbone/vision_backbone.onnx.export.log" in text

    ref = types.PromptReference(name="why_candidate_failed")
    tasks = served.portal.call(served.client.session.complete, ref, {"name": "task", "value": "runs/"})
    assert tasks.completion.values == ["runs/r1/task.yaml"]
    candidates = served.portal.call(
        functools.partial(
            served.client.session.complete,
            ref,
            {"name": "candidate", "value": "ma"},
            context_arguments={"task": "runs/r1/task.yaml"},
        )
    )
    assert candidates.completion.values == ["mask_decoder"]


async def _disconnect_mid_call(url: str, deadline: float) -> tuple[ToolCallOutcome, dict[str, Any]]:
    while True:
        try:
            async with connect_http(url) as client:
                await client.list_tools()
                break
        except Exception:
            if time.monotonic() > deadline:
                raise
            await anyio.sleep(0.5)
    async with connect_http(url) as client:
        # A call held for 3 s over HTTP is not mistaken for a disconnect.
        held = await client.call("toy_slow", {"steps": 3, "pause": 1.0})
    with anyio.move_on_after(3):  # the client goes away mid-call
        async with connect_http(url) as client:
            await client.call("toy_stage", {"task": "task.yaml", "seconds": 60})
    await anyio.sleep(3)
    async with connect_http(url) as client:
        jobs = (await client.call("list_jobs", {})).structured["jobs"]
    return held, next(j for j in jobs if j["tool"] == "toy_stage")


def test_streamable_http_disconnect_cancels_the_call(tmp_path):
    record = write_task_record(tmp_path / "task.yaml")
    with _http_server(tmp_path) as url:
        held, job = anyio.run(_disconnect_mid_call, url, time.monotonic() + 90)
    assert not held.is_error and held.structured == {"steps": 3}
    assert job["origin"] == "call" and job["state"] == "cancelled" and job["elapsed_seconds"] < 10, job
    _assert_step_cancelled(record)


def test_start_up_walks_no_workspace(tmp_path, monkeypatch):
    """Records and run outputs are found when a client lists resources, not before `initialize`."""
    skills = tmp_path / "skills"
    write_toy_skill(skills)
    workspace = (tmp_path / "ws").resolve()
    write_task_record(workspace / "run" / "task.yaml")
    looked_into: list[Path] = []  # every folder of the workspace that was walked or listed
    real_walk, real_scandir = os.walk, os.scandir

    def walk(top, *args, **kwargs):
        looked_into.append(Path(top))
        return real_walk(top, *args, **kwargs)

    def scandir(path="."):
        looked_into.append(Path(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "walk", walk)
    monkeypatch.setattr(os, "scandir", scandir)
    server = build_server(workspace, skills)
    assert "toy_add" in server.tool_infos
    assert not [p for p in looked_into if Path(p).resolve().is_relative_to(workspace)], looked_into
    listed = {r.uri for r in anyio.run(server.list_resources)}
    assert "task://run/task.yaml" in listed
    assert any(Path(p).resolve() == workspace for p in looked_into)  # the count above could see a walk


def test_a_server_with_no_tools_says_so_in_one_line(tmp_path):
    (tmp_path / "skills" / "empty-skill").mkdir(parents=True)
    with pytest.raises(OmskillsError, match=r"^no tools found under .*skills \(a tool is"):
        build_server(tmp_path, tmp_path / "skills")


def test_job_tool_arguments_are_read_and_worded_as_skill_tool_arguments(served):
    # Lists and objects sent as JSON strings (as some model clients do) are parsed first, as the SDK does.
    as_text = served.call("start_job", {"tool": "toy_add", "arguments": '{"a": 1, "b": 2}'})
    assert not as_text.is_error, as_text.text
    assert _status(served, "job_status", {"job_id": as_text.structured["job_id"], "wait_seconds": 10})["result"] == {
        "total": 3
    }
    nested = served.call("start_job", {"tool": "toy_add", "arguments": '{"a": "x"}'})
    assert nested.is_error and nested.text.startswith("toy_add: argument 'a': input should be a valid integer")
    # The job tools' own arguments: the toolkit's wording, no pydantic dump.
    bad = served.call("job_status", {"job_id": "job-1", "wait_seconds": -1, "zz": 0})
    assert bad.is_error and bad.text.splitlines() == [
        "job_status: argument 'zz': unknown (this tool takes job_id, wait_seconds)",
        "job_status: argument 'wait_seconds': input should be greater than or equal to 0",
    ]


def test_the_orchestrator_client_can_call_a_tool_as_a_job(served):
    seen: list[str] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        seen.append(message or "")

    ok = served.portal.call(served.client.call_as_job, "toy_slow", {"steps": 3, "pause": 0.5}, on_progress, 0.5)
    assert not ok.is_error and ok.structured == {"steps": 3} and ok.name == "toy_slow"
    assert seen[0] == "toy_slow: started" and any("toy steps" in m for m in seen)
    failed = served.portal.call(served.client.call_as_job, "toy_fail", {"name": "ghost"})
    assert failed.is_error and failed.text == "argument 'name': no model called 'ghost'"
    refused = served.portal.call(served.client.call_as_job, "toy_add", {"a": "x"})
    assert refused.is_error and refused.text.startswith("toy_add: argument 'a': ")


def test_the_plan_log_shows_each_phase_once_without_heartbeats_or_a_second_elapsed_time():
    import io

    from omskills.orchestrator.plan_runner import ToolCallDisplay

    stream = io.StringIO()
    display = ToolCallDisplay("[1/1] study", "profile_main_path", stream)
    # What the server sends, worded by the same module the display reads them with.
    sent = [
        (0.0, "profile_main_path: started"),
        (3.2, progress.phase_line("profile_main_path", "study run (1/2)", 3.2)),
        (5.3, progress.heartbeat_line("profile_main_path", 5.3, "study run")),
        (6.1, progress.phase_line("profile_main_path", "study run (1/2)", 6.1)),
        (7.4, progress.phase_line("profile_main_path", "study run (2/2)", 7.4)),
    ]

    async def replay() -> None:
        for done, message in sent:
            await display.on_progress(done, None, message)

    anyio.run(replay)
    assert stream.getvalue().splitlines() == [
        "[1/1] study: profile_main_path ...",
        "[1/1] study: [   0.0 s] profile_main_path: started",
        "[1/1] study: [   3.2 s] profile_main_path: study run (1/2)",
        "[1/1] study: [   7.4 s] profile_main_path: study run (2/2)",
    ]


def test_a_cancel_ends_the_child_process_a_tool_waits_for():
    from omskills.isolation import run_in_child

    flag = threading.Event()
    threading.Timer(1.0, flag.set).start()
    started = time.monotonic()
    with pytest.raises(progress.Cancelled), progress.cancellable(flag):
        run_in_child(time.sleep, 120)
    assert time.monotonic() - started < 20  # not the child's 120 s


def test_task_uris_serve_only_task_records_outside_hidden_folders(served):
    hidden = write_task_record(served.workspace / ".private" / "task.yaml")
    (served.workspace / "notes.yaml").write_text("just: notes\n")
    for uri, why in [
        ("task://.private/task.yaml", "hidden files are not served"),
        ("task://notes.yaml", "not a task record"),
    ]:
        with pytest.raises(MCPError, match=why):
            served.portal.call(served.client.session.read_resource, uri)
    assert hidden.is_file()  # refused for where it is, not for being missing


def test_call_as_job_asks_again_after_a_poll_that_timed_out(served, monkeypatch):
    real_call = served.client.call
    timeouts = []

    async def call(name, arguments, on_progress=None):
        if name == "job_status" and not timeouts:
            timeouts.append(name)
            raise MCPError(code=types.REQUEST_TIMEOUT, message="Request 'tools/call' timed out")
        return await real_call(name, arguments, on_progress)

    monkeypatch.setattr(served.client, "call", call)
    outcome = served.portal.call(served.client.call_as_job, "toy_slow", {"steps": 2, "pause": 0.3}, None, 0.2)
    assert timeouts and not outcome.is_error and outcome.structured == {"steps": 2}
