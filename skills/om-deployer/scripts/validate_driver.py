"""Tool: try a task's driver once at tiny size and list what is missing."""

from __future__ import annotations

from pathlib import Path

from omskills.host.toolkit import TaskPath, tool_hints
from omskills.records.results import DriverCheck


@tool_hints(title="Validate the model driver", read_only=True, long_running=True)
def validate_driver(task: TaskPath) -> DriverCheck:
    """Run the task record's driver once at scale tiny and report every problem found (ok is false
    when there is one). Writes nothing.

    Checks that the driver is found, intake.inputs and intake.verification parse, the model builds,
    the inputs load, the main path runs and returns outputs, the comparison names outputs that
    exist, and the seed candidates (the driver's, or the heaviest subtrees of the profile) are
    called with contracts a graph can take. Reports the outputs and the candidates with their share
    and exportability.
    """
    from omskills.stages.driver_check import check_driver

    return check_driver(Path(task))


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(validate_driver))
