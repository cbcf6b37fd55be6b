"""Tool: splice the compiled candidates into the live model and verify the main path."""

from pathlib import Path

from omskills.host.toolkit import WorkspacePath
from omskills.records.verify import VerifyReport
from omskills.stages.verify import verify_main_path as _verify


def verify_main_path(task: WorkspacePath, backend: str = "onnxruntime", precision: str = "fp32") -> VerifyReport:
    """Run the same inputs through the PyTorch reference and through the pipeline with every
    exported, probed graph spliced in, on `backend` (a registered runtime backend: "onnxruntime",
    or "om" through ais_bench on Ascend), and judge every step by the driver's output checks (for
    SAM: object ids equal, mask IoU per object; for a detector: labels, boxes, scores; tensors by
    cosine and max abs). Reports per graph the backend that really ran, probe metrics, calls,
    fallbacks and latency. Writes verify/report.json and a self-contained verify/report.html with
    a figure and side-by-side pictures of both runs. precision "emulated" (after emulate_precision)
    runs every graph in its chosen ATC precision mode emulated on ONNX Runtime CPU instead: the
    parity to expect on Ascend from fp16 numerics, recorded beside the fp32 one (never an NPU
    result); it writes verify/report-emulated.json and .html."""
    return _verify(Path(task), backend, precision)


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(verify_main_path))
