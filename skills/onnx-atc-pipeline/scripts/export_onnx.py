"""Tool: export each candidate to ONNX through a wrapper built from its contract."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from omskills.host.toolkit import TaskPath, tool_hints
from omskills.records.choices import CandidateName, ExporterName
from omskills.records.results import ExportBatch
from pydantic import Field


# destructive: a new export (another exporter, a changed contract) drops the candidate's probe, variants,
# precheck and ATC.
@tool_hints(title="Export to ONNX", read_only=False, destructive=True, idempotent=True, long_running=True)
def export_onnx(
    task: TaskPath,
    candidate: CandidateName = None,
    exporter: Annotated[
        ExporterName, Field(description='"dynamo": the torch.export-based exporter; "legacy": the TorchScript one.')
    ] = "dynamo",
) -> ExportBatch:
    """Export each candidate to ONNX through a wrapper built from its contract, in fp32 with opset
    <= 18 for ATC, and record which exporter ran.

    The wrapper has flat tensor I/O with constants bound; export runs under no_grad with names from
    the contract, dynamic axes from the boundary strategy, the opset converted down if needed and
    external data over 2 GB. Works on the plan's first batch, or on the one candidate named; a
    candidate that fails is recorded as failed with its error (its logs kept) and the others go on;
    the candidates deferred because they run inside the failed one then join the batch and are
    exported in its place."""
    from omskills.stages.steps import for_each_graph
    from omskills.stages.toolchain import export_candidate

    path = Path(task)
    return for_each_graph("export", path, candidate, ExportBatch(), lambda name: export_candidate(path, name, exporter))


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(export_onnx))
