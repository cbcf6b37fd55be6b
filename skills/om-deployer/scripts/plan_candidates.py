"""Tool: rank the candidates and choose the first batch."""

from pathlib import Path

from omskills.host.toolkit import WorkspacePath
from omskills.records.plan import Plan
from omskills.stages.plan import plan_candidates as _plan


def plan_candidates(task: WorkspacePath) -> Plan:
    """Turn the profile and contracts into ranked candidates (compute share x boundary clarity x state
    dependence), choose the first batch, record each candidate's status and reason in the task record,
    and write plan/inventory_report.md with a compute-share bar chart. Needs profile_main_path first."""
    return _plan(Path(task))


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(plan_candidates))
