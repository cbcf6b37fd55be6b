"""The environment gate: what this machine can run for the task, stored in the task record."""

from __future__ import annotations

import time
from pathlib import Path

from omskills.errors import OmskillsError
from omskills.host.environment import probe_environment
from omskills.models.registry import bind_intake, resolved_spec
from omskills.records.environment import EnvironmentReport
from omskills.records.stages import StageResult
from omskills.records.task import TaskRecord, load_record, now_iso, updating


def check_environment(task_path: Path) -> EnvironmentReport:
    started, clock = now_iso(), time.perf_counter()
    record = load_record(task_path)
    workdir = TaskRecord.workdir(task_path)
    driver = bind_intake(record.intake, workdir).driver
    try:
        driver.source_root(resolved_spec(record.intake.model, workdir))
        model_problem = None
    except OmskillsError as err:
        model_problem = str(err)
    report = probe_environment(record.intake, model_problem)
    with updating(task_path) as rec:
        rec.environment = report
        blocked = [s.stage for s in report.stages if not s.can_run]
        rec.stages["environment"] = StageResult(
            status="done", started=started, finished=now_iso(), seconds=round(time.perf_counter() - clock, 3),
            note=f"cannot run here: {', '.join(blocked)}" if blocked else "every stage can run here",
        )
    return report
