"""Tool: emulate ATC's precision modes on CPU and choose the one convert_atc will use."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from omskills.host.toolkit import TaskPath, tool_hints
from omskills.records.choices import CandidateName, EmulatedMode
from omskills.records.results import PrecisionBatch
from pydantic import Field


@tool_hints(title="Emulate ATC precision modes", read_only=False, idempotent=True, long_running=True)
def emulate_precision(
    task: TaskPath,
    candidate: CandidateName = None,
    modes: Annotated[
        list[EmulatedMode] | None,
        Field(
            description="ATC precision modes to emulate; default: force_fp16, "
            "allow_mix_precision, allow_fp32_to_fp16, "
            "must_keep_origin_dtype."
        ),
    ] = None,
) -> PrecisionBatch:
    """Emulate ATC's precision modes on ONNX Runtime CPU for the preferred variant and record the
    mode convert_atc will use. Emulated, never an NPU result.

    Bisects each failing mode to the first node that breaks, proposes the nodes to keep at their
    original dtype and emulates again with them. Works on the plan's first batch, or on the one
    candidate named; a candidate whose emulation fails keeps its status (the failure is recorded)
    and the others go on."""
    from omskills.stages.precision import emulate_candidate
    from omskills.stages.steps import for_each_graph

    path = Path(task)
    return for_each_graph(
        "precision", path, candidate, PrecisionBatch(), lambda name: emulate_candidate(path, name, modes)
    )


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(emulate_precision))
