"""Tool: write the adaptation's delivery document from the task record."""

from pathlib import Path

from omskills.host.toolkit import WorkspacePath
from omskills.stages.delivery import write_delivery_doc as _write
from pydantic import BaseModel


class DeliveryDoc(BaseModel):
    path: str
    text: str


def write_delivery_doc(task: WorkspacePath) -> DeliveryDoc:
    """Render DELIVERY.md next to the task record: the boundary (candidates, I/O, shape strategy, what
    stays in Python), the environment, the commands (adapt, ATC per candidate), the main path with
    the backend that ran each candidate and every fallback, the output checks per step, and the
    known limits (random weights, OM not built, candidates left in PyTorch)."""
    path = _write(Path(task))
    return DeliveryDoc(path=str(path), text=path.read_text())


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(write_delivery_doc))
