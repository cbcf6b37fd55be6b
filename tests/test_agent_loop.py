"""The Claude tool-use loop, against a local fake Messages API and a real `omskills serve`.

The fake API returns scripted turns; the real Anthropic SDK sends the requests, the real
MCP client runs the tools on toy skills, and the real task record takes the decisions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from anthropic import AsyncAnthropic
from fake_anthropic import calls, done, fake_anthropic, message, tool_use
from mcp_helpers import write_task_record, write_toy_skill
from omskills.orchestrator.agent import AgentSettings, chat, run_agent
from omskills.records.task import load_record

ENTRY_SKILL_MD = """\
---
name: om-deployer
description: Entry skill of the test library.
---

# om-deployer (test)

Step one: call toy_stage on the task. The gate phrase is PURPLE-GIRAFFE.
"""


@pytest.fixture()
def world(tmp_path: Path) -> dict[str, Path]:
    skills = tmp_path / "skills"
    write_toy_skill(skills)
    (skills / "om-deployer").mkdir()
    (skills / "om-deployer" / "SKILL.md").write_text(ENTRY_SKILL_MD)
    workspace = tmp_path / "ws"
    task = write_task_record(workspace / "toy" / "task.yaml")
    return {"skills": skills, "workspace": workspace, "task": task}


def _llm(api) -> AsyncAnthropic:
    return AsyncAnthropic(api_key="test-key", base_url=api.base_url, max_retries=0)


def _run(world: dict[str, Path], api, **settings) -> object:
    async def go():
        return await run_agent(
            world["task"],
            "adapt the toy model",
            settings=AgentSettings(model="claude-fake", **settings),
            workspace=world["workspace"],
            skills_dir=world["skills"],
            llm=_llm(api),
            on_text=lambda text: None,
        )

    return anyio.run(go)


def _tool_results(request: dict) -> list[dict]:
    last = request["messages"][-1]
    assert last["role"] == "user"
    return [block for block in last["content"] if block["type"] == "tool_result"]


def test_scripted_session_runs_tools_in_order_handles_an_error_and_files_the_run(world):
    script = [
        calls(tool_use("toy_stage", {"task": str(world["task"])})),
        calls(tool_use("load_skill", {"skill": "toy-skill"}), tool_use("toy_fail", {"name": "ghost"})),
        calls(tool_use("load_skill", {"skill": "toy-skill", "reference": "toy.md"}),
              tool_use("record_decision", {"what": "skip ghost", "why": "toy_fail said no model called 'ghost'"})),
        done("SUMMARY: toy_stage done; ghost skipped."),
    ]
    with fake_anthropic(script) as api:
        result = _run(world, api)

    assert result.stop == "end_turn"
    assert result.final_text == "SUMMARY: toy_stage done; ghost skipped."
    assert [c.name for c in result.tool_calls] == ["toy_stage", "load_skill", "toy_fail", "load_skill", "record_decision"]

    # The system prompt is the entry skill; every MCP tool and the local tools were offered.
    first = api.requests[0]
    assert "PURPLE-GIRAFFE" in first["system"]
    offered = {t["name"] for t in first["tools"]}
    assert {"toy_add", "toy_slow", "toy_stage", "toy_fail", "toy_crash", "toy_write", "load_skill", "record_decision"} <= offered
    assert all(set(t) == {"name", "description", "input_schema"} for t in first["tools"])

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
    assert result.transcript_path.is_relative_to(world["task"].parent)
    assert len(transcript["messages"]) == 8  # user goal + 4 assistant turns + 3 tool-result turns
    assert [c["is_error"] for c in transcript["tool_calls"]] == [False, False, True, False, False]
    assert all(c["seconds"] >= 0 and "arguments" in c for c in transcript["tool_calls"])
    assert transcript["usage"] == {"input_tokens": 400, "output_tokens": 80}

    # The task record shows the stage the tool ran, the agent's decision, and the run itself.
    record = load_record(world["task"])
    assert record.stages["toy_stage"].status == "done"
    assert record.stages["agent"].status == "done"
    assert record.stages["agent"].artifacts[0].path == str(result.transcript_path)
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
    record = load_record(world["task"])
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
    with fake_anthropic(script) as api:
        result = _run(world, api)
    crash, unknown = _tool_results(api.requests[1])
    assert crash["is_error"] and "RuntimeError: boom at 7" in crash["content"]
    assert unknown["is_error"] and "unknown tool 'no_such_tool'" in unknown["content"]
    (added,) = _tool_results(api.requests[2])
    assert json.loads(added["content"]) == {"total": 3}  # the server kept serving
    assert result.stop == "end_turn"


def test_chat_keeps_the_conversation_across_lines(world, tmp_path):
    script = [done("hello"), calls(tool_use("toy_add", {"a": 4, "b": 4})), done("eight")]
    lines = tmp_path / "stdin.txt"
    lines.write_text("hi\nadd four and four\nexit\n")
    out = tmp_path / "stdout.txt"
    with fake_anthropic(script) as api, lines.open() as stdin, out.open("w") as stdout:
        transcript = anyio.run(
            lambda: chat(world["task"], workspace=world["workspace"], skills_dir=world["skills"],
                         settings=AgentSettings(model="claude-fake"), llm=_llm(api), stdin=stdin, stdout=stdout)
        )
    shown = out.read_text()
    assert "claude> hello" in shown and "claude> eight" in shown
    # The second question was sent with the first exchange as context.
    assert [m["role"] for m in api.requests[1]["messages"]] == ["user", "assistant", "user"]
    saved = json.loads(transcript.read_text())
    assert [c["name"] for c in saved["tool_calls"]] == ["toy_add"]


def test_without_an_api_key_the_cli_says_so_in_one_line(world):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC_")}
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from omskills.orchestrator.cli import main; sys.exit(main())",
         "chat", "--task", str(world["task"]), "--workspace", str(world["workspace"])],
        env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "omskills: error: ANTHROPIC_API_KEY is not set: export it (and ANTHROPIC_BASE_URL for a proxy), or use `--agent plan`"
    ]
