"""Tool: profile the task's main path (one instrumented run, shared with contract capture)."""

from pathlib import Path

from omskills.host.toolkit import WorkspacePath
from omskills.stages.study import ProfileSummary
from omskills.stages.study import profile_main_path as _profile


def profile_main_path(task: WorkspacePath) -> ProfileSummary:
    """Run the model's main path once (the entry users call, e.g. a video predictor's
    start_session -> add_prompt(text) -> propagate_in_video) with hooks on every nn.Module and on the
    driver's seed candidates; store the module call tree (calls per step, inclusive/exclusive time,
    share), the candidates' I/O contracts and the main-path outputs in the task record. A driver
    that names no seed candidates gets the heaviest subtrees of a first, profile-only run. A rerun
    with the same intake reuses the stored run."""
    return _profile(Path(task))


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(profile_main_path))
