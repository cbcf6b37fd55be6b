"""Tool: profile the task's main path (one instrumented run, shared with contract capture)."""

from pathlib import Path

from omskills.stages.deployer import ProfileSummary
from omskills.stages.deployer import profile_main_path as _profile
from omskills.host.toolkit import WorkspacePath


def profile_main_path(task: WorkspacePath) -> ProfileSummary:
    """Run the main path once (start_session -> add_prompt(text) -> propagate_in_video) with hooks on
    every nn.Module and on the family's seed candidates; store the module call tree (calls per frame,
    inclusive/exclusive time, share), the candidates' I/O contracts and the main-path outputs in the
    task record. A rerun with the same intake reuses the stored run."""
    return _profile(Path(task))


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(profile_main_path))
