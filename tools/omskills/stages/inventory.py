"""Stage 1 inventory: the static scan of the model's source, stored in the task record. A rerun
reuses the recorded scan while the driver asks for the same package and its files are unchanged."""

from __future__ import annotations

import time
from pathlib import Path

from omskills.models.registry import bind_intake, resolved_spec
from omskills.records.inventory import Inventory
from omskills.records.stage_order import step_key
from omskills.records.stages import StageResult
from omskills.records.task import TaskRecord, load_record, now_iso, updating
from omskills.source.inventory import package_state, scan_source
from omskills.stages.steps import fingerprint, is_done


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
    if package is None:
        return _recorded(task_path, None, None, started, clock, f"the {driver.family} driver names no source package")
    root = driver.source_root(spec)
    runtime_classes = sorted({n.module_class for n in record.profile.nodes}) if record.profile else []
    scan = (driver.family, driver.entry_methods, driver.entry_classes, driver.builder_name(spec), spec.source)
    inputs_hash = fingerprint(*scan, runtime_classes, str(root), package_state(root, package))
    if is_done(record, step_key("inventory"), inputs_hash):
        return record.inventory
    inventory = scan_source(
        root,
        package,
        driver.builder_name(spec),
        family=driver.family,
        entry_methods=driver.entry_methods,
        entry_classes=driver.entry_classes,
        runtime_classes=runtime_classes,
        source=record.intake.model.source,
    )
    note = (
        f"{len(inventory.predictors)} entry classes, {len(inventory.control_plane)} control-plane sites, "
        f"{len(inventory.portability)} portability findings in {inventory.files_scanned} files"
    )
    return _recorded(task_path, inventory, inputs_hash, started, clock, note)


def _recorded(
    task_path: Path, inventory: Inventory | None, inputs_hash: str | None, started: str, clock: float, note: str
) -> Inventory | None:
    """The scan into the record, with the runtime findings of an earlier study kept."""
    with updating(task_path) as rec:
        if inventory is not None and rec.inventory is not None:
            inventory.merge_runtime_findings([f for f in rec.inventory.portability if f.seen_at_runtime])
        rec.inventory = inventory
        rec.stages[step_key("inventory")] = StageResult(
            status="done",
            inputs_hash=inputs_hash,
            started=started,
            seconds=round(time.perf_counter() - clock, 3),
            note=note if inventory else f"{note}: nothing to scan",
        )
    return inventory
