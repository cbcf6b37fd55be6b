"""Tool: Export each candidate to ONNX through a wrapper built from its contract (flat tensor I/O, constants bound), under no_grad in fp32, names from the contract, dynamic axes from the boundary strategy, opset <= 18 for ATC (converted down if needed), external data over 2 GB; records which exporter ran (dynamo = torch.export based, or legacy)."""

from pathlib import Path
from typing import Literal

from omskills.host.toolkit import WorkspacePath
from omskills.stages.toolchain import ExportBatch, export_candidate, for_each_candidate


def export_onnx(task: WorkspacePath, candidate: str | None = None, exporter: Literal["dynamo", "legacy"] = "dynamo") -> ExportBatch:
    """Export each candidate to ONNX through a wrapper built from its contract (flat tensor I/O, constants bound), under no_grad in fp32, names from the contract, dynamic axes from the boundary strategy, opset <= 18 for ATC (converted down if needed), external data over 2 GB; records which exporter ran (dynamo = torch.export based, or legacy). Works on the plan's first batch, or on the one candidate named; a candidate that
    fails is recorded as failed with its error (its logs kept) and the others go on; the candidates deferred
    because they run inside the failed one then join the batch and are exported in its place."""
    path = Path(task)
    return for_each_candidate(path, candidate, ExportBatch(), lambda name: export_candidate(path, name, exporter), "export_onnx",
                              promote_inner=True)


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(export_onnx))
