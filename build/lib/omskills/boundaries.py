"""Deployment boundaries (stage 2): what is graph, what stays in Python, and how shapes are fixed.

From a captured ContractSpec:
  * `analyze_boundary` gives an exportability verdict with reasons, the control plane that stays in
    Python (with the evidence), and exactly one ATC shape strategy;
  * `propose_shape_strategy` derives that strategy from the dims observed to vary across calls and
    from the ranges the model-family driver declares from the source (`QuantityLimit`), never from
    a single sample alone;
  * `suggest_merges` finds adjacent candidates that exchange tensors only with each other;
  * `render_contract_table` renders contracts and decisions as a Markdown table.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from omskills.contracts import pytree
from omskills.contracts.provenance import is_ancestor
from omskills.contracts.samples import load_sample
from omskills.errors import OmskillsError
from omskills.records.contracts import BoundaryDecision, ContractSpec, QuantityLimit, ShapeStrategy, TensorSpec

# ATC accepts 2..100 gears for --dynamic_batch_size, --dynamic_image_size and --dynamic_dims.
MIN_GEARS = 2
MAX_GEARS = 100
_COMPLEX = {"complex32", "complex64", "complex128", "complex"}

SourceLimits = dict[str, list[int]] | list[QuantityLimit]


# --------------------------------------------------------------------------- exportability


def _ranks_changing(contract: ContractSpec) -> list[str]:
    changing = []
    for index, spec in enumerate(contract.inputs):
        ranks = {len(shape.inputs[index]) for shape in contract.call_shapes if index < len(shape.inputs)}
        if len(ranks) > 1:
            changing.append(f"{spec.name} (ranks {sorted(ranks)})")
    return changing


def _exportability(contract: ContractSpec) -> tuple[bool, list[str]]:
    blockers: list[str] = []
    notes: list[str] = []
    if contract.structure_variants > 1:
        blockers.append(
            f"calls have {contract.structure_variants} different structures (tree spec or which leaves are "
            "tensors): one graph cannot serve them all; re-cut the candidate or split the calls"
        )
    if not contract.inputs:
        blockers.append("no tensor inputs after flattening: its outputs depend only on Python values")
    if not contract.outputs:
        blockers.append("no tensor outputs after flattening: nothing for a graph to return")
    for arg in contract.non_tensor_args:
        if not arg.constant:
            blockers.append(
                f"non-tensor argument {arg.tree_path} changes between calls ({arg.value_repr}): "
                "a graph would freeze it to one value"
            )
    for leaf in contract.non_tensor_outputs:
        if not leaf.constant:
            blockers.append(f"non-tensor output {leaf.tree_path} changes between calls ({leaf.value_repr})")
    for changing in _ranks_changing(contract):
        blockers.append(f"input {changing} changes rank between calls")
    for spec in contract.inputs + contract.outputs:
        if spec.dtype in _COMPLEX:
            blockers.append(f"tensor {spec.name} is {spec.dtype}: ONNX/ATC graphs have no complex tensors")

    if not blockers:
        notes.append(
            f"tensor-only after flattening: {len(contract.inputs)} tensor inputs, "
            f"{len(contract.outputs)} tensor outputs over {contract.calls} calls"
        )
    constants = [f"{a.tree_path}={a.value_repr}" for a in contract.non_tensor_args if a.constant]
    if constants:
        notes.append("constant non-tensor arguments are baked into the graph: " + ", ".join(constants))
    unknown = [s.name for s in contract.inputs if s.provenance is None or s.provenance.kind == "unknown"]
    if unknown:
        notes.append("origin not traced for inputs " + ", ".join(unknown) + " (created outside any hooked module)")
    return not blockers, blockers + notes


def _control_plane(contract: ContractSpec) -> list[str]:
    """What stays in Python around this candidate, each with the evidence from the contract."""
    plane: list[str] = []
    for spec in contract.inputs:
        source = spec.provenance.source if spec.provenance else None
        kind = spec.provenance.kind if spec.provenance else "unknown"
        if kind == "prompt":
            plane.append(f"prompt handling: input {spec.name} is produced by {source} (tokenizer / prompt "
                         "management stays in Python)")
        elif kind == "image":
            plane.append(f"frame loading and preprocessing: input {spec.name} comes from {source}")
        elif kind == "session":
            plane.append(f"session state: input {spec.name} is kept across calls by {source}; the session "
                         "feeds it to every call")
    for arg in contract.non_tensor_args:
        plane.append(f"Python argument {arg.tree_path} = {arg.value_repr} is decided outside the graph")
    per_frame = contract.calls_per_frame
    if per_frame is not None and abs(per_frame - round(per_frame)) > 1e-9:
        plane.append(f"the loop that calls it stays in Python: {contract.calls} calls, {per_frame:.2f} per "
                     "frame on average (the count depends on the data, e.g. objects or prompts)")
    return plane


# --------------------------------------------------------------------------- shape strategy


@dataclass
class _Dim:
    """One dynamic dimension of one input, with its value in each distinct call shape."""

    input_index: int
    input_name: str
    dim: int
    per_call: tuple[int, ...]
    quantity: QuantityLimit | None = None

    @property
    def observed(self) -> list[int]:
        return sorted(set(self.per_call))


@dataclass
class _Symbol:
    """Dims that move together: bound to one declared quantity, or equal in every observed call."""

    dims: list[_Dim]
    quantity: QuantityLimit | None

    def values(self) -> list[int]:
        if self.quantity is not None:
            return list(range(self.quantity.low, self.quantity.high + 1))
        return self.dims[0].observed

    def range(self) -> list[int]:
        if self.quantity is not None:
            return [self.quantity.low, self.quantity.high]
        return [min(self.dims[0].observed), max(self.dims[0].observed)]

    def describe(self) -> str:
        dims = ", ".join(f"{d.input_name}[{d.dim}]" for d in self.dims)
        if self.quantity is not None:
            q = self.quantity
            evidence = f" ({q.evidence})" if q.evidence else ""
            return f"{dims} follow {q.quantity} in [{q.low}, {q.high}] from the source{evidence}"
        return f"{dims} observed {self.dims[0].observed}"


def _as_limits(source_limits: SourceLimits | None) -> list[QuantityLimit]:
    if source_limits is None:
        return []
    if isinstance(source_limits, dict):
        limits = []
        for quantity, bounds in source_limits.items():
            if len(bounds) != 2 or bounds[0] > bounds[1]:
                raise OmskillsError(f"source_limits[{quantity!r}] must be [low, high] with low <= high, got {bounds}")
            limits.append(QuantityLimit(quantity=quantity, low=bounds[0], high=bounds[1],
                                        evidence="declared by the driver"))
        return limits
    return list(source_limits)


def _input_index(contract: ContractSpec, ref: str, quantity: str) -> int:
    for index, spec in enumerate(contract.inputs):
        if ref in (spec.name, spec.tree_path):
            return index
    raise OmskillsError(
        f"source limit {quantity}: candidate {contract.candidate} has no tensor input named {ref!r} "
        f"(inputs: {', '.join(s.name for s in contract.inputs)})"
    )


def _per_call(contract: ContractSpec, index: int, dim: int) -> tuple[int, ...]:
    shapes = contract.call_shapes or []
    values = tuple(s.inputs[index][dim] for s in shapes if dim < len(s.inputs[index]))
    return values or (contract.inputs[index].shape[dim],)


def _collect_dims(contract: ContractSpec, limits: list[QuantityLimit]) -> tuple[list[_Dim], list[str]]:
    """Dynamic dims: those bound to a declared quantity, and those observed to vary."""
    notes: list[str] = []
    dims: dict[tuple[int, int], _Dim] = {}
    for limit in limits:
        for ref in limit.dims:
            index = _input_index(contract, ref.input, limit.quantity)
            spec = contract.inputs[index]
            if not 0 <= ref.dim < len(spec.shape):
                raise OmskillsError(f"source limit {limit.quantity}: input {spec.name} has no dim {ref.dim} "
                                    f"(shape {spec.shape})")
            per_call = _per_call(contract, index, ref.dim)
            outside = [v for v in set(per_call) if not limit.low <= v <= limit.high]
            if outside:
                raise OmskillsError(f"source limit {limit.quantity} [{limit.low}, {limit.high}] does not hold for "
                                    f"{spec.name}[{ref.dim}]: observed {sorted(set(per_call))}")
            if limit.low < limit.high:
                dims[(index, ref.dim)] = _Dim(index, spec.name, ref.dim, per_call, limit)
    unbound = [q for q in limits if not q.dims]
    for index, spec in enumerate(contract.inputs):
        for dim_key in spec.dynamic_dims:
            dim = int(dim_key)
            if (index, dim) in dims:
                continue
            found = _Dim(index, spec.name, dim, _per_call(contract, index, dim))
            fitting = [q for q in unbound if all(q.low <= v <= q.high for v in found.observed)]
            if len(fitting) == 1:
                found.quantity = fitting[0]
            elif len(fitting) > 1:
                notes.append(f"{spec.name}[{dim}] fits several declared quantities "
                             f"({', '.join(q.quantity for q in fitting)}): bind it with DimRef to use a source range")
            dims[(index, dim)] = found
    return sorted(dims.values(), key=lambda d: (d.input_index, d.dim)), notes


def _symbols(dims: list[_Dim]) -> list[_Symbol]:
    symbols: list[_Symbol] = []
    for dim in dims:
        for symbol in symbols:
            same_quantity = dim.quantity is not None and symbol.quantity is dim.quantity
            same_values = dim.quantity is None and symbol.quantity is None and symbol.dims[0].per_call == dim.per_call
            if same_quantity or same_values:
                symbol.dims.append(dim)
                break
        else:
            symbols.append(_Symbol([dim], dim.quantity))
    return symbols


def _input_shapes(contract: ContractSpec, dims: list[_Dim]) -> dict[str, list[int]]:
    shapes = {spec.name: list(spec.shape) for spec in contract.inputs}
    for dim in dims:
        shapes[dim.input_name][dim.dim] = -1
    return shapes


def _gears(symbols: list[_Symbol], dims: list[_Dim]) -> tuple[int, list[list[int]]]:
    """Number of gears and, when within ATC's limit, one row per gear: every -1 dim's value, input order.

    Declared quantities contribute their whole range; observed-only symbols contribute the value
    combinations actually seen together in one call (not their cross product).
    """
    declared = [s for s in symbols if s.quantity is not None]
    observed = [s for s in symbols if s.quantity is None]
    calls = len(observed[0].dims[0].per_call) if observed else 0
    observed_rows = sorted({tuple(s.dims[0].per_call[c] for s in observed) for c in range(calls)}) or [()]
    count = len(observed_rows) * math.prod(len(s.values()) for s in declared)
    if count > MAX_GEARS:
        return count, []
    position = {id(d): k for k, s in enumerate(declared + observed) for d in s.dims}
    rows = set()
    for declared_values in itertools.product(*(s.values() for s in declared)):
        for observed_values in observed_rows:
            values = declared_values + observed_values
            rows.add(tuple(values[position[id(d)]] for d in dims))
    return len(rows), [list(r) for r in sorted(rows)]


def _image_sizes(dims: list[_Dim], contract: ContractSpec, gears: list[list[int]]) -> list[list[int]] | None:
    """[[h, w], ...] when only H and W of 4-D inputs vary, every such input having the same H and W."""
    inputs = {d.input_index for d in dims}
    if not all(len(contract.inputs[i].shape) == 4 and {d.dim for d in dims if d.input_index == i} == {2, 3}
               for i in inputs):
        return None
    # dims are in input order, so each row is h1, w1, h2, w2, ...
    if any(len(set(row[0::2])) > 1 or len(set(row[1::2])) > 1 for row in gears):
        return None
    return [list(p) for p in sorted({(row[0], row[1]) for row in gears})]


def propose_shape_strategy(contract: ContractSpec, source_limits: SourceLimits | None = None) -> ShapeStrategy:
    """Exactly one ATC shape strategy, from observed varying dims and declared source ranges."""
    limits = _as_limits(source_limits)
    dims, notes = _collect_dims(contract, limits)
    symbols = _symbols(dims)
    input_shapes = _input_shapes(contract, dims)
    observed_calls = f"{contract.calls} call{'s' if contract.calls != 1 else ''}"
    if not dims:
        if contract.calls <= 1:
            known = "no source limit known" if not limits else (
                f"the declared quantities ({', '.join(q.quantity for q in limits)}) name no dim of it "
                "(bind them with DimRef)")
            why = (f"only one call observed and {known}: static on the observed shapes "
                   "(a single sample cannot show which dims vary)")
        else:
            why = f"{observed_calls} observed, no dimension varies and no source range is declared"
        return ShapeStrategy(kind="static", input_shapes=input_shapes, rationale="; ".join([why] + notes))

    described = "; ".join(s.describe() for s in symbols)
    only_observed = all(s.quantity is None for s in symbols)
    caveat = (" Gears cover only values seen on the main path; a call outside them falls back to PyTorch — "
              "declare a QuantityLimit in the driver where the source shows the real range.") if only_observed else ""
    count, gears = _gears(symbols, dims)
    fits_gears = MIN_GEARS <= count <= MAX_GEARS
    image_sizes = _image_sizes(dims, contract, gears) if fits_gears else None

    if fits_gears and len(symbols) == 1 and all(d.dim == 0 for d in dims):
        batches = [[b] for b in sorted({row[0] for row in gears})]  # one value per gear: the batch size
        return ShapeStrategy(kind="dynamic_batch_size", input_shapes=input_shapes, gears=batches,
                             rationale=f"only dim 0 varies, the same in every input: {described}.{caveat}")
    if image_sizes is not None:
        return ShapeStrategy(kind="dynamic_image_size", input_shapes=input_shapes, gears=image_sizes,
                             rationale=f"only H and W of 4-D image inputs vary: {described}.{caveat}")
    if fits_gears:
        return ShapeStrategy(kind="dynamic_dims", input_shapes=input_shapes, gears=gears,
                             rationale=f"{count} gears over {len(dims)} dynamic dims: {described}.{caveat}")
    ranges = {}
    for name in {d.input_name for d in dims}:
        spec = next(s for s in contract.inputs if s.name == name)
        ranges[name] = [[size, size] for size in spec.shape]
    for symbol in symbols:
        for dim in symbol.dims:
            ranges[dim.input_name][dim.dim] = symbol.range()
    too_many = f"exceed ATC's {MAX_GEARS}" if count > MAX_GEARS else f"are below ATC's minimum of {MIN_GEARS}"
    why = f"{count} value combinations {too_many} gears: dynamic shape with ranges; {described}"
    if only_observed:
        why += "; ranges are the observed min/max only"
    return ShapeStrategy(kind="dynamic_shape", input_shapes=input_shapes, ranges=ranges,
                         rationale="; ".join([why] + notes))


# --------------------------------------------------------------------------- trial export


class _FlatCall(nn.Module):
    """Calls the candidate with its tensors in flat order and constants from the contract."""

    def __init__(self, module: nn.Module, contract: ContractSpec):
        super().__init__()
        self.module = module
        self.spec = pytree.spec_from_str(contract.in_spec)
        self.constants = {a.flat_index: a.value for a in contract.non_tensor_args}
        self.tensor_positions = [s.flat_index for s in contract.inputs]

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves: list[Any] = [self.constants.get(i) for i in range(self.spec.num_leaves)]
        for position, tensor in zip(self.tensor_positions, tensors):
            leaves[position] = tensor
        args, kwargs = pytree.unflatten_call(leaves, self.spec)
        return tuple(pytree.flatten(self.module(*args, **kwargs)).tensors())


def _cannot_rebuild(contract: ContractSpec) -> list[str]:
    return [a.tree_path for a in contract.non_tensor_args
            if a.flat_index is None or (a.value is None and a.value_repr != "None")]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _trial_export(contract: ContractSpec, module: nn.Module, strategy: ShapeStrategy,
                  samples_root: Path | None) -> tuple[bool, list[str]]:
    """torch.export on one sample, then replay the graph on every sample and compare.

    Replaying also the traced sample catches branches on module state (counters, caches) that were
    taken differently during the capture than during the trace.
    """
    if not contract.samples:
        return True, ["trial export skipped: no samples captured"]
    missing = _cannot_rebuild(contract)
    if missing:
        return True, ["trial export skipped: cannot rebuild non-tensor arguments " + ", ".join(missing)]
    samples = [load_sample((samples_root or Path()) / path) for path in contract.samples]
    devices = [torch.device(s.device) for s in contract.inputs]

    def feeds(sample: Any) -> tuple[torch.Tensor, ...]:
        return tuple(sample.inputs[s.name].to(d) for s, d in zip(contract.inputs, devices))

    dynamic_dims = [[i for i, size in enumerate(strategy.input_shapes[s.name]) if size == -1] for s in contract.inputs]
    # AUTO keeps a dim symbolic unless the code pins it; a pinned dim then shows up as the replay of
    # another call's shapes being rejected. Trace on the call with the largest dynamic sizes, since
    # torch specialises sizes 0 and 1.
    dynamic = tuple({d: torch.export.Dim.AUTO for d in dims} or None for dims in dynamic_dims)
    traced = max(samples, key=lambda sample: min(
        [sample.inputs[s.name].shape[d] for s, dims in zip(contract.inputs, dynamic_dims) for d in dims] or [0]))
    flat = _FlatCall(module, contract)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            program = torch.export.export(flat, feeds(traced), dynamic_shapes={"tensors": dynamic}, strict=False)
    except Exception as exc:  # the exporter's own error is the evidence
        return False, [f"trial torch.export failed (data-dependent control flow or unsupported Python): "
                       f"{_first_line(exc)}"]
    reasons = [f"trial torch.export succeeded on the inputs of call {traced.call_index}"]
    replay = program.module()
    for sample in samples:
        try:
            with torch.no_grad():
                got = replay(*feeds(sample))
        except Exception as exc:
            return False, reasons + [f"the traced graph rejects the inputs of call {sample.call_index}: "
                                     f"{_first_line(exc)}"]
        for spec, tensor in zip(contract.outputs, got):
            expected = sample.outputs[spec.name].to(tensor.device)
            if tensor.shape != expected.shape or not torch.allclose(tensor, expected, rtol=1e-4, atol=1e-5):
                return False, reasons + [
                    f"the traced graph gives a different {spec.name} on call {sample.call_index}: Python "
                    "control flow inside depends on the input data or on module state"]
    reasons.append(f"the traced graph reproduces the outputs of calls {[s.call_index for s in samples]}")
    return True, reasons


# --------------------------------------------------------------------------- public entry points


def analyze_boundary(
    contract: ContractSpec,
    module: nn.Module | None = None,
    source_limits: SourceLimits | None = None,
    trial_export: bool = False,
    samples_root: Path | None = None,
) -> BoundaryDecision:
    """Exportability verdict, control plane and shape strategy of one candidate.

    `source_limits`: quantities whose range the source shows, either {"num_objects": [1, 16]}
    (matched to varying dims whose observed values lie within) or QuantityLimit records that name
    the dims explicitly. `trial_export` runs torch.export on the captured samples (paths relative to
    `samples_root`) and replays the graph on every sample; tracing runs the module's Python forward
    once more, so Python-side state it keeps (counters, caches) advances by one call.
    """
    exportable, reasons = _exportability(contract)
    strategy = propose_shape_strategy(contract, source_limits) if exportable else None
    if trial_export and exportable:
        if module is None:
            raise OmskillsError(f"trial_export for {contract.candidate} needs the module")
        exportable, trial_reasons = _trial_export(contract, module, strategy, samples_root)  # type: ignore[arg-type]
        reasons += trial_reasons
    return BoundaryDecision(
        candidate=contract.candidate,
        exportable=exportable,
        reasons=reasons,
        control_plane=_control_plane(contract),
        shape_strategy=strategy,
    )


def analyze_boundaries(
    contracts: list[ContractSpec],
    modules: dict[str, nn.Module] | None = None,
    source_limits: dict[str, SourceLimits] | None = None,
    trial_export: bool = False,
    samples_root: Path | None = None,
) -> list[BoundaryDecision]:
    """`analyze_boundary` for every contract (modules and limits keyed by candidate name), with merges."""
    modules, source_limits = modules or {}, source_limits or {}
    merges = suggest_merges(contracts)
    decisions = []
    for contract in contracts:
        decision = analyze_boundary(contract, modules.get(contract.candidate), source_limits.get(contract.candidate),
                                    trial_export=trial_export, samples_root=samples_root)
        decision.merge_with = merges.get(contract.candidate, [])
        decisions.append(decision)
    return decisions


def _feeds_only(producer: ContractSpec, consumer: ContractSpec) -> bool:
    """Every output of `producer` goes only into `consumer`, and `consumer` takes data only from it."""
    target = consumer.module_path
    for out in producer.outputs:
        if not out.consumers:
            return False  # read by Python code outside any module: it leaves the pair
        for reader in out.consumers:
            if not (reader == target or is_ancestor(reader, target) or is_ancestor(target, reader)):
                return False
    for spec in consumer.inputs:
        kind = spec.provenance.kind if spec.provenance else "unknown"
        if kind in ("parameter", "constant"):
            continue
        if kind != "module_output" or spec.provenance is None or spec.provenance.source != producer.module_path:
            return False
    return True


def suggest_merges(contracts: list[ContractSpec]) -> dict[str, list[str]]:
    """Candidate name -> the other candidates it could be merged with (connected pairs, transitively)."""
    partners: dict[str, set[str]] = {c.candidate: set() for c in contracts}
    for producer, consumer in itertools.permutations(contracts, 2):
        if _feeds_only(producer, consumer):
            partners[producer.candidate].add(consumer.candidate)
            partners[consumer.candidate].add(producer.candidate)
    # Close over chains A -> B -> C.
    changed = True
    while changed:
        changed = False
        for name, group in partners.items():
            reach = set().union(*(partners[p] for p in group), group) - {name}
            if reach != group:
                partners[name], changed = reach, True
    order = [c.candidate for c in contracts]
    return {name: sorted(group, key=order.index) for name, group in partners.items() if group}


def _tensor_cell(spec: TensorSpec, show_origin: bool) -> str:
    dims = "".join(f" d{d}∈{v}" for d, v in spec.dynamic_dims.items())
    text = f"`{spec.name}` {spec.dtype}{spec.shape}{dims}"
    origin = spec.provenance
    if show_origin and origin is not None:
        details = [d for d in (origin.source, "derived" if origin.derived else None) if d]
        text += f" ← {origin.kind}" + (f" ({', '.join(details)})" if details else "")
    elif not show_origin and spec.consumers:
        text += " → " + ", ".join(spec.consumers)
    return text.replace("|", "\\|")


def _strategy_cell(strategy: ShapeStrategy | None) -> str:
    if strategy is None:
        return "—"
    if strategy.gears:
        return f"{strategy.kind} ({len(strategy.gears)} gears)"
    if strategy.ranges:
        return f"{strategy.kind} " + "; ".join(f"{n}: {r}" for n, r in strategy.ranges.items())
    return strategy.kind


def render_contract_table(contracts: list[ContractSpec], decisions: list[BoundaryDecision]) -> str:
    """Markdown table: one row per candidate, its contract and boundary decision side by side."""
    by_name = {d.candidate: d for d in decisions}
    lines = [
        "| candidate | module | calls | inputs (← origin) | outputs (→ consumers) | exportable | shape strategy "
        "| merge with |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in contracts:
        decision = by_name.get(c.candidate)
        calls = f"{c.calls}" + (f" ({c.calls_per_frame:.2g}/frame)" if c.calls_per_frame is not None else "")
        exportable = "—" if decision is None else ("yes" if decision.exportable else "**no**: " + decision.reasons[0])
        lines.append("| " + " | ".join([
            c.candidate,
            f"`{c.module_path}`",
            calls,
            "<br>".join(_tensor_cell(s, True) for s in c.inputs) or "—",
            "<br>".join(_tensor_cell(s, False) for s in c.outputs) or "—",
            exportable.replace("|", "\\|"),
            _strategy_cell(decision.shape_strategy if decision else None),
            ", ".join(decision.merge_with) if decision and decision.merge_with else "—",
        ]) + " |")
    return "\n".join(lines)
