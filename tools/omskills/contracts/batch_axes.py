"""Where the batch lies in a graph's inputs and outputs, when its shape strategy has batch gears.

A graph built with `dynamic_batch_size` gears runs only those batch sizes; any other batch can be
served as gear-sized calls whose outputs are joined again, but only when every output carries the
batch on one dim. That dim need not be the first: an LSTM returns its output batch-first and its
hidden states as (layers, batch, hidden). It is read from the calls the study saw: the one dim of
the output whose size equals the call's batch in every call. An output with no such dim (a sum
over the batch, a fixed-size state) or with several (a batch x batch mask) cannot be joined, and
the reason says which.

Only shapes are read here; whether each batch item is computed on its own is what batch gears and
chunks both assume (ATC's own batching does not).
"""

from __future__ import annotations

from dataclasses import dataclass

from omskills.records.contracts import CallShape, ContractSpec, ShapeStrategy


@dataclass(frozen=True)
class BatchAxes:
    inputs: dict[str, int]  # batched input -> its batch dim (the -1 of the strategy)
    outputs: dict[str, int]  # every output -> the dim that follows the batch


def batch_gears(strategy: ShapeStrategy | None) -> list[int]:
    """The batch sizes a `dynamic_batch_size` strategy compiles, smallest first; [] for any other."""
    if strategy is None or strategy.kind != "dynamic_batch_size":
        return []
    return sorted({gear[0] for gear in strategy.gears if gear})


def batch_axes(contract: ContractSpec, strategy: ShapeStrategy | None) -> BatchAxes | str:
    """The batch dim of every batched input and of every output, or why a call of this graph cannot
    be split along its batch (one line, naming the output at fault)."""
    if strategy is None or not batch_gears(strategy):
        return "its shape strategy has no batch gears"
    inputs = {spec.name: 0 for spec in contract.inputs if (strategy.input_shapes.get(spec.name) or [None])[0] == -1}
    calls = contract.call_shapes
    if not inputs:
        return "no input has a dynamic batch dim"
    if not calls or any(len(call.outputs) != len(contract.outputs) for call in calls):
        return "the calls the study saw do not all return every output"
    first = contract.input_index(next(iter(inputs)))
    batches = [call.inputs[first][0] for call in calls]
    outputs: dict[str, int] = {}
    for index, spec in enumerate(contract.outputs):
        dims = _dims_following(index, calls, batches)
        if len(dims) != 1:
            return f"output {spec.name} " + (
                f"has several dims of the batch's size in every call ({dims}), none known to be the batch"
                if dims
                else "has no dim that follows the batch (it reduces over the batch, or is fixed)"
            )
        outputs[spec.name] = dims[0]
    return BatchAxes(inputs, outputs)


def _dims_following(index: int, calls: list[CallShape], batches: list[int]) -> list[int]:
    """The dims of output `index` whose size is the call's batch in every call (none when its rank varies)."""
    ranks = {len(call.outputs[index]) for call in calls}
    if len(ranks) != 1:
        return []
    follows = [[size == batch for size in call.outputs[index]] for call, batch in zip(calls, batches)]
    return [dim for dim in range(ranks.pop()) if all(row[dim] for row in follows)]
