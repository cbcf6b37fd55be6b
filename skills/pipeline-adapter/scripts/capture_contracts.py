"""Tool: the real I/O contracts of the selected candidates on the main path."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from omskills.host.toolkit import TaskPath, tool_hints
from omskills.records.names import SafeName
from omskills.records.results import ContractsResult
from pydantic import Field


@tool_hints(title="Capture the I/O contracts", read_only=False, idempotent=True, long_running=True)
def capture_contracts(
    task: TaskPath,
    candidate: Annotated[
        SafeName | None,
        Field(description="One candidate to report, as plan_candidates names it; default: the plan's first batch."),
    ] = None,
) -> ContractsResult:
    """The real I/O contracts of each selected candidate (or the one named), with npz samples of real
    calls. Comes from the same instrumented run as profile_main_path (run if not done yet).

    A contract holds the flattened structure of args, kwargs and outputs (tree specs), every
    tensor's name, shape, dtype, device and which dims vary across calls, the non-tensor arguments
    and whether they stay constant (one contract per value of a scalar argument that varies), the
    provenance of each input (user input, session, parameter, or another module's output), the
    consumers of each output and the replacement point. Writes contracts/contracts.md."""
    from omskills.stages.adapter import capture_contracts as _capture

    return _capture(Path(task), candidate)


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(capture_contracts))
