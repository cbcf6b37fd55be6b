"""Tool: profile the task's main path (one instrumented run, shared with contract capture)."""

from __future__ import annotations

from pathlib import Path

from omskills.host.toolkit import TaskPath, tool_hints
from omskills.records.results import ProfileSummary


@tool_hints(title="Profile the main path", read_only=False, idempotent=True, long_running=True)
def profile_main_path(task: TaskPath) -> ProfileSummary:
    """Run the model's main path once, instrumented, and store its module call tree, the seed
    candidates' I/O contracts and the main-path outputs in the task record.

    The main path is the entry users call (e.g. a video predictor's start_session ->
    add_prompt(text) -> propagate_in_video), with hooks on every nn.Module and on the driver's seed
    candidates; the call tree has calls per step, inclusive/exclusive time and share. A driver that
    names no seed candidates gets the heaviest subtrees of a first, profile-only run. A rerun with
    the same intake reuses the stored run."""
    from omskills.stages.study import profile_main_path as _profile

    return _profile(Path(task))


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(profile_main_path))
