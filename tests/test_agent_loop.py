"""The Claude tool-use loop, against a local fake Messages API and a real `omskills serve`.

The fake API returns scripted turns (answers, and errors: 529s, a 400); the real Anthropic
SDK sends the requests, the real MCP client runs the tools on toy skills (one server for
the module, started once through a blocking portal), and the real task record takes the
decisions.
"""

from __future__ import annotations

import functools
import io
import itertools
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import anyio
import pytest
from anthropic import AsyncAnthropic
from anyio.from_thread import BlockingPortal, start_blocking_portal
from fake_anthropic import HttpError, calls, done, fake_anthropic, message, overloaded, tool_use
from mcp_helpers import write_task_record, write_tool, write_toy_skill
from omskills.orchestrator.agent import AgentResult, AgentSettings, chat, run_agent
from omskills.orchestrator.mcp_client import OmskillsClient, connect
from omskills.orchestrator.messages_api import ApiFailure, RetryNotice, RetryPolicy, create_message
from omskills.orchestrator.tool_results import ResultPager
from omskills.records.task import load_record

# Retries in milliseconds, not minutes: the policy is the same, only the clock is short.
FAST_RETRY = RetryPolicy(total_seconds=5, first_wait=0.01, max_wait=0.05)

ENTRY_SKILL_MD = """\
---
name: om-deployer
description: Entry skill of the test library.
---

# om-deployer (test)

Step one: call toy_stage on the task. The gate phrase is PURPLE-GIRAFFE.
"""

_INVENTORY_TOOL = '''
    """An inventory as large as a real package's: hundreds of entries."""

    from pydantic import BaseModel

    from omskills.host.toolkit import tool_hints


    class Entry(BaseModel):
        qualname: str
        file: str
        line: int
        calls: list[str]


    class Inventory(BaseModel):
        package: str
        entries: list[Entry]


    @tool_hints(title="Toy inventory", read_only=True)
    def toy_inventory(count: int = 400) -> Inventory:
        """List `count` made-up entry points."""
        return Inventory(package="toy", entries=[
            Entry(qualname=f"toy.models.block_{i}.Block{i}.forward", file=f"toy/models/block_{i}.py", line=10 + i,
                  calls=[f"toy.ops.op_{i}_{j}" for j in range(4)]) for i in range(count)])
    '''


@dataclass
class World:
    """One test's task record, in the workspace of the module's one `omskills serve`."""

    portal: BlockingPortal
    client: OmskillsClient
    workspace: Path
    task: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent")
    skills = root / "skills"
    write_toy_skill(skills)
    write_tool(skills / "toy-skill", "toy_inventory", _INVENTORY_TOOL)
    (skills / "om-deployer").mkdir()
    (skills / "om-deployer" / "SKILL.md").write_text(ENTRY_SKILL_MD)
    workspace = root / "ws"
    workspace.mkdir()
    with (root / "server.stderr").open("w") as errlog, start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(connect(workspace, skills, errlog=errlog)) as client:
            yield portal, client, workspace.resolve()


_worlds = itertools.count()


@pytest.fixture()
def world(served) -> World:
    portal, client, workspace = served
    return World(
        portal, client, workspace, write_task_record(workspace / f"toy{next(_worlds)}" / "task.yaml").resolve()
    )


def _llm(api) -> AsyncAnthropic:
    return AsyncAnthropic(api_key="test-key", base_url=api.base_url, max_retries=0)


def _run(world: World, api, progress: io.StringIO | None = None, **settings) -> AgentResult:
    return world.portal.call(
        functools.partial(
            run_agent,
            world.task,
            "adapt the toy model",
            settings=AgentSettings(model="claude-fake", **({"api_retry": FAST_RETRY} | settings)),
            workspace=world.workspace,
            client=world.client,
            llm=_llm(api),
            on_text=lambda text: None,
            progress_stream=progress or io.StringIO(),
        )
    )


def _chat(world: World, api, stdin: TextIO, stdout: TextIO) -> Path:
    return world.portal.call(
        functools.partial(
            chat,
            world.task,
            workspace=world.workspace,
            settings=AgentSettings(model="claude-fake", api_retry=FAST_RETRY),
            llm=_llm(api),
            stdin=stdin,
            stdout=stdout,
            progress_stream=io.StringIO(),
            client=world.client,
        )
    )


def _chat_typing(world: World, script: list, typed: str, folder: Path):
    """`omskills chat` fed the lines `typed` against a fake API answering `script`:
    (the fake's received requests, the transcript path, what the chat showed)."""
    lines, out = folder / "stdin.txt", folder / "stdout.txt"
    lines.write_text(typed)
    with fake_anthropic(script) as api, lines.open() as stdin, out.open("w") as stdout:
        transcript = _chat(world, api, stdin, stdout)
    return api, transcript, out.read_text()


def _tool_results(request: dict) -> list[dict]:
    last = request["messages"][-1]
    assert last["role"] == "user"
    return [block for block in last["content"] if block["type"] == "tool_result"]


def test_scripted_session_runs_tools_in_order_handles_an_error_and_files_the_run(world):
    script = [
        calls(tool_use("toy_stage", {"task": str(world.task)})),
        calls(tool_use("load_skill", {"skill": "toy-skill"}), tool_use("toy_fail", {"name": "ghost"})),
        calls(
            tool_use("load_skill", {"skill": "toy-skill", "reference": "toy.md"}),
            tool_use("record_decision", {"what": "skip ghost", "why": "toy_fail said no model called 'ghost'"}),
        ),
        done("SUMMARY: toy_stage done; ghost skipped."),
    ]
    progress = io.StringIO()
    with fake_anthropic(script) as api:
        result = _run(world, api, progress)

    assert result.stop == "end_turn"
    assert result.final_text == "SUMMARY: toy_stage done; ghost skipped."
    assert [c.name for c in result.tool_calls] == [
        "toy_stage",
        "load_skill",
        "toy_fail",
        "load_skill",
        "record_decision",
    ]

    # The system prompt is the entry skill; every MCP tool and the local tools were offered.
    first = api.requests[0]
    assert "PURPLE-GIRAFFE" in first["system"][0]["text"]
    offered = {t["name"] for t in first["tools"]}
    assert {
        "toy_add",
        "toy_slow",
        "toy_stage",
        "toy_fail",
        "toy_crash",
        "toy_write",
        "load_skill",
        "record_decision",
        "read_tool_result",
    } <= offered
    assert all(set(t) == {"name", "description", "input_schema"} for t in first["tools"][:-1])

    # Turn 2 got toy_stage's structured result; turn 3 got the SKILL.md and toy_fail's error.
    (stage_result,) = _tool_results(api.requests[1])
    assert not stage_result["is_error"] and json.loads(stage_result["content"]) == {"stage": "toy_stage"}
    skill_md, failure = _tool_results(api.requests[2])
    assert "Toy tools for testing" in skill_md["content"] and not skill_md["is_error"]
    assert failure["is_error"] and "no model called 'ghost'" in failure["content"]
    reference, recorded = _tool_results(api.requests[3])
    assert "Loaded on demand" in reference["content"]
    assert recorded["content"] == "recorded"

    # The transcript holds the messages and every call with args, result, error flag, duration.
    transcript = json.loads(result.transcript_path.read_text())
    assert result.transcript_path.is_relative_to(world.task.parent)
    assert len(transcript["messages"]) == 8  # user goal + 4 assistant turns + 3 tool-result turns
    assert [c["is_error"] for c in transcript["tool_calls"]] == [False, False, True, False, False]
    assert all(c["seconds"] >= 0 and "arguments" in c for c in transcript["tool_calls"])
    assert transcript["usage"] == {
        "input_tokens": 400,
        "output_tokens": 80,
        "cache_read_input_tokens": 0,
        "cache_creation_input_tokens": 0,
    }
    assert transcript["stop"] == "end_turn" and transcript["error"] is None

    # The human saw every call as it happened, the local ones and the failed one included.
    shown = progress.getvalue().splitlines()
    assert any(line.startswith("[turn 1] toy_stage: ok") for line in shown)
    assert any(line.startswith('[turn 2] load_skill {"skill": "toy-skill"}: ok') for line in shown)
    assert any(line.startswith("[turn 2] toy_fail: FAILED") and "no model called 'ghost'" in line for line in shown)
    assert any(
        line.startswith('[turn 3] load_skill {"skill": "toy-skill", "reference": "toy.md"}: ok') for line in shown
    )
    assert any(
        line.startswith('[turn 3] record_decision {"what": "skip ghost"') and line.endswith("s") for line in shown
    )

    # The task record shows the stage the tool ran, the agent's decision, and the run itself.
    record = load_record(world.task)
    assert record.stages["toy_stage"].status == "done"
    assert record.stages["agent"].status == "done"
    # Stored relative to the run folder (the record's folder), so a moved run still finds it.
    stored = record.stages["agent"].artifacts[0].path
    assert not Path(stored).is_absolute() and (world.task.parent / stored).resolve() == result.transcript_path.resolve()
    whats = [(d.by, d.what) for d in record.decisions]
    assert ("agent", "skip ghost") in whats
    summary = record.decisions[-1]
    assert summary.by == "agent" and summary.why == "SUMMARY: toy_stage done; ghost skipped."


def test_turn_limit_stops_a_model_that_never_ends(world):
    forever = lambda i: calls(tool_use("toy_add", {"a": i}))  # noqa: E731
    with fake_anthropic(forever) as api:
        result = _run(world, api, max_turns=3)
    assert result.stop == "max_turns"
    assert len(api.requests) == 3
    assert [c.name for c in result.tool_calls] == ["toy_add"] * 3
    record = load_record(world.task)
    assert record.stages["agent"].status == "failed"
    assert record.stages["agent"].error == "stopped: max_turns"


def test_token_budget_stops_the_loop(world):
    heavy = lambda i: message(tool_use("toy_add", {"a": 1}), "tool_use", usage=(6_000, 500))  # noqa: E731
    with fake_anthropic(heavy) as api:
        result = _run(world, api, max_tokens=10_000)
    # 6.5k after the first turn, 13k after the second: no third request.
    assert result.stop == "token_budget"
    assert len(api.requests) == 2
    # The per-request output cap never exceeds what is left of the budget.
    assert api.requests[1]["max_tokens"] == 10_000 - 6_500


def test_crashing_tool_and_unknown_tool_reach_the_model_as_errors(world):
    script = [
        calls(tool_use("toy_crash", {"x": 7}), tool_use("no_such_tool", {})),
        calls(tool_use("toy_add", {"a": 1, "b": 2})),
        done("ok"),
    ]
    progress = io.StringIO()
    with fake_anthropic(script) as api:
        result = _run(world, api, progress)
    crash, unknown = _tool_results(api.requests[1])
    assert crash["is_error"] and "RuntimeError: boom at 7" in crash["content"]
    assert unknown["is_error"] and "unknown tool 'no_such_tool'" in unknown["content"]
    (added,) = _tool_results(api.requests[2])
    assert json.loads(added["content"]) == {"total": 3}  # the server kept serving
    assert result.stop == "end_turn"
    shown = progress.getvalue()
    assert (
        "[turn 1] toy_crash: FAILED" in shown
        and "[turn 1] no_such_tool {}: FAILED — unknown tool 'no_such_tool'" in shown
    )


def _chat_env(base_url: str, skills: Path) -> dict[str, str]:
    """The environment of an `omskills chat` against the fake API, with the toy skill."""
    return {
        **os.environ,
        "ANTHROPIC_API_KEY": "test-key",
        "ANTHROPIC_BASE_URL": base_url,
        "OMSKILLS_SKILLS_DIR": str(skills),
    }


def test_chat_keeps_the_conversation_across_lines(world, tmp_path):
    script = [done("hello"), calls(tool_use("toy_add", {"a": 4, "b": 4})), done("eight")]
    api, transcript, shown = _chat_typing(world, script, "hi\nadd four and four\nexit\n", tmp_path)
    assert "claude> hello" in shown and "claude> eight" in shown
    # The second question was sent with the first exchange as context.
    assert [m["role"] for m in api.requests[1]["messages"]] == ["user", "assistant", "user"]
    saved = json.loads(transcript.read_text())
    assert [c["name"] for c in saved["tool_calls"]] == ["toy_add"]


def test_without_an_api_key_the_cli_says_so_in_one_line(world):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC_")}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from omskills.orchestrator.cli import main; sys.exit(main())",
            "chat",
            "--task",
            str(world.task),
            "--workspace",
            str(world.workspace),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "omskills: error: ANTHROPIC_API_KEY is not set: "
        "export it (and ANTHROPIC_BASE_URL for a proxy), or use `--agent plan`"
    ]


# --------------------------------------------------------------------------- an API that misbehaves


def _retry_lines(progress: io.StringIO) -> list[str]:
    return [line for line in progress.getvalue().splitlines() if line.startswith("Anthropic API ")]


def test_overloaded_api_is_retried_with_backoff_until_it_answers(world):
    script = [
        overloaded(),
        overloaded(),
        overloaded(**{"retry-after-ms": "300"}),
        overloaded(),
        calls(tool_use("toy_stage", {"task": str(world.task)})),
        done("SUMMARY: staged."),
    ]
    progress = io.StringIO()
    with fake_anthropic(script) as api:
        result = _run(world, api, progress)

    assert result.stop == "end_turn" and result.final_text == "SUMMARY: staged."
    # Each retry resent the same request; the SDK itself retried nothing (six requests for six answers).
    assert len(api.requests) == 6
    assert api.requests[0] == api.requests[3] == api.requests[4]
    lines = _retry_lines(progress)
    assert len(lines) == 4
    assert all("529 overloaded_error: Overloaded" in line and "giving up after 5s" in line for line in lines)
    assert [line.split("retry ")[1].split(" ")[0] for line in lines] == ["1", "2", "3", "4"]
    # The third wait is the server's retry-after (0.3 s), longer than the backoff's 0.05 s cap.
    assert "in 0.3s (retry-after)" in lines[2] and "retry-after" not in lines[0]

    transcript = json.loads(result.transcript_path.read_text())
    assert transcript["stop"] == "end_turn" and transcript["error"] is None
    assert [m["role"] for m in transcript["messages"]] == ["user", "assistant", "user", "assistant"]
    assert [c["name"] for c in transcript["tool_calls"]] == ["toy_stage"]
    assert [(e["kind"], e["turn"]) for e in transcript["events"]] == [("retry", 1)] * 4
    assert load_record(world.task).stages["agent"].status == "done"


def test_an_api_that_stays_overloaded_stops_the_run_with_the_status(world):
    progress = io.StringIO()
    with fake_anthropic(lambda i: overloaded()) as api:
        result = _run(world, api, progress, api_retry=RetryPolicy(total_seconds=0.3, first_wait=0.02, max_wait=0.1))
    assert result.stop == "api_error_529"
    assert "529 overloaded_error" in result.error and "Overloaded" in result.error
    assert 2 <= len(api.requests) <= 16 and len(_retry_lines(progress)) == len(api.requests) - 1
    record = load_record(world.task)
    assert record.stages["agent"].status == "failed"
    assert record.stages["agent"].error.startswith("stopped: api_error_529: Anthropic API error 529")


class _FakeClock:
    """Time that passes only while the retry loop sleeps: a 45 s schedule runs in milliseconds."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _retried_until_failure(policy: RetryPolicy, script, clock: _FakeClock):
    """One request through the real SDK to the fake API under `policy` on `clock`:
    (the retry notices, the failure it ended with, the requests the API received)."""
    notices: list[RetryNotice] = []
    request = {"model": "claude-fake", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    with fake_anthropic(script) as api:

        async def ask() -> None:
            await create_message(_llm(api), policy, notices.append, request, clock=clock, sleep=clock.sleep)

        with pytest.raises(ApiFailure) as failed:
            anyio.run(ask)
    return notices, failed.value, api.requests


def test_a_lasting_overload_is_retried_for_the_time_the_lines_announce_with_the_waits_they_announce():
    clock = _FakeClock()
    policy = RetryPolicy(total_seconds=45)  # the default backoff: 2 s doubling, plus up to 2 s of jitter
    notices, failure, requests = _retried_until_failure(policy, lambda i: overloaded(), clock)

    lines = [notice.line(policy) for notice in notices]
    assert all(line.endswith("giving up after 45s") for line in lines), lines
    # The waits announced are the waits taken, and together they are the 45 s announced.
    assert [notice.wait for notice in notices] == clock.slept
    assert sum(clock.slept) == pytest.approx(45.0)
    # 2-4, 4-6, 8-10 and 16-18 s; the fifth backoff (32 s or more) is cut to the 7-15 s left, and says so.
    assert len(notices) == 5 and len(requests) == 6
    assert [notice.last for notice in notices] == [False, False, False, False, True]
    assert ", the last; giving up after 45s" in lines[-1]
    assert failure.stop == "api_error_529" and "(after retrying for 45s)" in failure.message


def test_a_retry_after_longer_than_the_time_left_ends_the_retries_and_says_why():
    clock = _FakeClock()
    notices, failure, requests = _retried_until_failure(
        RetryPolicy(total_seconds=45), lambda i: overloaded(**{"retry-after": "30"}), clock
    )
    # The first wait is the server's 30 s; after it 15 s are left, too few for the next 30 s.
    assert [(n.wait, n.server_asked) for n in notices] == [(30.0, True)] and len(requests) == 2
    assert clock.slept == [30.0]
    assert "(after retrying for 30s) (the server asked to wait 30s more, past the retry time)" in failure.message


def test_a_400_mid_run_stops_honestly_and_leaves_the_record_consistent(world):
    refusal = HttpError(400, "invalid_request_error", "messages.2.content.0: tool_result block is malformed")
    script = [
        calls(tool_use("toy_stage", {"task": str(world.task)}), tool_use("load_skill", {"skill": "toy-skill"})),
        refusal,
    ]
    with fake_anthropic(script) as api:
        result = _run(world, api)

    assert result.stop == "api_error_400"
    assert "400 invalid_request_error" in result.error and "tool_result block is malformed" in result.error
    assert len(api.requests) == 2  # a 400 is not retried

    # The transcript says what happened: the calls before the error, the request the API refused, the error.
    transcript = json.loads(result.transcript_path.read_text())
    assert transcript["stop"] == "api_error_400" and transcript["finished"]
    assert "tool_result block is malformed" in transcript["error"]
    assert [m["role"] for m in transcript["messages"]] == ["user", "assistant", "user"]
    assert [b["type"] for b in transcript["messages"][2]["content"]] == ["tool_result", "tool_result"]
    assert [c["name"] for c in transcript["tool_calls"]] == ["toy_stage", "load_skill"]
    assert transcript["events"][-1]["kind"] == "api_error" and transcript["events"][-1]["turn"] == 2

    # The record loads; the tool's stage is done, the agent step failed with the API's error.
    record = load_record(world.task)
    assert record.stages["toy_stage"].status == "done"
    agent = record.stages["agent"]
    assert agent.status == "failed"
    assert agent.error.startswith("stopped: api_error_400: Anthropic API error 400 invalid_request_error")
    assert "tool_result block is malformed" in agent.error
    assert not Path(agent.artifacts[0].path).is_absolute()
    assert (world.task.parent / agent.artifacts[0].path).resolve() == result.transcript_path.resolve()
    assert "ended (api_error_400)" in record.decisions[-1].what and "the API failed" in record.decisions[-1].why


def test_chat_survives_a_400_and_the_user_can_type_again(world, tmp_path):
    script = [HttpError(400, "invalid_request_error", "prompt is malformed"), done("back again")]
    api, transcript, shown = _chat_typing(world, script, "hi\nhello again\nexit\n", tmp_path)
    assert "(stopped: api_error_400: Anthropic API error 400 invalid_request_error" in shown and "type again" in shown
    assert "claude> back again" in shown
    # The refused line stays in the conversation; the next one joins it in the same user turn.
    (second,) = api.requests[1]["messages"]
    assert second["role"] == "user" and [b["text"] for b in second["content"]] == ["hi", "hello again"]
    saved = json.loads(transcript.read_text())
    assert saved["stop"] == "end_turn" and saved["error"] is None
    assert [e["kind"] for e in saved["events"]] == ["api_error"]
    record = load_record(world.task)
    assert record.stages["agent"].status == "done"
    assert [d.what.split("(")[1].split(")")[0] for d in record.decisions if d.what.startswith("agent run")] == [
        "api_error_400",
        "end_turn",
    ]


# --------------------------------------------------------------------------- replies cut by max_tokens


def _text(text: str) -> list[dict]:
    return [{"type": "text", "text": text}]


def test_a_reply_cut_by_max_tokens_is_continued_and_merged(world):
    script = [message(_text("The plan has two "), "max_tokens"), done("parts: export, then ATC.")]
    with fake_anthropic(script) as api:
        result = _run(world, api)
    assert result.stop == "end_turn"
    assert result.final_text == "The plan has two parts: export, then ATC."
    cut, nudge = api.requests[1]["messages"][-2:]
    assert cut == {"role": "assistant", "content": [{"type": "text", "text": "The plan has two "}]}
    assert nudge["role"] == "user" and "continue exactly where it stopped" in nudge["content"][-1]["text"]
    assert load_record(world.task).decisions[-1].why == "The plan has two parts: export, then ATC."


def test_a_tool_call_cut_by_max_tokens_is_not_run(world):
    half_written = tool_use("toy_stage", {"task": str(world.task)}, text="Marking the stage.")
    script = [message(half_written, "max_tokens"), calls(tool_use("toy_add", {"a": 1})), done("ok")]
    progress = io.StringIO()
    with fake_anthropic(script) as api:
        result = _run(world, api, progress)
    assert result.stop == "end_turn"
    assert [c.name for c in result.tool_calls] == ["toy_add"]
    assert "toy_stage" not in load_record(world.task).stages  # the cut call never reached the server
    cut, nudge = api.requests[1]["messages"][-2:]
    assert cut["content"] == [{"type": "text", "text": "Marking the stage."}]  # no tool_use left without its result
    assert "inside a call to `toy_stage`" in nudge["content"][-1]["text"] and "not run" in nudge["content"][-1]["text"]
    assert "[turn 1] reply cut by the output limit (8192 tokens) inside `toy_stage`: not run" in progress.getvalue()


def test_continuations_are_bounded(world):
    with fake_anthropic(lambda i: message(_text(f"part {i} "), "max_tokens")) as api:
        result = _run(world, api, max_continuations=2)
    assert result.stop == "max_tokens"
    assert len(api.requests) == 3
    assert result.final_text == "part 0 part 1 part 2"
    assert load_record(world.task).stages["agent"].error == "stopped: max_tokens"


# --------------------------------------------------------------------------- prompt caching


def _cache_marks(request: dict) -> list[str]:
    marks = ["system" for b in request["system"] if "cache_control" in b]
    marks += [f"tool:{t['name']}" for t in request["tools"] if "cache_control" in t]
    for index, m in enumerate(request["messages"]):
        content = m["content"] if isinstance(m["content"], list) else []
        marks += [f"message:{index}" for b in content if "cache_control" in b]
    return marks


def test_system_tools_and_conversation_are_prompt_cached(world):
    script = [
        message(tool_use("toy_add", {"a": 1}), "tool_use", usage=(900, 30), cache=(0, 5_000)),
        message(tool_use("toy_add", {"a": 2}), "tool_use", usage=(50, 30), cache=(5_000, 900)),
        message(_text("done"), "end_turn", usage=(40, 10), cache=(5_900, 80)),
    ]
    with fake_anthropic(script) as api:
        result = _run(world, api)
    assert result.stop == "end_turn"
    ephemeral = {"type": "ephemeral"}
    first, second, third = api.requests
    assert first["system"][0]["cache_control"] == ephemeral
    last_tool = first["tools"][-1]["name"]
    # System, the last tool definition, and the latest user message(s): never more than the API's four.
    assert _cache_marks(first) == ["system", f"tool:{last_tool}", "message:0"]
    assert _cache_marks(second) == ["system", f"tool:{last_tool}", "message:0", "message:2"]
    assert _cache_marks(third) == ["system", f"tool:{last_tool}", "message:2", "message:4"]
    assert third["messages"][4]["content"][-1]["cache_control"] == ephemeral
    # The stored conversation carries no marks (they would pile up past four).
    transcript = json.loads(result.transcript_path.read_text())
    assert "cache_control" not in json.dumps(transcript["messages"])
    assert transcript["usage"] == {
        "input_tokens": 990,
        "output_tokens": 70,
        "cache_read_input_tokens": 10_900,
        "cache_creation_input_tokens": 5_980,
    }
    assert "cache read/written 10900/5980" in load_record(world.task).stages["agent"].note


# --------------------------------------------------------------------------- long tool results


def test_a_large_structured_result_is_outlined_as_json_and_paged_whole(world):
    limit = 30_000
    pages: list[dict] = []

    def read_next_page(request: dict) -> dict:
        (result,) = _tool_results(request)
        assert len(result["content"]) <= limit
        page = json.loads(result["content"])  # every page is valid JSON
        if "result_too_long" in page:  # the outline of the first call
            pages.append(page)
            return calls(
                tool_use("read_tool_result", {"call_id": page["result_too_long"]["call_id"], "path": "/entries"})
            )
        pages.append(page)
        if page["next_offset"] is None:
            return done("read it all")
        return calls(
            tool_use(
                "read_tool_result", {"call_id": page["call_id"], "path": "/entries", "offset": page["next_offset"]}
            )
        )

    script = [calls(tool_use("toy_inventory", {"count": 400})), *[read_next_page] * 12]
    progress = io.StringIO()
    with fake_anthropic(script) as api:
        result = _run(world, api, progress, max_tool_result_chars=limit)
    assert result.stop == "end_turn"

    full = json.loads(result.tool_calls[0].result)  # the transcript keeps the whole result
    assert len(result.tool_calls[0].result) > limit
    outline, *entry_pages = pages
    note = outline["result_too_long"]
    assert note["call_id"] == result.tool_calls[0].tool_use_id and note["chars"] == len(result.tool_calls[0].result)
    assert "read_tool_result" in note["how_to_read"] and "'/entries'" in note["how_to_read"]
    assert outline["outline"]["package"] == "toy"
    assert outline["outline"]["entries"]["list_length"] == 400
    assert outline["outline"]["entries"]["first_items"][0] == full["entries"][0]
    # Paged through, the entries come back whole and in order, none lost, none cut.
    assert len(entry_pages) >= 2
    assert [item for page in entry_pages for item in page["items"]] == full["entries"]
    assert entry_pages[1]["offset"] == len(entry_pages[0]["items"])
    assert progress.getvalue().count("] read_tool_result {") == len(entry_pages)


def test_a_long_text_result_is_paged_back_whole_and_a_wrong_path_is_named():
    pager = ResultPager(limit=1_000)
    log = "".join(f"step {i}: exported\n" for i in range(400))
    first = pager.fit("toolu_log", log)
    assert len(first) <= 1_000 and "read_tool_result(call_id='toolu_log', offset=" in first
    shown_upto = int(first.split("offset=")[1].rstrip(")]"))
    assert log.startswith(first[:shown_upto]) and first[:shown_upto].endswith("\n")  # cut at a line end
    text, offset = first[:shown_upto], shown_upto
    while offset is not None:
        page = pager.read({"call_id": "toolu_log", "offset": offset})
        assert not page.is_error and len(page.text) <= 1_000
        body = json.loads(page.text)
        text, offset = text + body["text"], body["next_offset"]
    assert text == log

    pager.fit("toolu_json", json.dumps({"entries": [{"name": f"e{i}"} for i in range(200)]}))
    missing = pager.read({"call_id": "toolu_json", "path": "/entries/200/name"})
    assert missing.is_error and "/entries has no '200'; it has a list of 200 items (0..199)" in missing.text
    assert pager.read({"call_id": "toolu_nope"}).is_error
    assert json.loads(pager.read({"call_id": "toolu_json", "path": "/entries/7"}).text)["value"] == {"name": "e7"}


def test_adapt_with_claude_prints_why_the_api_refused_in_the_line_it_stops_on(tmp_path):
    task = tmp_path / "task.yaml"
    task.write_text(
        json.dumps(
            {
                "id": "refused",
                "intake": {
                    "model": {"family": "sam3", "scale": "tiny"},
                    "inputs": {"video": "builtin:shapes", "prompt": "objects", "frames": 2},
                    "target": {"soc": "Ascend910B4"},
                },
            }
        )
    )
    with fake_anthropic([HttpError(400, "invalid_request_error", "prompt is too long: 250000 tokens > 200000")]) as api:
        env = {**os.environ, "ANTHROPIC_API_KEY": "test-key", "ANTHROPIC_BASE_URL": api.base_url}
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from omskills.orchestrator.cli import main; sys.exit(main())",
                "adapt",
                str(task),
                "--agent",
                "claude",
                "--out",
                str(tmp_path / "run"),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
            cwd=tmp_path,
        )
    assert proc.returncode == 1, proc.stderr[-2000:]
    [line] = [ln for ln in proc.stderr.splitlines() if ln.startswith("agent stopped:")]
    assert "api_error_400" in line and "prompt is too long: 250000 tokens > 200000" in line, line


def test_adapt_with_claude_keeps_the_servers_messages_in_a_log_and_the_terminal_for_progress(tmp_path):
    """The tool server's stderr (a tool's prints included, which stdio moves off stdout) goes to
    server.log in the run folder, named once; stderr carries the progress lines only."""
    skills, run = tmp_path / "skills", tmp_path / "run"
    write_toy_skill(skills)
    task = write_task_record(tmp_path / "task.yaml")
    script = [calls(tool_use("toy_write", {"out": str(run / "note.txt"), "text": "hi"})), done("SUMMARY: wrote it.")]
    with fake_anthropic(script) as api:
        env = _chat_env(api.base_url, skills)
        proc = subprocess.run(
            [sys.executable, "-c", _CLI, "adapt", str(task), "--agent", "claude", "--out", str(run)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
            cwd=tmp_path,
        )
    assert proc.returncode == 0, proc.stderr[-2000:]
    [named] = [line for line in proc.stderr.splitlines() if "server.log" in line]
    log = Path(named.removeprefix("the tool server's messages go to "))
    assert log.is_file() and log.resolve().is_relative_to(run.resolve()), named
    assert "noise" not in proc.stderr, proc.stderr
    logged = log.read_text()
    for noise in ("import-time noise", "python-level noise", "fd-level noise", "child-process noise"):
        assert noise in logged, logged
    assert "[turn 1] toy_write: ok in " in proc.stderr and (run / "note.txt").read_text() == "hi"


def _wait_for(predicate, seconds: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_chat_ctrl_c_cancels_the_running_tool_and_returns_to_the_prompt_and_at_the_prompt_quits(tmp_path):
    """`omskills chat` in a terminal: Ctrl-C while a tool runs cancels that tool (its step recorded
    as cancelled) and the chat goes on; the next question carries the cancelled call's result; Ctrl-C
    at the prompt quits at once. The server's messages go to a log file, not the terminal."""
    import signal
    import time

    skills, workspace = tmp_path / "skills", tmp_path / "ws"
    write_toy_skill(skills)
    task = write_task_record(workspace / "toy" / "task.yaml").resolve()
    script = [calls(tool_use("toy_stage", {"task": str(task), "seconds": 120})), done("fine, stopped.")]
    with fake_anthropic(script) as api:
        env = _chat_env(api.base_url, skills)
        out, err = (tmp_path / "stdout.txt").open("w+"), (tmp_path / "stderr.txt").open("w+")
        chat_process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from omskills.orchestrator.cli import main; sys.exit(main())",
                "chat",
                "--task",
                str(task),
                "--workspace",
                str(workspace),
            ],
            env=env,
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=err,
            text=True,
            cwd=tmp_path,
        )
        try:
            chat_process.stdin.write("stage it\n")
            chat_process.stdin.flush()
            _wait_for(
                lambda: (
                    load_record(task).stages.get("toy_stage") is not None
                    and load_record(task).stages["toy_stage"].status == "running"
                )
            )
            chat_process.send_signal(signal.SIGINT)
            _wait_for(lambda: "(cancelled; type again to go on)" in Path(out.name).read_text())
            chat_process.stdin.write("why?\n")
            chat_process.stdin.flush()
            _wait_for(lambda: "claude> fine, stopped." in Path(out.name).read_text())
            time.sleep(0.5)  # at the prompt again
            started = time.monotonic()
            chat_process.send_signal(signal.SIGINT)
            code = chat_process.wait(timeout=30)
            quit_seconds = time.monotonic() - started
        finally:
            if chat_process.poll() is None:
                chat_process.kill()
        shown = Path(out.name).read_text()

    assert code == 130 and quit_seconds < 10, shown
    stage = load_record(task).stages["toy_stage"]
    assert stage.status == "failed" and "cancelled" in (stage.error or ""), stage
    [answered] = _tool_results(api.requests[1])
    assert answered["is_error"] and "cancelled by the user" in answered["content"]
    assert "(quit; transcript" in shown
    [log] = list((workspace / "toy").glob("agent_runs/*-chat/server.log"))
    assert "server.log" in shown and log.stat().st_size > 0  # the server's messages are there, not in the terminal


# --------------------------------------------------------------------------- chat in a real terminal

# Make the pty the child's controlling terminal, as a shell does, so that Ctrl-C typed into it is
# the line discipline's SIGINT; then run the CLI.
_IN_TERMINAL = (
    "import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    "os.execv(sys.executable, [sys.executable, '-c', sys.argv[1], *sys.argv[2:]])"
)
_CLI = "import sys; from omskills.orchestrator.cli import main; sys.exit(main())"
_CSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")


def _screen(raw: bytes) -> list[str]:
    """The lines a terminal shows for `raw`: a carriage return goes back to the line's start, what
    follows overwrites it (escape sequences are dropped: the chat draws with none)."""
    lines, row, col = [[]], 0, 0
    for char in _CSI.sub(b"", raw).decode("utf-8", "replace"):
        if char == "\n":
            row, col = row + 1, 0
            if row == len(lines):
                lines.append([])
        elif char == "\r":
            col = 0
        else:
            line = lines[row]
            line.extend(" " * (col - len(line)))
            line[col : col + 1] = [char]
            col += 1
    return ["".join(line).rstrip() for line in lines]


class _Terminal:
    """A pty whose other end is the program under test: type into it, read what it shows."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path) -> None:
        import pty

        self.master, slave = pty.openpty()
        self.process = subprocess.Popen(
            [sys.executable, "-c", _IN_TERMINAL, _CLI, *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env={**env, "COLUMNS": "160", "LINES": "40", "TERM": "xterm"},
            cwd=cwd,
            start_new_session=True,  # a session of its own, whose controlling terminal the pty becomes
        )
        os.close(slave)
        self.raw = b""

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def wait_for(self, predicate, seconds: float = 120.0) -> list[str]:
        """Read until `predicate(screen lines)` holds; the screen then."""
        import select
        import time

        deadline = time.monotonic() + seconds
        while not predicate(_screen(self.raw)):
            assert time.monotonic() < deadline, "timed out; the screen:\n" + "\n".join(_screen(self.raw))
            if select.select([self.master], [], [], 0.1)[0]:
                try:
                    self.raw += os.read(self.master, 65536)
                except OSError:  # the program ended and closed the terminal
                    time.sleep(0.1)
        return _screen(self.raw)

    def settle(self, seconds: float) -> list[str]:
        """What the screen shows after `seconds` more of the program's output."""
        import time

        until = time.monotonic() + seconds
        return self.wait_for(lambda _: time.monotonic() >= until, seconds + 5)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)
        os.close(self.master)


def test_chat_in_a_terminal_shows_a_clean_status_line_and_keeps_its_prompt_after_a_cancel(tmp_path):
    """The status line of a running tool reads `[turn N] tool: elapsed phase`; Ctrl-C typed while it
    runs cancels the call, and the `you>` prompt that follows stays on the screen as the user types."""
    skills, workspace = tmp_path / "skills", tmp_path / "ws"
    write_toy_skill(skills)
    task = write_task_record(workspace / "toy" / "task.yaml").resolve()
    script = [calls(tool_use("toy_stage", {"task": str(task), "seconds": 120})), done("fine, stopped.")]
    with fake_anthropic(script) as api:
        env = _chat_env(api.base_url, skills)
        terminal = _Terminal(["chat", "--task", str(task), "--workspace", str(workspace)], env, tmp_path)
        try:
            terminal.wait_for(lambda screen: screen[-1] == "you>")
            terminal.type(b"stage it\r")
            working = terminal.wait_for(lambda screen: "toy work" in screen[-1])
            terminal.type(b"\x03")
            terminal.wait_for(lambda screen: screen[-2:] == ["(cancelled; type again to go on)", "you>"])
            after_cancel = terminal.settle(2.0)  # the cancelled call's leftovers have had time to draw
            terminal.type(b"exit\r")
            terminal.wait_for(lambda screen: terminal.process.poll() is not None)
            shown = terminal.settle(0.5)
        finally:
            terminal.close()

    assert re.fullmatch(r"\[turn 1\] toy_stage: \d\d:\d\d toy work \([\d.]+/120\)", working[-1]), working[-1]
    assert after_cancel[-1] == "you>", after_cancel[-3:]
    assert shown[shown.index("(cancelled; type again to go on)") + 1] == "you> exit", shown
    assert terminal.process.returncode == 0
