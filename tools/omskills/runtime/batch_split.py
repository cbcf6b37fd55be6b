"""Run a batched call in pieces: on ONNX Runtime when the whole batch does not fit in memory, and
on every backend when the batch is not one of the gears ATC compiled.

On the CPU, ONNX Runtime materialises every attention score matrix: a full-scale ViT
backbone called on 4 frames needs more than 24 GB, where PyTorch's fused attention needs a
fraction. A candidate whose ATC strategy is `dynamic_batch_size` computes each batch item on
its own, so ONNX Runtime can run the call as chunks of at most `max_batch` items and concatenate
the outputs.

Whether the candidate really is item-wise is not assumed: the chunked run is compared with the
PyTorch reference of the whole batch (the captured samples), like any other probe.

An OM built with batch gears (`--dynamic_batch_size="1,4"`) runs only those sizes. A call of
another size, between the gears or beyond the largest, is served as gear-sized calls: `gear_plan`
picks the chunks that pad the fewest items (then the fewest calls); a chunk smaller than every
gear is padded by repeating its last item, and the padded rows are cut from the outputs. A call of
3 with gears 1 and 4 runs as 1+1+1; 17 with gears 4..10 as 10+7. ONNX Runtime serves the graph
the same way (`served_in_gears`), so it runs the sizes the OM runs and verify computes what
deploys. Each output is joined along the dim that follows the batch (`contracts.batch_axes`, not
necessarily its first); a graph with an output that has none is left to run its gears only, and so
is one whose batch items were not found independent (`runtime.batch_independence`, checked by
probe_onnx; unchecked in a record written before): the runner says why in `unsplit`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from omskills.contracts.batch_axes import batch_axes, batch_gears
from omskills.errors import OmskillsError
from omskills.records.contracts import ContractSpec, ShapeStrategy
from omskills.records.deploy import DeployedGraph
from omskills.records.toolchain import BATCH_INDEPENDENCE_UNCHECKED, BatchSplit
from omskills.runtime.base import BackendInputError, HeldOutput, IOSpec, Runner


def batch_split_for(
    contract: ContractSpec, strategy: ShapeStrategy | None, max_batch: int, reason: str
) -> BatchSplit | None:
    """How to split this candidate's batch, or None when its outputs do not all follow the batch
    (`contracts.batch_axes` says why)."""
    axes = batch_axes(contract, strategy)
    if isinstance(axes, str):
        return None
    return BatchSplit(max_batch=max_batch, input_axes=axes.inputs, output_axes=axes.outputs, reason=reason)


def unsplit_reason(graph: DeployedGraph) -> str | None:
    """Why a call of this graph cannot be split into gear-sized calls, or None when it can: an
    output off the batch (`contracts.batch_axes`), or batch items not found independent."""
    axes = batch_axes(graph.contract, graph.strategy)
    if isinstance(axes, str):
        return axes
    checked = graph.batch_independence
    if checked is None:
        return BATCH_INDEPENDENCE_UNCHECKED
    return None if checked.independent else checked.reason


def served_in_gears(
    runner: Runner, graph: DeployedGraph, reason: str, memory: BatchSplit | None = None
) -> Runner | None:
    """`runner` serving any batch as calls of the graph's batch gears, or None when the graph has no
    batch gears or its calls cannot be split (then `runner.unsplit` says why). `memory`: the chunks
    ONNX Runtime's memory allows (probe_onnx's split), so no gear above them runs."""
    gears = [gear for gear in batch_gears(graph.strategy) if memory is None or gear <= memory.max_batch]
    if not gears:
        return None
    why = unsplit_reason(graph)
    split = batch_split_for(graph.contract, graph.strategy, max(gears), reason) if why is None else None
    if split is None:
        runner.unsplit = why
        return None
    return SplitBatchBackend(runner, memory or split, gears=gears)


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
    def unsplit(self) -> str | None:  # type: ignore[override]
        """Why the runner beneath does not serve other batches as gear-sized calls (when it does not)."""
        return getattr(self.backend, "unsplit", None)

    @unsplit.setter
    def unsplit(self, why: str | None) -> None:
        self.backend.unsplit = why

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

    def run(self, feeds: Mapping[str, np.ndarray], fetch: Collection[str] | None = None) -> dict[str, Any]:
        chunks = self._chunks(feeds)
        if chunks is None:
            return self.backend.run(feeds, fetch)
        return self._run_chunks(feeds, chunks, fetch)

    @property
    def holds_values(self) -> bool:
        """Whether the runner beneath keeps outputs as the runtime's own values (`run_values`)."""
        return bool(getattr(self.backend, "holds_values", False))

    def run_values(self, feeds: Mapping[str, object], fetch: Collection[str] | None = None) -> dict[str, object]:
        """`run_values` of the runner beneath for a call that runs whole. A call run in chunks is
        joined on the host, so its outputs come back as arrays, which the splice hands on as such."""
        arrays = {name: _host_array(value) for name, value in feeds.items()}
        chunks = self._chunks(arrays)
        if chunks is None:
            return self.backend.run_values(feeds, fetch)  # type: ignore[attr-defined]
        return dict(self._run_chunks(arrays, chunks, fetch))

    def _chunks(self, feeds: Mapping[str, np.ndarray]) -> list[Chunk] | None:
        """The chunks this call runs as, or None when it runs whole."""
        batch = self._batch_of(feeds)
        chunks = self._plan(batch)
        return None if not chunks or (len(chunks) == 1 and chunks[0].gear == batch) else chunks

    def _run_chunks(
        self, feeds: Mapping[str, np.ndarray], chunks: list[Chunk], fetch: Collection[str] | None
    ) -> dict[str, Any]:
        self.chunked_calls += 1
        self.chunk_sizes.append([chunk.gear for chunk in chunks])
        parts, start = [], 0
        for chunk in chunks:
            produced = self.backend.run(self._chunk(feeds, start, chunk), fetch)
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

    def _unpadded(self, name: str, value: Any, chunk: Chunk) -> Any:
        if chunk.size == chunk.gear or name not in self.split.output_axes:
            return value
        axis, kept = self.split.output_axes[name], Chunk(chunk.size, chunk.size)
        if isinstance(value, HeldOutput):  # cut when it is copied back, if ever
            shape = tuple(chunk.size if k == axis else d for k, d in enumerate(value.shape))
            return HeldOutput(shape, lambda: _take(value.copy_back(), axis, 0, kept))
        return _take(value, axis, 0, kept)

    def _joined(self, name: str, pieces: Sequence[Any]) -> Any:
        if name not in self.split.output_axes:
            raise OmskillsError(f"batch split: output {name!r} has no batch axis to join its chunks on")
        axis = self.split.output_axes[name]
        if any(isinstance(piece, HeldOutput) for piece in pieces):  # each piece stays where it is until read
            shape = list(pieces[0].shape)
            shape[axis] = sum(piece.shape[axis] for piece in pieces)
            return HeldOutput(tuple(shape), lambda: np.concatenate([_copied(piece) for piece in pieces], axis=axis))
        return np.concatenate(pieces, axis=axis)


def _copied(value: Any) -> np.ndarray:
    return value.copy_back() if isinstance(value, HeldOutput) else value


def _host_array(value: object) -> np.ndarray:
    """A feed as a host array: an array as it is, a runtime value (an OrtValue) as the array viewing it."""
    return value if isinstance(value, np.ndarray) else value.numpy()  # type: ignore[attr-defined]


def _take(array: np.ndarray, axis: int, start: int, chunk: Chunk) -> np.ndarray:
    """Items start .. start+chunk.size along `axis`, the last one repeated up to chunk.gear."""
    rows = np.arange(start, start + chunk.gear).clip(max=start + chunk.size - 1)
    return np.ascontiguousarray(np.take(array, rows, axis=axis))
