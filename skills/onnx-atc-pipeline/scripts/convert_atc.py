"""Tool: Build the ATC command (framework 5, SoC, input shapes, exactly one shape strategy from the boundary analysis, optional precision mode) and run it where CANN atc exists; elsewhere write the ready-to-run script and record not_run (atc missing). Never reports an OM that was not built."""

from pathlib import Path

from omskills.host.toolkit import WorkspacePath
from omskills.stages.toolchain import AtcBatch, convert_candidate, for_each_candidate


def convert_atc(task: WorkspacePath, candidate: str | None = None, precision_mode: str | None = None) -> AtcBatch:
    """Build the ATC command (framework 5, SoC, input shapes, exactly one shape strategy from the boundary analysis, optional precision mode) and run it where CANN atc exists; elsewhere write the ready-to-run script and record not_run (atc missing). Never reports an OM that was not built. Works on the plan's first batch, or on the one candidate named; a candidate that
    fails is recorded as failed with its error (its logs kept) and the others go on."""
    path = Path(task)
    return for_each_candidate(path, candidate, AtcBatch(), lambda name: convert_candidate(path, name, precision_mode), "convert_atc")


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(convert_atc))
