"""Tool: Compare one candidate's graph node by node on its first captured sample, fp32 ONNX against: an ATC precision mode emulated on CPU (against="emulated", optionally with nodes kept at their original dtype), the OM's dump from an Ascend NPU (against="npu_dump", msit/ais_bench .npy layout in dump_dir, om_json to map fused ops), or the PyTorch submodules' outputs (against="pytorch"); names the first node whose error crosses the gate and whether that error is local, accumulated or undetermined. Only a dump is an NPU result; the tool says which backend produced each side."""

from pathlib import Path

from omskills.host.toolkit import WorkspacePath
from omskills.records.precision import LayerComparison
from omskills.stages.precision import CompareAgainst, compare_candidate_layers


def compare_layers(task: WorkspacePath, candidate: str, mode: str = "force_fp16", keep: list[str] | None = None,
                   against: CompareAgainst = "emulated", dump_dir: WorkspacePath | None = None,
                   om_json: WorkspacePath | None = None) -> LayerComparison:
    """Compare one candidate's graph node by node on its first captured sample, fp32 ONNX against: an ATC precision mode emulated on CPU (against="emulated", optionally with nodes kept at their original dtype), the OM's dump from an Ascend NPU (against="npu_dump", msit/ais_bench .npy layout in dump_dir, om_json to map fused ops), or the PyTorch submodules' outputs (against="pytorch"); names the first node whose error crosses the gate and whether that error is local, accumulated or undetermined. Only a dump is an NPU result; the tool says which backend produced each side."""
    return compare_candidate_layers(Path(task), candidate, mode, keep, against,
                                    Path(dump_dir) if dump_dir else None, Path(om_json) if om_json else None)


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(compare_layers))
