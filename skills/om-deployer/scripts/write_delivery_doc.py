"""Tool: write the adaptation's delivery document from the task record."""

from __future__ import annotations

from pathlib import Path

from omskills.host.toolkit import TaskPath, tool_hints
from pydantic import BaseModel, Field


class DeliveryDoc(BaseModel):
    path: str = Field(description="Where DELIVERY.md was written (next to the task record).")
    text: str = Field(description="The document's Markdown text.")


# destructive: DELIVERY.md is rewritten whole, and users edit it.
@tool_hints(title="Write the delivery document", read_only=False, destructive=True, idempotent=True)
def write_delivery_doc(task: TaskPath) -> DeliveryDoc:
    """Render DELIVERY.md next to the task record: what was adapted, how to rebuild and run it, and
    its known limits.

    Covers the boundary (candidates, I/O, shape strategy, what stays in Python), the environment,
    the commands (adapt, ATC per candidate), the main path with the backend that ran each candidate
    and every fallback, the output checks per step, and the known limits (random weights, OM not
    built, candidates left in PyTorch). Rewrites the document on every call."""
    from omskills.stages.delivery import write_delivery_doc as _write

    path = _write(Path(task))
    return DeliveryDoc(path=str(path), text=path.read_text())


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(write_delivery_doc))
