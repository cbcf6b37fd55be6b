"""Tool: try a task's driver once at tiny size and list what is missing."""

from pathlib import Path

from omskills.host.toolkit import WorkspacePath
from omskills.stages.driver_check import DriverCheck, check_driver


def validate_driver(task: WorkspacePath) -> DriverCheck:
    """Run the task record's driver once at scale tiny: the driver is found, intake.inputs and
    intake.verification parse, the model builds, the inputs load, the main path runs and returns
    outputs, the comparison names outputs that exist, and the seed candidates (the driver's, or the
    heaviest subtrees of the profile) are called with contracts a graph can take. Reports the
    outputs, the candidates with their share and exportability, and every problem found (ok is
    false when there is one). Writes nothing into the task record.

    task: path of the task record YAML.
    """
    return check_driver(Path(task))


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(validate_driver))
