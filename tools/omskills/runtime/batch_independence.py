"""Whether a graph computes each batch item on its own, checked before a batch is served in pieces.

A batch that is no gear runs as gear-sized calls joined along each output's batch dim
(runtime.batch_split), which gives the whole batch's answer only when no item reads another: a
graph with attention across the batch, batch statistics (`x - x.mean(0)`) or an output summed over
the batch into another would silently answer a split batch wrongly. Shapes do not tell
(`contracts.batch_axes` reads shapes only), so probe_onnx runs the exported graph on ONNX Runtime:
two items of a captured sample together, then each alone, and compares every output of the pair
with the joined items under the parity check's pass gate. A sample of one item is paired with a
perturbed copy of itself (floats shifted, integers rolled along their last dim), so an item that
reads the other shows. Cheap: three runs of at most two items, on a graph already loaded for the probe.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
from omskills.compare.parity import compare_outputs
from omskills.contracts.batch_axes import BatchAxes, batch_axes
from omskills.errors import one_line
from omskills.records.contracts import ContractSpec, ShapeStrategy
from omskills.records.toolchain import BATCH_INDEPENDENCE_UNCHECKED, BatchIndependence
from omskills.runtime.base import Runner

UNCHECKED = BATCH_INDEPENDENCE_UNCHECKED


def check_batch_independence(
    path: Path, feeds: Mapping[str, np.ndarray], contract: ContractSpec, strategy: ShapeStrategy | None
) -> BatchIndependence | None:
    """Run the graph at `path` on the pair and on each item of `feeds` (a captured call's inputs);
    None when its calls could not be split anyway (no batch gears, an output off the batch)."""
    from omskills.runtime.onnxruntime_backend import OnnxRuntimeBackend

    axes = batch_axes(contract, strategy)
    if isinstance(axes, str):
        return None
    with OnnxRuntimeBackend(path).activate() as runner:
        return batch_items_independent(runner, feeds, axes)


def batch_items_independent(runner: Runner, feeds: Mapping[str, np.ndarray], axes: BatchAxes) -> BatchIndependence:
    """Outputs of two items run together against the same items run one by one and joined."""
    wanted = {spec.name for spec in runner.inputs}
    feeds = {name: np.asarray(value) for name, value in feeds.items() if name in wanted}
    batched = {name: axis for name, axis in axes.inputs.items() if name in feeds}
    if not batched:
        return BatchIndependence(independent=False, reason=f"{UNCHECKED}: no batched input is fed")
    batch = next(feeds[name].shape[axis] for name, axis in batched.items())
    pair = {name: _pair(value, batched[name], batch) if name in batched else value for name, value in feeds.items()}
    tiled = " (its one item paired with a perturbed copy)" if batch == 1 else ""
    try:
        whole = runner.run(pair)
        items = [runner.run(_item(pair, batched, k)) for k in (0, 1)]
    except Exception as err:  # a graph that does not run one item: nothing is known, so nothing is split
        return BatchIndependence(independent=False, reason=f"{UNCHECKED}: {one_line(err)}")
    joined = {name: _joined(name, [item[name] for item in items], axes) for name in whole if name in axes.outputs}
    report = compare_outputs({name: np.asarray(value) for name, value in whole.items() if name in joined}, joined)
    worst = max(report.outputs, key=lambda parity: (parity.verdict != "pass", parity.max_abs or 0.0), default=None)
    if worst is not None and worst.verdict != "pass":
        return BatchIndependence(
            independent=False,
            reason=f"batch items interact: {worst.name} differs by {worst.max_abs:.3g} when the batch is split "
            f"(2 items of a captured call{tiled} run together and one by one)",
        )
    largest = f", largest difference {worst.max_abs:.3g} ({worst.name})" if worst is not None else ""
    return BatchIndependence(
        independent=True,
        reason=f"2 items of a captured call{tiled} run together and one by one give the same outputs{largest}",
    )


def _pair(value: np.ndarray, axis: int, batch: int) -> np.ndarray:
    """The first two items along `axis`; one item followed by a perturbed copy of it."""
    if batch >= 2:
        return np.ascontiguousarray(np.take(value, [0, 1], axis=axis))
    item = np.take(value, [0], axis=axis)
    if value.dtype.kind in "fc":
        scale = float(np.abs(item).mean()) if item.size else 0.0
        noise = np.random.default_rng(0).standard_normal(item.shape)
        other = (item + (scale or 1.0) * 0.5 * noise).astype(value.dtype)
    elif item.ndim > 0 and item.shape[-1] > 1:
        other = np.roll(item, 1, axis=-1)  # the same values (token ids stay valid), elsewhere
    else:
        other = item
    return np.ascontiguousarray(np.concatenate([item, other], axis=axis))


def _item(feeds: Mapping[str, np.ndarray], batched: Mapping[str, int], k: int) -> dict[str, np.ndarray]:
    return {
        name: np.ascontiguousarray(np.take(value, [k], axis=batched[name])) if name in batched else value
        for name, value in feeds.items()
    }


def _joined(name: str, pieces: list, axes: BatchAxes) -> np.ndarray:
    return np.concatenate([np.asarray(piece) for piece in pieces], axis=axes.outputs[name])
