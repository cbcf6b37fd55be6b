"""Tool: build and check the optimised variants of each candidate's ONNX and prefer the best that passes."""

from __future__ import annotations

from pathlib import Path

from omskills.host.toolkit import TaskPath, tool_hints
from omskills.records.choices import CandidateName
from omskills.records.results import OptimizeBatch


@tool_hints(title="Optimise the ONNX graphs", read_only=False, idempotent=True, long_running=True)
def optimize_onnx(task: TaskPath, candidate: CandidateName = None) -> OptimizeBatch:
    """Build the variants original, onnxslim and auto_optimizer (Huawei msit surgeon, through a
    compatibility layer) on the graph with its weights detached, and prefer auto_optimizer >
    onnxslim > original among those that pass; a variant that changes nothing is `unchanged`.

    The checks: onnx checker, ONNX Runtime load, no dangling outputs, probe parity; most
    optimised first, a variant under the chosen one is `not_checked`. Works on the
    plan's first batch, or on the one candidate named; a candidate that fails is recorded as failed
    with its error (its logs kept) and the others go on."""
    from omskills.stages.steps import for_each_graph
    from omskills.stages.toolchain import optimize_candidate

    path = Path(task)
    return for_each_graph("optimize", path, candidate, OptimizeBatch(), lambda name: optimize_candidate(path, name))


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(optimize_onnx))
