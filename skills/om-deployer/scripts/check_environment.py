"""Tool: probe this machine and record which adaptation stages can run here."""

from __future__ import annotations

from pathlib import Path

from omskills.host.toolkit import WorkspacePath
from omskills.records.environment import EnvironmentReport
from omskills.stages.environment import check_environment as _check


def check_environment(task: WorkspacePath) -> EnvironmentReport:
    """Probe Python, torch (CUDA, torch_npu), onnx, onnxruntime and its execution providers,
    onnxscript, onnxslim, Huawei auto_optimizer, atc on PATH, the CANN toolkit (home,
    set_env.sh, version), npu-smi and ais_bench/aclruntime, and whether the model's driver finds
    its source. Reports, per stage (inventory, profile, contracts, export, optimize, precheck,
    atc, om_run, verify), whether it can run here and why, plus the available runtime backends.
    Writes the report to the task record (field `environment`, stage `environment`). Run it
    first: it is the gate for every later stage, and it reads the intake through the model's
    driver, so a malformed intake field is reported here.

    task: path of the task record YAML.
    """
    return _check(Path(task))


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(check_environment))
