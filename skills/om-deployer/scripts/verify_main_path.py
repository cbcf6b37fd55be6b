"""Tool: splice the compiled candidates into the live predictor and verify the main path."""

from pathlib import Path
from typing import Literal

from omskills.records.verify import VerifyReport
from omskills.host.toolkit import WorkspacePath
from omskills.stages.verify import verify_main_path as _verify


def verify_main_path(task: WorkspacePath, backend: Literal["onnxruntime", "om"] = "onnxruntime") -> VerifyReport:
    """Run the same frames and prompt through the PyTorch reference and through the predictor with
    every exported, probed candidate spliced in (ONNX Runtime, or OM through ais_bench on Ascend):
    per frame object-id agreement, mask IoU per object, box and score differences; per candidate the
    backend that really ran, probe metrics, calls, fallbacks and latency. Writes verify/report.json
    and a self-contained verify/report.html with a figure and side-by-side overlays."""
    return _verify(Path(task), backend)


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(verify_main_path))
