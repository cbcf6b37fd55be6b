"""Tool: the real I/O contracts of the selected candidates on the main path."""

from pathlib import Path

from omskills.host.toolkit import WorkspacePath
from omskills.stages.adapter import ContractsResult
from omskills.stages.adapter import capture_contracts as _capture


def capture_contracts(task: WorkspacePath, candidate: str | None = None) -> ContractsResult:
    """For each selected candidate (or the one named): the flattened structure of args, kwargs and
    outputs (tree specs), every tensor's name, shape, dtype, device and which dims vary across calls,
    non-tensor arguments and whether they stay constant (one contract per value of a scalar argument
    that varies), the provenance of each input (user input, session, parameter, or another module's
    output), the consumers of each output, the replacement point, and npz samples of real calls.
    Comes from the same instrumented run as profile_main_path."""
    return _capture(Path(task), candidate)


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(capture_contracts))
