"""Tool: static inventory of the model source (entries, control plane, CUDA-only sites)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from omskills.host.toolkit import TaskPath, tool_hints
from omskills.records.inventory import Inventory
from pydantic import Field


@tool_hints(title="Inventory the model source", read_only=False, idempotent=True)
def inventory_entries(
    task: TaskPath,
) -> Annotated[
    Inventory | None,
    Field(description="The inventory stored in the task record, or null when the driver names no source package."),
]:
    """Scan the model source named in the task record, without importing it, for the entries users
    call, the Python control plane and the CUDA-only sites; null when the driver names no source
    package.

    Reads the installed package or a checkout with Python's ast. Reports with file:line evidence:
    the builder functions and their signatures (the configured builder must exist), the classes
    users call (those defining the driver's entry methods) and the request types their dispatchers
    route (e.g. start_session, add_prompt, propagate_in_video) with the method each calls, the
    Python control plane (tokenizer, session store, frame cache, object-id bookkeeping, prompt
    management) and the CUDA-only sites (.cuda(), device="cuda", pin_memory, triton, flash
    attention, CUDA autocast, CUDA device queries, bf16 casts) as portability findings. Findings
    the portability layer already saw at run time (merged by the profile run) are kept. Writes the
    field `inventory` of the task record.
    """
    from omskills.stages.inventory import take_inventory

    return take_inventory(Path(task))


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(inventory_entries))
