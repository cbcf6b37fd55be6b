"""Stage 1 inventory: the static scan of the model's source, stored in the task record."""

from __future__ import annotations

import time
from pathlib import Path

from omskills.models.registry import bind_intake, resolved_spec
from omskills.records.inventory import Inventory
from omskills.records.stage_order import step_key
from omskills.records.stages import StageResult
from omskills.records.task import TaskRecord, load_record, now_iso, updating
from omskills.source.inventory import scan_source


def take_inventory(task_path: Path) -> Inventory | None:
    """Scan the package the driver names (None when it names none: nothing to scan statically).
    Runtime findings of an earlier study are kept, and the classes its profile saw run are scanned
    too (a model a factory builds from dotted names shows them only at run time)."""
    started, clock = now_iso(), time.perf_counter()
    record = load_record(task_path)
    workdir = TaskRecord.workdir(task_path)
    driver = bind_intake(record.intake, workdir).driver
    spec = resolved_spec(record.intake.model, workdir)
    package = driver.source_package(spec)
    inventory = None
    if package is not None:
        inventory = scan_source(
            driver.source_root(spec),
            package,
            driver.builder_name(spec),
            family=driver.family,
            entry_methods=driver.entry_methods,
            entry_classes=driver.entry_classes,
            runtime_classes=sorted({n.module_class for n in record.profile.nodes}) if record.profile else (),
            source=record.intake.model.source,
        )
    with updating(task_path) as rec:
        if inventory is not None and rec.inventory is not None:
            inventory.merge_runtime_findings([f for f in rec.inventory.portability if f.seen_at_runtime])
        rec.inventory = inventory
        note = (
            f"{len(inventory.predictors)} entry classes, {len(inventory.control_plane)} control-plane sites, "
            f"{len(inventory.portability)} portability findings in {inventory.files_scanned} files"
            if inventory
            else f"the {driver.family} driver names no source package: nothing to scan"
        )
        rec.stages[step_key("inventory")] = StageResult(
            status="done", started=started, seconds=round(time.perf_counter() - clock, 3), note=note
        )
    return inventory
