"""A toy candidate for the export and splice tests, and its contract captured on a real run.

`Head` takes a tensor, a tuple of tensors and two keyword constants, and returns a dict with a
tuple inside and a non-tensor constant: the shapes of call that SAM's modules make. `Host` is the
model around it, the way a predictor holds its candidates (`host.head`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from omskills.contracts import capture_contracts
from omskills.records.contracts import ContractSpec
from torch import nn

# Batch sizes of the capture run: dim 0 of every input is dynamic with these observed values.
OBSERVED_BATCHES = (2, 5)


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(
        self, x: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor], *, scale: float = 1.0, mode: str = "sum"
    ) -> dict:
        y = self.lin(x) * scale
        reduced = y.sum(-1) if mode == "sum" else y.amax(-1)
        return {"y": y, "extra": (reduced, pair[0] + pair[1]), "best": y.argmax(-1), "n": 3}


class Host(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = Head()

    def forward(self, x: torch.Tensor, mode: str = "sum", scale: float = 2.0) -> dict:
        return self.head(x, (x[:, :3], x[:, 1:]), scale=scale, mode=mode)


def make_host() -> Host:
    torch.manual_seed(0)
    return Host().eval()


def capture_head_contract(host: Host) -> ContractSpec:
    """The head's contract, captured by the stage-2 engine on calls with the observed batches."""

    def run() -> None:
        with torch.no_grad():
            for batch in OBSERVED_BATCHES:
                host(torch.randn(batch, 4))

    [contract] = capture_contracts(host, {"head": "head"}, run)
    return contract


def head_inputs(batch: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """One call's tensor inputs in contract order: x, pair[0], pair[1]."""
    x = torch.randn(batch, 4, dtype=dtype)
    return [x, x[:, :3].contiguous(), x[:, 1:].contiguous()]


BATCH_DIMS = {"x": {0: "batch"}, "pair_0": {0: "batch"}, "pair_1": {0: "batch"}}


def one_graph_task(
    folder: Path,
    host: nn.Module,
    name: str,
    run: Callable[[], None],
    export_inputs: list[torch.Tensor],
    dynamic_dims: dict[str, dict[int, str]],
    task_id: str,
) -> Path:
    """A task record (folder/task.yaml) for one graph, `host.<name>`: its contract and samples
    captured while `run` calls the host, the shape strategy proposed from them, and its export."""
    from omskills.boundary.shape_strategy import propose_shape_strategy
    from omskills.convert.export import export_onnx
    from omskills.records.contracts import BoundaryDecision
    from omskills.records.task import TaskRecord, save_record

    [contract] = capture_contracts(host, {name: name}, run, samples_dir=folder / "samples", relative_to=folder)
    strategy = propose_shape_strategy(contract)
    exported = export_onnx(
        getattr(host, name), contract, export_inputs, folder / "onnx" / f"{name}.onnx", dynamic_dims=dynamic_dims
    )
    # a record holds run-relative paths only, as the export stage writes them
    exported.path = str(Path(exported.path).resolve().relative_to(folder.resolve()))
    exported.log_path = (
        str(Path(exported.log_path).resolve().relative_to(folder.resolve())) if exported.log_path else None
    )
    record = TaskRecord.model_validate(
        {
            "id": task_id,
            "intake": {
                "model": {"family": "sam3", "builder": "build_sam3_video_model", "scale": "tiny"},
                "inputs": {"video": "builtin:shapes", "prompt": "objects"},
                "target": {"soc": "Ascend310P3"},
            },
            "contracts": {name: contract},
            "boundaries": {
                name: BoundaryDecision(candidate=name, exportable=True, reasons=[], shape_strategy=strategy)
            },
            "exports": {name: exported},
        }
    )
    path = folder / "task.yaml"
    save_record(record, path)
    return path
