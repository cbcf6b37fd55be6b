"""Tool: check the ATC precision plan end to end on the main path, and fix it when it fails."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from omskills.host.toolkit import TaskPath, tool_hints
from omskills.records.precision import PrecisionPlan
from pydantic import Field


@tool_hints(title="Check the precision plan end to end", read_only=False, idempotent=True, long_running=True)
def check_precision_plan(
    task: TaskPath,
    budget: Annotated[
        int,
        Field(
            ge=1,
            le=8,
            description="Spliced main-path runs the check may make: 1 confirms the plan; 2 allows one more "
            "after the graphs at fault get longer keep lists (each is one run of the model).",
        ),
    ] = 2,
) -> PrecisionPlan:
    """Run the main path with every deployed graph emulated in the ATC precision mode and keep list
    its own emulation chose (emulate_precision: calibration, then a graph-local search), judged
    against the study's PyTorch outputs by the driver's precision checks (thresholded outputs judged
    at their threshold: a near-threshold flip is reported, not a divergence). When it fails, each
    graph's own error on its recorded inputs names the graphs at fault; their keep lists are searched
    again on those inputs against a tighter tolerance and the plan runs once more. The record's
    chosen modes are updated, so convert_atc's commands carry the plan; when none passes, the graphs
    at fault convert with must_keep_origin_dtype. Reports the share of Cube MACs in fp16 and the
    predicted Cube time (peak rates per SoC). Emulated on CPU, never an NPU result; writes
    verify/report-emulated.json and .html for the last run."""
    from omskills.stages.precision_plan import check_precision_plan as _check

    return _check(Path(task), budget)


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(check_precision_plan))
