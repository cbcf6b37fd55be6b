"""Tool: check every operator of the preferred variant against the ONNX operators ATC supports."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from omskills.host.toolkit import TaskPath, tool_hints
from omskills.records.choices import CandidateName, Soc
from omskills.records.results import PrecheckBatch
from pydantic import Field


@tool_hints(title="Precheck operators for ATC", read_only=False, idempotent=True)
def precheck_ops(
    task: TaskPath,
    candidate: CandidateName = None,
    soc: Annotated[
        Soc | None,
        Field(
            description="Target SoC (ATC --soc_version: 'Ascend' + the Name `npu-smi info` "
            "shows); default: the task record's target."
        ),
    ] = None,
) -> PrecheckBatch:
    """Compare every operator of the preferred variant (op type and opset) with the ONNX operators
    ATC supports (CANN 8.0.0 list shipped in the repo); report unsupported and constrained ops with
    node names.

    Works on the plan's first batch, or on the one candidate named; a candidate that fails is
    recorded as failed with its error and the others go on."""
    from omskills.stages.steps import for_each_graph
    from omskills.stages.toolchain import precheck_candidate

    path = Path(task)
    return for_each_graph(
        "precheck", path, candidate, PrecheckBatch(), lambda name: precheck_candidate(path, name, soc)
    )


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(precheck_ops))
