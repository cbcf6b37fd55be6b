"""Tool: decide what is graph and what stays in Python, and the ATC shape strategy."""

from pathlib import Path

from omskills.host.toolkit import WorkspacePath
from omskills.stages.adapter import BoundariesResult
from omskills.stages.adapter import analyze_boundaries as _analyze


def analyze_boundaries(task: WorkspacePath, candidate: str | None = None, trial_export: bool = False) -> BoundariesResult:
    """Per selected candidate: an exportability verdict with reasons (tensor-only after flattening,
    constant non-tensor arguments, one call structure; optionally a trial torch.export replayed on the
    samples), the control plane that stays in Python, exactly one proposed ATC shape strategy derived
    from the observed dims and the source's declared limits, and merge suggestions. Stored in the
    task record and rendered as contracts/boundaries.md."""
    return _analyze(Path(task), candidate, trial_export)


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(analyze_boundaries))
