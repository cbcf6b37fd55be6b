"""Tool: static inventory of the model source (entries, control plane, CUDA-only sites)."""

from __future__ import annotations

import time

from omskills.source.inventory import locate_source_root, scan_source
from omskills.records.inventory import Inventory
from omskills.records.stages import StageResult
from omskills.records.task import TaskRecord, load_record, now_iso, updating


def inventory_entries(task: str) -> Inventory:
    """Scan the model source named in the task record (the installed package or a checkout)
    with Python's ast, without importing it. Reports with file:line evidence: the builder
    functions and their signatures (the configured builder must exist), the predictor
    classes and the request types their handle_request/handle_stream_request dispatch
    (start_session, add_prompt, propagate_in_video, ...) with the method each calls, the
    Python control plane (tokenizer, session store, frame cache, object-id bookkeeping,
    prompt management) and the CUDA-only sites (.cuda(), device="cuda", pin_memory, triton,
    flash attention, CUDA autocast, CUDA device queries, bf16 casts) as portability findings.
    Findings the portability layer already saw at run time (a previous inventory merged
    with the profile run) are kept. Writes the field `inventory` of the task record.

    task: path of the task record YAML.
    """
    started, clock = now_iso(), time.perf_counter()
    model = load_record(task).intake.model
    root = locate_source_root(model.source, model.family, base_dir=TaskRecord.workdir(task))
    inventory = scan_source(root, model.family, model.builder, source=model.source)
    with updating(task) as record:
        if record.inventory is not None:
            inventory.merge_runtime_findings([f for f in record.inventory.portability if f.seen_at_runtime])
        record.inventory = inventory
        record.stages["inventory"] = StageResult(
            status="done", started=started, finished=now_iso(), seconds=round(time.perf_counter() - clock, 3),
            note=(f"{len(inventory.predictors)} predictor classes, {len(inventory.control_plane)} control-plane sites, "
                  f"{len(inventory.portability)} portability findings in {inventory.files_scanned} files"),
        )
    return inventory


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(inventory_entries))
