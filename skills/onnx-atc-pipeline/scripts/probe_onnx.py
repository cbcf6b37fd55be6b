"""Tool: run ONNX Runtime on the captured samples and compare with the captured PyTorch outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from omskills.host.toolkit import TaskPath, tool_hints
from omskills.records.choices import CandidateName, VariantName
from omskills.records.results import ProbeBatch
from pydantic import Field


@tool_hints(title="Probe ONNX parity", read_only=False, idempotent=True, long_running=True)
def probe_onnx(
    task: TaskPath,
    candidate: CandidateName = None,
    variant: Annotated[
        VariantName, Field(description="Which ONNX variant to run: the export as is, or an optimize_onnx variant.")
    ] = "original",
) -> ProbeBatch:
    """Run ONNX Runtime on the captured samples and compare with the captured PyTorch outputs:
    cosine, max abs and max relative error per output; pass (cosine >= 0.9999, max abs < 1e-4),
    review (>= 0.999, < 1e-3) or fail.

    Works on the plan's first batch, or on the one candidate named; a candidate that fails is
    recorded as failed with its error (its logs kept) and the others go on."""
    from omskills.stages.steps import for_each_graph
    from omskills.stages.toolchain import probe_candidate

    path = Path(task)
    return for_each_graph("probe", path, candidate, ProbeBatch(), lambda name: probe_candidate(path, name, variant))


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(probe_onnx))
