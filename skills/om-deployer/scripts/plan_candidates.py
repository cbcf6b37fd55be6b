"""Tool: rank the candidates and choose the first batch."""

from __future__ import annotations

from pathlib import Path

from omskills.host.toolkit import TaskPath, tool_hints
from omskills.records.plan import Plan


@tool_hints(title="Plan the candidates", read_only=False, idempotent=True)
def plan_candidates(task: TaskPath) -> Plan:
    """Rank the candidates (compute share x boundary clarity x state dependence) and choose the
    first batch. Needs profile_main_path first.

    Records each candidate's status and reason in the task record and writes
    plan/inventory_report.md with a compute-share bar chart. A rerun on the same study reuses the
    stored plan."""
    from omskills.stages.plan import plan_candidates as _plan

    return _plan(Path(task))


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(plan_candidates))
