"""Tool: probe this machine and record which adaptation stages can run here."""

from __future__ import annotations

import time

from omskills.host.environment import probe_environment
from omskills.records.environment import EnvironmentReport
from omskills.records.stages import StageResult
from omskills.records.task import TaskRecord, load_record, now_iso, updating


def check_environment(task: str) -> EnvironmentReport:
    """Probe Python, torch (CUDA, torch_npu), onnx, onnxruntime and its execution providers,
    onnxscript, onnxslim, Huawei auto_optimizer, atc on PATH, the CANN toolkit (home,
    set_env.sh, version), npu-smi and ais_bench/aclruntime. Reports, per stage (inventory,
    profile, contracts, export, optimize, precheck, atc, om_run, verify), whether it can run
    here and why, plus the available runtime backends. Writes the report to the task record
    (field `environment`, stage `environment`). Run it first: it is the gate for every
    later stage.

    task: path of the task record YAML.
    """
    started, clock = now_iso(), time.perf_counter()
    intake = load_record(task).intake
    report = probe_environment(intake, base_dir=TaskRecord.workdir(task))
    with updating(task) as record:
        record.environment = report
        blocked = [s.stage for s in report.stages if not s.can_run]
        record.stages["environment"] = StageResult(
            status="done", started=started, finished=now_iso(), seconds=round(time.perf_counter() - clock, 3),
            note=f"cannot run here: {', '.join(blocked)}" if blocked else "every stage can run here",
        )
    return report


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(check_environment))
