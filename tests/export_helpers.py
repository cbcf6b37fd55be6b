"""A toy candidate for the export and splice tests, and its contract captured on a real run.

`Head` takes a tensor, a tuple of tensors and two keyword constants, and returns a dict with a
tuple inside and a non-tensor constant: the shapes of call that SAM's modules make. `Host` is the
model around it, the way a predictor holds its candidates (`host.head`).
"""

from __future__ import annotations

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

    def forward(self, x: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor], *, scale: float = 1.0,
                mode: str = "sum") -> dict:
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
