"""Run a batched call on ONNX Runtime in pieces, when the whole batch does not fit in memory.

On the CPU, ONNX Runtime materialises every attention score matrix: a full-scale ViT
backbone called on 4 frames needs more than 24 GB, where PyTorch's fused attention needs a
fraction. A candidate whose ATC strategy is `dynamic_batch_size` computes each batch item on
its own, so ONNX Runtime can run the call as chunks of at most `max_batch` items and concatenate
the outputs. The OM keeps its gears: on the NPU the whole batch runs as one call.

Whether the candidate really is item-wise is not assumed: the chunked run is compared with the
PyTorch reference of the whole batch (the captured samples), like any other probe.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from omskills.errors import OmskillsError
from omskills.records.contracts import ContractSpec, ShapeStrategy
from omskills.records.toolchain import BatchSplit
from omskills.runtime.base import BackendInputError, IOSpec, RuntimeBackend


def open_onnxruntime(path: str | Path, split: BatchSplit | None) -> RuntimeBackend | SplitBatchBackend:
    """An ONNX Runtime session on `path`, running the batch in chunks when `split` is given."""
    from omskills.runtime import open_backend

    backend = open_backend(path, "onnxruntime")
    return SplitBatchBackend(backend, split) if split is not None else backend


def batch_split_for(
    contract: ContractSpec, strategy: ShapeStrategy | None, max_batch: int, reason: str
) -> BatchSplit | None:
    """How to split this candidate's batch, or None when its outputs do not all follow the batch.

    The batch is dim 0 of the inputs a `dynamic_batch_size` strategy makes dynamic; an output
    follows it when its dim 0 equals the batch in every observed call.
    """
    if strategy is None or strategy.kind != "dynamic_batch_size":
        return None
    batched = [spec for spec in contract.inputs if strategy.input_shapes.get(spec.name, [None])[0] == -1]
    if not batched:
        return None
    first = contract.input_index(batched[0].name)
    shapes = contract.call_shapes
    if not shapes or any(len(call.outputs) != len(contract.outputs) for call in shapes):
        return None
    for index in range(len(contract.outputs)):
        if any(not call.outputs[index] or call.outputs[index][0] != call.inputs[first][0] for call in shapes):
            return None
    return BatchSplit(
        max_batch=max_batch,
        input_axes={spec.name: 0 for spec in batched},
        output_axes={spec.name: 0 for spec in contract.outputs},
        reason=reason,
    )


class SplitBatchBackend:
    """A backend that runs calls larger than `split.max_batch` in chunks (see the module doc)."""

    def __init__(self, backend: RuntimeBackend, split: BatchSplit) -> None:
        self.backend = backend
        self.split = split
        self.kind = backend.kind
        self.chunked_calls = 0  # calls that were split

    @property
    def device(self) -> str:
        return self.backend.device

    @property
    def inputs(self) -> list[IOSpec]:
        return self.backend.inputs

    @property
    def outputs(self) -> list[IOSpec]:
        return self.backend.outputs

    def describe(self) -> str:
        return f"{self.backend.describe()}, batch in chunks of {self.split.max_batch}"

    def __enter__(self) -> SplitBatchBackend:
        self.backend.activate()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.backend.close()

    def close(self) -> None:
        self.backend.close()

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        batch = self._batch_of(feeds)
        if batch <= self.split.max_batch:
            return self.backend.run(feeds)
        self.chunked_calls += 1
        parts = [self.backend.run(self._chunk(feeds, start)) for start in range(0, batch, self.split.max_batch)]
        return {name: self._joined(name, [part[name] for part in parts]) for name in parts[0]}

    def _batch_of(self, feeds: Mapping[str, np.ndarray]) -> int:
        sizes = {name: feeds[name].shape[axis] for name, axis in self.split.input_axes.items() if name in feeds}
        if not sizes:
            raise BackendInputError(f"batch split: none of the batched inputs {sorted(self.split.input_axes)} is fed")
        if len(set(sizes.values())) > 1:
            raise BackendInputError(f"batch split: the batched inputs disagree on the batch size: {sizes}")
        return next(iter(sizes.values()))

    def _chunk(self, feeds: Mapping[str, np.ndarray], start: int) -> dict[str, np.ndarray]:
        stop = start + self.split.max_batch
        return {name: _take(value, self.split.input_axes[name], start, stop) if name in self.split.input_axes else value
                for name, value in feeds.items()}

    def _joined(self, name: str, pieces: Sequence[np.ndarray]) -> np.ndarray:
        if name not in self.split.output_axes:
            raise OmskillsError(f"batch split: output {name!r} has no batch axis to join its chunks on")
        return np.concatenate(pieces, axis=self.split.output_axes[name])


def _take(array: np.ndarray, axis: int, start: int, stop: int) -> np.ndarray:
    index = [slice(None)] * array.ndim
    index[axis] = slice(start, stop)
    return np.ascontiguousarray(array[tuple(index)])
