"""A graph's fp32 tensors against the same tensors observed in another run: an OM's dump from
an NPU, or the PyTorch module's outputs.

The other run's tensors arrive as `Observed` entries, each naming the ONNX node output it stands
for. The ONNX graph runs in fp32 on the same inputs and every observed tensor is compared with
its fp32 value. For the first one over the gate, the region that computes it (the node itself
for a dump, the module's nodes for PyTorch) is run once more on the other run's own inputs of
that region, where the other run kept them: still over the gate, the error is local to the
region; under it, the region's inputs already carried it (accumulated). Without those inputs
the origin stays undetermined.

ONNX Runtime returns only the outputs asked for and frees the rest as it goes, so the fp32
tensors are fetched in groups that fit a byte budget, one graph run per group.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
from omskills.ascend.emulation import (
    MAX_FLAGGED_LISTED,
    PreparedGraph,
    badness,
    crosses,
    has_subgraph,
    passes_output_gate,
    run_beside,
    session_beside,
    tensor_error,
    with_nodes,
)
from omskills.records.precision import LayerComparison, LayerFinding, NodeComparison, PrecisionGates, TensorError
from onnx import NodeProto, helper

DEFAULT_BUDGET_BYTES = 1 << 30
MAX_NOTES = 20

Loader = Callable[[], np.ndarray]


@dataclass
class Observed:
    """One node output as another run computed it."""

    node: str  # the ONNX node it stands for
    index: int  # which of that node's outputs
    source: str  # where it came from: a dump file, a module path
    load: Loader
    nbytes: int  # its size, to group the fp32 fetches
    # The nodes that compute it from `region_inputs` (default: the node alone), and the other
    # run's own values of the ONNX tensors entering that region.
    region: list[str] = field(default_factory=list)
    region_inputs: dict[str, Loader] = field(default_factory=dict)


def align(observed: np.ndarray, reference: np.ndarray) -> np.ndarray | None:
    """`observed` in `reference`'s shape and dtype, or None when it cannot be: the same shape;
    NC1HWC0 (Ascend's 5-D layout, channels padded to C0) for an NCHW tensor; else the same
    element count in row-major order."""
    observed = np.asarray(observed).astype(reference.dtype, copy=False)
    if observed.shape == reference.shape:
        return observed
    if observed.ndim == 5 and reference.ndim == 4:
        n, c1, h, w, c0 = observed.shape
        if (n, h, w) == (reference.shape[0], *reference.shape[2:]) and c1 * c0 >= reference.shape[1]:
            return observed.transpose(0, 1, 4, 2, 3).reshape(n, c1 * c0, h, w)[:, : reference.shape[1]]
    if observed.size == reference.size:
        return observed.reshape(reference.shape)
    return None


def numpy_stat(reference: np.ndarray, observed: np.ndarray) -> np.ndarray:
    """The nine numbers `tensor_error` reads, as the comparison graph computes them (sums and
    maxima over the elements finite in both), here in numpy."""
    ref, obs = reference.astype(np.float64, copy=False), observed.astype(np.float64, copy=False)
    both = np.isfinite(ref) & np.isfinite(obs)
    ref_f, obs_f = np.where(both, ref, 0.0), np.where(both, obs, 0.0)
    diff = obs_f - ref_f
    return np.array(
        [
            np.sum(diff * diff),
            np.sum(ref_f * ref_f),
            np.sum(obs_f * obs_f),
            np.max(np.abs(diff), initial=0.0),
            np.max(np.abs(ref_f), initial=0.0),
            np.isinf(obs).sum(),
            np.isnan(obs).sum(),
            np.isinf(ref).sum(),
            np.isnan(ref).sum(),
        ]
    )


@dataclass
class _Matched:
    observed: Observed
    tensor: str
    order: int


def compare_observed(
    prepared: PreparedGraph,
    observed: list[Observed],
    feeds: Mapping[str, np.ndarray],
    *,
    reference: str,
    candidate: str,
    backend: str,
    gates: PrecisionGates | None = None,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    notes: list[str] | None = None,
) -> LayerComparison:
    """fp32 ONNX on `feeds` against `observed`, node by node (see the module's docstring)."""
    gates = gates or PrecisionGates()
    notes = list(notes or [])
    matched, unmatched = _match(prepared, observed, notes)
    errors: dict[int, TensorError] = {}
    model = with_nodes(
        prepared.model,
        list(prepared.graph.node),
        [helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None) for t in _unique(m.tensor for m in matched)],
    )
    with session_beside(prepared.path, model) as session:
        wanted = {i.name for i in session.get_inputs()}
        fed = {k: v for k, v in feeds.items() if k in wanted}
        for group in _groups(matched, budget_bytes):
            names = _unique(m.tensor for m in group)
            values = dict(zip(names, session.run(names, fed)))
            for m in group:
                ref = values[m.tensor]
                obs = align(m.observed.load(), ref)
                if obs is None:
                    unmatched += 1
                    _note(notes, f"{m.observed.source}: shape cannot be brought to {m.tensor}'s {list(ref.shape)}")
                    continue
                errors[id(m)] = tensor_error(m.tensor, numpy_stat(ref, obs))
    nodes = _node_comparisons(prepared, matched, errors, gates)
    flagged = [n for n in nodes if n.flagged]
    first = None
    if flagged:
        worst_of_first = min(
            (m for m in matched if m.observed.node == flagged[0].node and id(m) in errors),
            key=lambda m: badness(errors[id(m)]),
        )
        flagged[0] = flagged[0].model_copy(update={"local": _region_error(prepared, worst_of_first, fed)})
        first = _finding(flagged[0], gates)
    outputs = [
        errors[id(m)] for m in matched if id(m) in errors and m.tensor in {o.name for o in prepared.graph.output}
    ]
    # With graph outputs observed they decide; without (a dump of inner nodes only), every node must pass.
    outputs_pass = all(passes_output_gate(e, gates) for e in outputs) if outputs else not flagged
    return LayerComparison(
        model=str(prepared.path),
        reference=reference,
        candidate=candidate,
        backend=backend,
        nodes_compared=len(nodes),
        nodes_flagged=len(flagged),
        first=first,
        outputs=outputs,
        outputs_pass=outputs_pass,
        overflow=sum(n.worst.overflow for n in nodes),
        unmatched=unmatched,
        notes=notes,
        flagged=sorted(flagged, key=lambda n: n.worst.cosine)[:MAX_FLAGGED_LISTED],
    )


def _match(prepared: PreparedGraph, observed: list[Observed], notes: list[str]) -> tuple[list[_Matched], int]:
    order = {n.name: k for k, n in enumerate(prepared.graph.node)}
    matched, unmatched = [], 0
    for ob in observed:
        node = prepared.node_named.get(ob.node)
        tensor = node.output[ob.index] if node is not None and ob.index < len(node.output) else None
        if tensor is None or tensor not in prepared.float_tensors:
            unmatched += 1
            _note(notes, f"{ob.source}: no float output {ob.index} of a node named {ob.node!r}")
            continue
        matched.append(_Matched(observed=ob, tensor=tensor, order=order[ob.node]))
    return sorted(matched, key=lambda m: m.order), unmatched


def _groups(matched: list[_Matched], budget_bytes: int) -> list[list[_Matched]]:
    groups: list[list[_Matched]] = [[]]
    size = 0
    for m in matched:
        if groups[-1] and size + m.observed.nbytes > budget_bytes:
            groups.append([])
            size = 0
        groups[-1].append(m)
        size += m.observed.nbytes
    return [g for g in groups if g]


def _node_comparisons(
    prepared: PreparedGraph, matched: list[_Matched], errors: dict[int, TensorError], gates: PrecisionGates
) -> list[NodeComparison]:
    per_node: dict[str, list[_Matched]] = {}
    for m in matched:
        if id(m) in errors:
            per_node.setdefault(m.observed.node, []).append(m)
    result = []
    for name, entries in per_node.items():  # graph order: `matched` is sorted
        worst = min(entries, key=lambda m: badness(errors[id(m)]))
        error = errors[id(worst)]
        result.append(
            NodeComparison(
                node=name,
                op_type=prepared.node_named[name].op_type,
                source=worst.observed.source,
                worst=error,
                flagged=crosses(error, gates),
            )
        )
    return result


def _region_error(prepared: PreparedGraph, matched: _Matched, fed: Mapping[str, np.ndarray]) -> TensorError | None:
    """The region computing `matched`, run in fp32 on the other run's inputs of it, against
    the other run's output: None when the other run kept no input of the region."""
    ob = matched.observed
    names = set(ob.region or [ob.node])
    region = [n for n in prepared.graph.node if n.name in names]
    if not ob.region_inputs or any(has_subgraph(n) for n in region):
        return None
    entering = entering_tensors(region, {t.name for t in prepared.graph.initializer})
    given = {t: load for t, load in ob.region_inputs.items() if t in entering}
    if not given:
        return None
    graph_inputs = {i.name for i in prepared.graph.input}
    inner = [t for t in entering if t not in graph_inputs]
    values = {t: fed[t] for t in entering if t in graph_inputs}
    if inner:  # the fp32 values of what enters the region and the other run did not keep
        unknown = [t for t in inner if t not in prepared.elem_types]
        if unknown:
            return None
        outputs = [helper.make_tensor_value_info(t, prepared.elem_types[t], None) for t in inner]
        values.update(run_beside(prepared.path, with_nodes(prepared.model, list(prepared.graph.node), outputs), fed))
    for tensor, load in given.items():
        value = align(load(), values[tensor])
        if value is None:
            return None
        values[tensor] = value
    used = {i for n in region for i in n.input}
    model = with_nodes(
        prepared.model,
        region,
        [helper.make_tensor_value_info(matched.tensor, onnx.TensorProto.FLOAT, None)],
        inputs=[
            helper.make_tensor_value_info(t, helper.np_dtype_to_tensor_dtype(values[t].dtype), values[t].shape)
            for t in entering
        ],
        initializers=[t for t in prepared.graph.initializer if t.name in used],
    )
    out = run_beside(prepared.path, model, values)[matched.tensor]
    obs = align(ob.load(), out)
    return None if obs is None else tensor_error(matched.tensor, numpy_stat(out, obs))


def entering_tensors(region: list[NodeProto], weights: set[str]) -> list[str]:
    """Tensors the region reads and does not make, in order of first use (weights excluded)."""
    produced = {o for n in region for o in n.output}
    return _unique(i for n in region for i in n.input if i and i not in produced and i not in weights)


def _finding(node: NodeComparison, gates: PrecisionGates) -> LayerFinding:
    origin = "undetermined" if node.local is None else ("local" if crosses(node.local, gates) else "accumulated")
    return LayerFinding(node=node.node, op_type=node.op_type, origin=origin, worst=node.worst, local=node.local)


def _unique(items) -> list[str]:
    return list(dict.fromkeys(items))


def _note(notes: list[str], text: str) -> None:
    if len(notes) < MAX_NOTES:
        notes.append(text)
