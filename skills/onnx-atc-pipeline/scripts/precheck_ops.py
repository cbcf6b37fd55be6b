"""Tool: Compare every operator of the preferred variant (op type and opset) with the ONNX operators ATC supports (CANN 8.0.0 list shipped in the repo); report unsupported and constrained ops with node names."""

from pathlib import Path

from omskills.host.toolkit import WorkspacePath
from omskills.stages.toolchain import PrecheckBatch, for_each_candidate, precheck_candidate


def precheck_ops(task: WorkspacePath, candidate: str | None = None, soc: str | None = None) -> PrecheckBatch:
    """Compare every operator of the preferred variant (op type and opset) with the ONNX operators ATC supports (CANN 8.0.0 list shipped in the repo); report unsupported and constrained ops with node names. Works on the plan's first batch, or on the one candidate named; a candidate that
    fails is recorded as failed with its error (its logs kept) and the others go on."""
    path = Path(task)
    return for_each_candidate(path, candidate, PrecheckBatch(), lambda name: precheck_candidate(path, name, soc), "precheck_ops")


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(precheck_ops))
