"""Tool: Emulate ATC's precision modes (force_fp16, allow_mix_precision, allow_fp32_to_fp16, must_keep_origin_dtype by default) on ONNX Runtime CPU for the preferred variant, bisect each failing mode to the first node that breaks, propose the nodes to keep at their original dtype, emulate again with them, and record the mode convert_atc will use. Emulated, never an NPU result."""

from pathlib import Path

from omskills.host.toolkit import WorkspacePath
from omskills.stages.precision import emulate_candidate
from omskills.stages.toolchain import PrecisionBatch, for_each_candidate


def emulate_precision(task: WorkspacePath, candidate: str | None = None, modes: list[str] | None = None) -> PrecisionBatch:
    """Emulate ATC's precision modes (force_fp16, allow_mix_precision, allow_fp32_to_fp16, must_keep_origin_dtype by default) on ONNX Runtime CPU for the preferred variant, bisect each failing mode to the first node that breaks, propose the nodes to keep at their original dtype, emulate again with them, and record the mode convert_atc will use. Emulated, never an NPU result. Works on the plan's first batch, or on the one candidate named; a candidate whose
    emulation fails keeps its status (the failure is recorded) and the others go on."""
    path = Path(task)
    return for_each_candidate(path, candidate, PrecisionBatch(), lambda name: emulate_candidate(path, name, modes),
                              "emulate_precision", advisory=True)


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(emulate_precision))
