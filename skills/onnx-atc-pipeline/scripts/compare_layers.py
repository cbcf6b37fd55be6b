"""Tool: Compare one candidate's graph node by node, fp32 against an ATC precision mode emulated on CPU (optionally with nodes kept at their original dtype), on its first captured sample; names the first node whose error crosses the gate and whether that error is local or accumulated. Emulated, never an NPU result."""

from pathlib import Path

from omskills.host.toolkit import WorkspacePath
from omskills.records.precision import LayerComparison
from omskills.stages.precision import compare_candidate_layers


def compare_layers(task: WorkspacePath, candidate: str, mode: str = "force_fp16", keep: list[str] | None = None) -> LayerComparison:
    """Compare one candidate's graph node by node, fp32 against an ATC precision mode emulated on CPU (optionally with nodes kept at their original dtype), on its first captured sample; names the first node whose error crosses the gate and whether that error is local or accumulated. Emulated, never an NPU result."""
    return compare_candidate_layers(Path(task), candidate, mode, keep)


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(compare_layers))
