"""Tool: probe this machine and record which adaptation stages can run here."""

from __future__ import annotations

from pathlib import Path

from omskills.host.toolkit import TaskPath, tool_hints
from omskills.records.environment import EnvironmentReport


# destructive: a changed target SoC drops the precheck and ATC results made for the old one.
@tool_hints(title="Check the environment", read_only=False, destructive=True, idempotent=True)
def check_environment(task: TaskPath) -> EnvironmentReport:
    """Probe this machine and record, per adaptation stage, whether it can run here and why. Run it
    first: it is the gate for every later stage.

    Probes Python, torch (CUDA, torch_npu), onnx, onnxruntime and its execution providers,
    onnxscript, onnxslim, Huawei auto_optimizer, atc on PATH, the CANN toolkit (home, set_env.sh,
    version), npu-smi and ais_bench/aclruntime, and whether the model's driver finds its source.
    Reports, per stage (inventory, profile, contracts, export, optimize, precheck, atc, om_run,
    verify), whether it can run here and why, plus the available runtime backends. Writes the
    report to the task record (field `environment`, stage `environment`). It reads the intake
    through the model's driver, so a malformed intake field is reported here.
    """
    from omskills.stages.environment import check_environment as _check

    return _check(Path(task))


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(check_environment))
