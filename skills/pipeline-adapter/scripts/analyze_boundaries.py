"""Tool: decide what is graph and what stays in Python, and the ATC shape strategy."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from omskills.host.toolkit import TaskPath, tool_hints
from omskills.records.names import SafeName
from omskills.records.results import BoundariesResult
from pydantic import Field


@tool_hints(title="Analyse the boundaries", read_only=False, idempotent=True, long_running=True)
def analyze_boundaries(
    task: TaskPath,
    candidate: Annotated[
        SafeName | None,
        Field(
            description="One candidate (graph) to analyse, as capture_contracts names "
            "it; default: the plan's first batch and the candidates "
            "deferred inside it."
        ),
    ] = None,
    trial_export: Annotated[
        bool,
        Field(
            description="Also try torch.export on each candidate and replay it on the "
            "captured samples (loads the model; minutes at full scale)."
        ),
    ] = False,
) -> BoundariesResult:
    """Per selected candidate: an exportability verdict with reasons, the control plane that stays in
    Python, exactly one proposed ATC shape strategy and merge suggestions.

    The verdict weighs tensor-only I/O after flattening, constant non-tensor arguments and one call
    structure (optionally a trial torch.export replayed on the samples); the shape strategy is
    derived from the observed dims and the source's declared limits. Stored in the task record and
    rendered as contracts/boundaries.md."""
    from omskills.stages.adapter import analyze_boundaries as _analyze

    return _analyze(Path(task), candidate, trial_export)


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(analyze_boundaries))
