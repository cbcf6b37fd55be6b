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
