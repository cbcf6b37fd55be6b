"""Tool: Build the variants original, onnxslim and auto_optimizer (Huawei msit surgeon, through a compatibility layer), check each (onnx checker, ORT load, no dangling outputs, probe parity) and prefer auto_optimizer > onnxslim > original among those that pass."""

from pathlib import Path

from omskills.host.toolkit import WorkspacePath
from omskills.stages.toolchain import OptimizeBatch, for_each_candidate, optimize_candidate


def optimize_onnx(task: WorkspacePath, candidate: str | None = None) -> OptimizeBatch:
    """Build the variants original, onnxslim and auto_optimizer (Huawei msit surgeon, through a compatibility layer), check each (onnx checker, ORT load, no dangling outputs, probe parity) and prefer auto_optimizer > onnxslim > original among those that pass. Works on the plan's first batch, or on the one candidate named; a candidate that
    fails is recorded as failed with its error (its logs kept) and the others go on."""
    path = Path(task)
    return for_each_candidate(path, candidate, OptimizeBatch(), lambda name: optimize_candidate(path, name), "optimize_onnx")


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(optimize_onnx))
