"""Tool: build the ATC command of each candidate and run it where CANN atc exists."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from omskills.host.toolkit import TaskPath, tool_hints
from omskills.records.choices import CandidateName, PrecisionMode
from omskills.records.results import AtcBatch
from pydantic import Field


@tool_hints(title="Convert with ATC", read_only=False, idempotent=True, long_running=True)
def convert_atc(
    task: TaskPath,
    candidate: CandidateName = None,
    precision_mode: Annotated[
        PrecisionMode | None,
        Field(description="ATC --precision_mode; default: the mode emulate_precision chose, else ATC's own default."),
    ] = None,
) -> AtcBatch:
    """Build the ATC command (framework 5, SoC, input shapes, exactly one shape strategy from the
    boundary analysis, optional precision mode) and run it where CANN atc exists; elsewhere write
    the ready-to-run script and record not_run (atc missing). Never reports an OM that was not built.

    Works on the plan's first batch, or on the one candidate named; a candidate that fails is
    recorded as failed with its error (its logs kept) and the others go on."""
    from omskills.stages.steps import for_each_graph
    from omskills.stages.toolchain import convert_candidate

    path = Path(task)
    return for_each_graph(
        "atc", path, candidate, AtcBatch(), lambda name: convert_candidate(path, name, precision_mode)
    )


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(convert_atc))
