"""Tool: Run ONNX Runtime on the captured samples and compare with the captured PyTorch outputs: cosine, max abs and max relative error per output; pass (cosine >= 0.9999, max abs < 1e-4), review (>= 0.999, < 1e-3) or fail."""

from pathlib import Path

from omskills.host.toolkit import WorkspacePath
from omskills.stages.toolchain import ProbeBatch, for_each_candidate, probe_candidate


def probe_onnx(task: WorkspacePath, candidate: str | None = None, variant: str = "original") -> ProbeBatch:
    """Run ONNX Runtime on the captured samples and compare with the captured PyTorch outputs: cosine, max abs and max relative error per output; pass (cosine >= 0.9999, max abs < 1e-4), review (>= 0.999, < 1e-3) or fail. Works on the plan's first batch, or on the one candidate named; a candidate that
    fails is recorded as failed with its error (its logs kept) and the others go on."""
    path = Path(task)
    return for_each_candidate(path, candidate, ProbeBatch(), lambda name: probe_candidate(path, name, variant), "probe_onnx")


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(probe_onnx))
