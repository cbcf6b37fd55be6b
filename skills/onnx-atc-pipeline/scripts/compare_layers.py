"""Tool: compare one candidate's graph node by node and name the first node whose error crosses the gate."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from omskills.host.toolkit import TaskPath, WorkspacePath, tool_hints
from omskills.records.choices import CompareAgainst, EmulatedMode
from omskills.records.names import SafeName
from omskills.records.precision import LayerComparison
from pydantic import Field


@tool_hints(title="Compare a graph layer by layer", read_only=False, idempotent=True, long_running=True)
def compare_layers(
    task: TaskPath,
    candidate: Annotated[
        SafeName,
        Field(description="The candidate (graph) to compare, as plan_candidates and the batch results name it."),
    ],
    mode: Annotated[
        EmulatedMode, Field(description='ATC precision mode to emulate (against="emulated").')
    ] = "force_fp16",
    keep: Annotated[
        list[str] | None,
        Field(
            description="Node names kept at their original dtype in the emulation "
            '(ATC\'s --keep_dtype; against="emulated").'
        ),
    ] = None,
    against: Annotated[
        CompareAgainst,
        Field(
            description='"emulated": the precision mode emulated on CPU; "npu_dump": the '
            "OM's dump from an Ascend NPU; \"pytorch\": the PyTorch submodules' "
            "outputs."
        ),
    ] = "emulated",
    dump_dir: Annotated[
        WorkspacePath | None,
        Field(
            description="Folder of the NPU dump (msit/ais_bench .npy layout; "
            'against="npu_dump"). Without it the tool writes the '
            "inputs and the dump command to run on the NPU."
        ),
    ] = None,
    om_json: Annotated[
        WorkspacePath | None,
        Field(
            description='The OM graph as JSON (atc --mode=1), to map fused ops back to ONNX nodes (against="npu_dump").'
        ),
    ] = None,
) -> LayerComparison:
    """Compare one candidate's fp32 ONNX graph node by node, on its first captured sample, against
    an emulated ATC precision mode, an NPU dump or the PyTorch submodules, and name the first node
    whose error crosses the gate and whether that error is local, accumulated or undetermined.

    Only a dump is an NPU result; the result says which backend produced each side."""
    from omskills.stages.precision import compare_candidate_layers

    return compare_candidate_layers(
        Path(task),
        candidate,
        mode,
        keep,
        against,
        Path(dump_dir) if dump_dir else None,
        Path(om_json) if om_json else None,
    )


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(compare_layers))
