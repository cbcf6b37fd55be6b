"""The deterministic plan over MCP: a server that dies mid-call gives a readable stop, not a traceback."""

from __future__ import annotations

import asyncio
from pathlib import Path

from omskills.orchestrator.plan_runner import PlanStep, run_plan

KILLER = '''import os


def die_now(x: int = 1) -> int:
    """Exit the server process at once, as the kernel's OOM killer would."""
    os._exit(9)
'''


def test_a_server_killed_during_a_tool_stops_the_plan_with_a_resume_hint(tmp_path: Path):
    scripts = tmp_path / "skills" / "killer" / "scripts"
    scripts.mkdir(parents=True)
    (scripts / "die_now.py").write_text(KILLER)
    steps = [PlanStep(tool="die_now", stage="s", label="dies"), PlanStep(tool="die_now", stage="s", label="never runs")]
    result = asyncio.run(run_plan(steps, workspace=tmp_path, skills_dir=tmp_path / "skills"))
    assert not result.ok
    assert "tool server stopped during die_now" in (result.error or "") and "rerun to resume" in (result.error or "")
    assert [s.label for s in result.skipped] == ["never runs"]


HALF_DONE = '''from omskills.records.results import CandidateBatch, CandidateFailure


def half_done(x: int = 1) -> CandidateBatch:
    """A per-graph step whose second graph failed while the first went on."""
    return CandidateBatch(results={}, failed=[CandidateFailure(candidate="encoder", error="emulation failed: Resize")])
'''


def test_a_step_that_failed_for_one_graph_is_not_shown_as_ok(tmp_path: Path):
    import io

    scripts = tmp_path / "skills" / "half" / "scripts"
    scripts.mkdir(parents=True)
    (scripts / "half_done.py").write_text(HALF_DONE)
    shown = io.StringIO()
    result = asyncio.run(
        run_plan(
            [PlanStep(tool="half_done", stage="s", label="precision")],
            workspace=tmp_path,
            skills_dir=tmp_path / "skills",
            stream=shown,
        )
    )
    assert result.ok  # the plan goes on: the other graphs are fine
    lines = shown.getvalue().splitlines()
    assert lines[-2].startswith("[1/1] precision: ok, 1 graph(s) FAILED in ")
    assert lines[-1] == "[1/1] precision:   encoder failed: emulation failed: Resize"
