"""`omskills serve` seen from real MCP clients (the SDK's stdio and streamable-HTTP clients).

One server on toy skills serves the module (started once, through a blocking portal);
the real skills' listing and the HTTP transport get servers of their own.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from mcp_helpers import TOY_SKILL, toy_tool_names, write_task_record, write_toy_skill
from omskills.errors import InputError
from omskills.host.mcp_server import is_path_parameter, parse_http_address
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
    assert sorted(by_name) == toy_tool_names()
    add = by_name["toy_add"]
    assert add.description.startswith(f"[skill: {TOY_SKILL}] Add a and b.")
    assert add.meta["omskills/skill"] == TOY_SKILL
    assert add.input_schema["properties"]["a"]["type"] == "integer"
    assert add.input_schema["required"] == ["a"]
    # The pydantic return type is published as the output schema.
    assert add.output_schema["properties"]["total"]["type"] == "integer"


def test_a_call_returns_structured_content(served):
    outcome = served.call("toy_add", {"a": 2, "b": 3})
    assert not outcome.is_error
    assert outcome.structured == {"total": 5}


def test_bad_arguments_come_back_as_a_readable_error(served):
    outcome = served.call("toy_add", {"a": "two"})
    assert outcome.is_error
    assert "toy_add" in outcome.text and "a\n" in outcome.text and "valid integer" in outcome.text


def test_an_omskills_error_reaches_the_client_with_its_message(served):
    outcome = served.call("toy_fail", {"name": "ghost"})
    assert outcome.is_error
    assert outcome.text.endswith("argument 'name': no model called 'ghost'")


def test_the_server_survives_a_crashing_tool_and_keeps_serving(served):
    crash = served.call("toy_crash", {"x": 3})
    assert crash.is_error and crash.text.endswith("RuntimeError: boom at 3")
    assert served.call("toy_add", {"a": 1}).structured == {"total": 2}


def test_progress_notifications_arrive_during_a_long_tool(served):
    seen: list[tuple[float, float | None, str | None]] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        seen.append((done, total, message))

    outcome = served.call("toy_slow", {"steps": 5, "pause": 0.02}, on_progress)
    assert outcome.structured == {"steps": 5}
    assert [done for done, _, _ in seen] == [0, 1, 2, 3, 4, 5]
    assert {total for _, total, _ in seen} == {5}
    assert seen[-1][2] == "toy steps: done"


def test_paths_inside_the_workspace_are_resolved_against_it(served):
    outcome = served.call("toy_write", {"out": "made/here.txt", "text": "hi"})
    assert not outcome.is_error
    assert outcome.structured["out"] == str(served.workspace / "made" / "here.txt")
    assert (served.workspace / "made" / "here.txt").read_text() == "hi"


@pytest.mark.parametrize("where", ["../escaped.txt", "/tmp/omskills-escaped.txt", "~/omskills-escaped.txt"])
def test_a_path_outside_the_workspace_is_refused(served, where):
    outcome = served.call("toy_write", {"out": where, "text": "no"})
    assert outcome.is_error
    assert f"argument 'out': path {where!r} is outside the workspace" in outcome.text
    assert not Path(where).expanduser().exists() and not (served.workspace.parent / "escaped.txt").exists()


def test_a_symlink_out_of_the_workspace_is_refused(served):
    link = served.workspace / "link-out"
    link.symlink_to(served.outside.parent, target_is_directory=True)
    outcome = served.call("toy_write", {"out": "link-out/x.txt", "text": "no"})
    assert outcome.is_error and "outside the workspace" in outcome.text
    assert not (served.outside.parent / "x.txt").exists()


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
    for noise in ("import-time noise", "import-time fd noise", "python-level noise", "fd-level noise", "child-process noise"):
        assert noise in log


def test_skill_documents_and_task_records_are_resources(served):
    uris = {r.uri for r in served.portal.call(served.client.list_resources)}
    assert {f"skill://{TOY_SKILL}/SKILL.md", f"skill://{TOY_SKILL}/references/toy.md", "task://rec/task.yaml"} <= uris
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


def test_streamable_http_lists_and_calls_tools(tmp_path):
    skills = tmp_path / "skills"
    write_toy_skill(skills)
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys; from omskills.orchestrator.cli import main; sys.exit(main())",
         "serve", "--http", f"127.0.0.1:{port}", "--workspace", str(tmp_path), "--skills-dir", str(skills)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        names, outcome = anyio.run(_list_and_call_over_http, f"http://127.0.0.1:{port}/mcp", time.monotonic() + 90)
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert sorted(names) == toy_tool_names()
    assert outcome.structured == {"total": 42}


def test_every_tool_file_of_the_real_skills_is_listed():
    """Whatever stage tools exist right now, the server lists exactly those (no hand-kept list)."""
    expected = {(path.parent.parent.name, path.stem) for path in tool_files(skills_root())}

    async def listed() -> set[tuple[str, str]]:
        async with connect(skills_root().parent) as client:
            return {(t.skill, t.name) for t in await client.list_tools()}

    assert anyio.run(listed) == expected
