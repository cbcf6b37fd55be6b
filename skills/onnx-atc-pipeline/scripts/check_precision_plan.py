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
            le=64,
            description="Spliced main-path runs the check may make, finding the "
            "graphs at fault included (each is one run of the model).",
        ),
    ] = 8,
) -> PrecisionPlan:
    """Run the main path with every deployed graph emulated in the ATC precision mode its own
    emulation chose (emulate_precision), against PyTorch, judged by the driver's checks. When it
    fails, find the graphs at fault by bisection (some emulated, the rest in fp32), move each one
    step to a safer mode and check again, within `budget` runs. The chosen modes in the record are
    updated, so convert_atc's commands carry the plan that passed; when none passes, the graphs at
    fault convert with must_keep_origin_dtype and the record says so. Emulated on CPU, never an NPU
    result; writes verify/report-emulated.json and .html for the last plan run."""
    from omskills.stages.precision_plan import check_precision_plan as _check

    return _check(Path(task), budget)


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(check_precision_plan))
