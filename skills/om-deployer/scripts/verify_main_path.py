"""Tool: splice the compiled candidates into the live model and verify the main path."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from omskills.host.toolkit import TaskPath, tool_hints
from omskills.records.choices import VerifyPrecision
from omskills.records.verify import VerifyReport
from pydantic import Field


# Not idempotent: each call runs the main path again, rewrites its report and records a new decision.
@tool_hints(title="Verify the main path", read_only=False, idempotent=False, long_running=True)
def verify_main_path(
    task: TaskPath,
    backend: Annotated[
        str,
        Field(
            description='Registered runtime backend the graphs run on: "onnxruntime", or "om" '
            "(ais_bench, on an Ascend host), or a third party's."
        ),
    ] = "onnxruntime",
    precision: Annotated[
        VerifyPrecision,
        Field(
            description='"fp32": the graphs as exported; "emulated" (after '
            "emulate_precision): each graph in its chosen ATC precision "
            "mode emulated on ONNX Runtime CPU."
        ),
    ] = "fp32",
) -> VerifyReport:
    """Run the same inputs through the PyTorch reference and through the pipeline with every
    exported, probed graph spliced in, and judge every step by the driver's output checks.

    The checks are the driver's (for SAM: object ids equal, mask IoU per object; for a detector:
    labels, boxes, scores; tensors by cosine and max abs). Reports per graph the backend that
    really ran, probe metrics, calls, fallbacks and latency. Writes verify/report.json and a
    self-contained verify/report.html with a figure and side-by-side pictures of both runs.
    precision "emulated" gives the parity to expect on Ascend from fp16 numerics, recorded beside
    the fp32 one (never an NPU result), in verify/report-emulated.json and .html."""
    from omskills.stages.verify import verify_main_path as _verify

    return _verify(Path(task), backend, precision)


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(verify_main_path))
