"""Run a batched call in pieces: on ONNX Runtime when the whole batch does not fit in memory, on an
OM when the batch is not one of the gears ATC compiled.

On the CPU, ONNX Runtime materialises every attention score matrix: a full-scale ViT
backbone called on 4 frames needs more than 24 GB, where PyTorch's fused attention needs a
fraction. A candidate whose ATC strategy is `dynamic_batch_size` computes each batch item on
its own, so ONNX Runtime can run the call as chunks of at most `max_batch` items and concatenate
the outputs. The OM keeps its gears: on the NPU the whole batch runs as one call.

Whether the candidate really is item-wise is not assumed: the chunked run is compared with the
PyTorch reference of the whole batch (the captured samples), like any other probe.

An OM built with batch gears (`--dynamic_batch_size="1,4"`) runs only those sizes. A call of
another size is served as gear-sized calls: `gear_plan` picks the chunks that pad the fewest
items (then the fewest calls); a chunk smaller than every gear is padded by repeating its last
item, and the padded rows are cut from the outputs. A call of 3 with gears 1 and 4 runs as 1+1+1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from omskills.errors import OmskillsError
from omskills.records.contracts import ContractSpec, ShapeStrategy
from omskills.records.toolchain import BatchSplit
from omskills.runtime.base import BackendInputError, IOSpec, Runner


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


@dataclass(frozen=True)
class Chunk:
    size: int  # items of the call in this chunk
    gear: int  # the size the backend runs (size + padding)


def gear_plan(batch: int, gears: Sequence[int]) -> list[Chunk]:
    """Gear-sized chunks covering `batch` items: fewest padded items first, then fewest calls."""
    sizes = sorted({g for g in gears if g >= 1})
    if not sizes:
        raise OmskillsError(f"batch gears: {list(gears)} has no size >= 1")
    # best[n]: (padded items, calls, chunks) for n items; built up from 0.
    best: list[tuple[int, int, list[Chunk]]] = [(0, 0, [])]
    for n in range(1, batch + 1):
        options = []
        for gear in sizes:
            if gear <= n:
                padded, calls, chunks = best[n - gear]
                options.append((padded, calls + 1, chunks + [Chunk(gear, gear)]))
            else:  # the last chunk, padded up to this gear
                options.append((gear - n, 1, [Chunk(n, gear)]))
        best.append(min(options, key=lambda option: option[:2]))
    return sorted(best[batch][2], key=lambda chunk: chunk.size != chunk.gear)  # the padded one last


class SplitBatchBackend(Runner):
    """A runner that runs a call on another runner in chunks: of at most `split.max_batch` items,
    or, with `gears`, of gear sizes only (see the module doc)."""

    def __init__(self, backend: Runner, split: BatchSplit, gears: Sequence[int] | None = None) -> None:
        self.backend = backend
        self.split = split
        self.gears = sorted(set(gears)) if gears else None
        self.kind = backend.kind
        self.chunked_calls = 0  # calls that were split or padded
        self.chunk_sizes: list[list[int]] = []  # per chunked call, the gear each chunk ran

    @property
    def any_size_inputs(self) -> frozenset[str]:
        """Inputs whose batch axis takes any size here (the gears serve it), for the splice's shape rule."""
        return frozenset(self.split.input_axes) if self.gears else frozenset()

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
        if self.gears:
            return f"{self.backend.describe()}, batch served by gears {self.gears}"
        return f"{self.backend.describe()}, batch in chunks of {self.split.max_batch}"

    def activate(self) -> SplitBatchBackend:
        self.backend.activate()
        return self

    def close(self) -> None:
        self.backend.close()

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        batch = self._batch_of(feeds)
        chunks = self._plan(batch)
        if not chunks or (len(chunks) == 1 and chunks[0].gear == batch):
            return self.backend.run(feeds)
        self.chunked_calls += 1
        self.chunk_sizes.append([chunk.gear for chunk in chunks])
        parts, start = [], 0
        for chunk in chunks:
            produced = self.backend.run(self._chunk(feeds, start, chunk))
            parts.append({name: self._unpadded(name, value, chunk) for name, value in produced.items()})
            start += chunk.size
        return {name: self._joined(name, [part[name] for part in parts]) for name in parts[0]}

    def _plan(self, batch: int) -> list[Chunk]:
        if self.gears:
            return gear_plan(batch, self.gears)
        step = self.split.max_batch
        return [Chunk(min(step, batch - start), min(step, batch - start)) for start in range(0, batch, step)]

    def _batch_of(self, feeds: Mapping[str, np.ndarray]) -> int:
        sizes = {name: feeds[name].shape[axis] for name, axis in self.split.input_axes.items() if name in feeds}
        if not sizes:
            raise BackendInputError(f"batch split: none of the batched inputs {sorted(self.split.input_axes)} is fed")
        if len(set(sizes.values())) > 1:
            raise BackendInputError(f"batch split: the batched inputs disagree on the batch size: {sizes}")
        return next(iter(sizes.values()))

    def _chunk(self, feeds: Mapping[str, np.ndarray], start: int, chunk: Chunk) -> dict[str, np.ndarray]:
        return {
            name: _take(value, self.split.input_axes[name], start, chunk) if name in self.split.input_axes else value
            for name, value in feeds.items()
        }

    def _unpadded(self, name: str, value: np.ndarray, chunk: Chunk) -> np.ndarray:
        if chunk.size == chunk.gear or name not in self.split.output_axes:
            return value
        return _take(value, self.split.output_axes[name], 0, Chunk(chunk.size, chunk.size))

    def _joined(self, name: str, pieces: Sequence[np.ndarray]) -> np.ndarray:
        if name not in self.split.output_axes:
            raise OmskillsError(f"batch split: output {name!r} has no batch axis to join its chunks on")
        return np.concatenate(pieces, axis=self.split.output_axes[name])


def _take(array: np.ndarray, axis: int, start: int, chunk: Chunk) -> np.ndarray:
    """Items start .. start+chunk.size along `axis`, the last one repeated up to chunk.gear."""
    rows = np.arange(start, start + chunk.gear).clip(max=start + chunk.size - 1)
    return np.ascontiguousarray(np.take(array, rows, axis=axis))
