"""Deployment boundaries (stage 2): what is graph, what stays in Python, and how shapes are fixed.

From a captured ContractSpec:
  * `analyze_boundary` gives an exportability verdict with reasons, the control plane that stays in
    Python (with the evidence), and exactly one ATC shape strategy;
  * the shape strategy comes from `shape_strategy.propose_shape_strategy`: dims observed to vary
    across calls and the ranges the model-family driver declares from the source (`QuantityLimit`),
    never a single sample alone;
  * `suggest_merges` finds adjacent candidates that exchange tensors only with each other;
  * `render_contract_table` renders contracts and decisions as a Markdown table.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from pathlib import Path
from typing import Any

import torch
from omskills.boundary.shape_strategy import SourceLimits, propose_shape_strategy
from omskills.contracts import pytree
from omskills.contracts.samples import load_sample
from omskills.errors import OmskillsError
from omskills.records.contracts import BoundaryDecision, ContractSpec, ShapeStrategy, TensorSpec, is_ancestor
from torch import nn

_COMPLEX = {"complex32", "complex64", "complex128", "complex"}


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
    for arg in contract.non_tensor_args:
        if arg.holds_tensors:
            blockers.append(
                f"argument {arg.tree_path} holds tensors inside a Python object ({arg.value_repr}): "
                "state a graph cannot take; the parts inside that never see it can be graphs"
            )
        elif arg.derived is not None:
            notes.append(
                f"non-tensor argument {arg.tree_path} ({arg.value_repr}) = {arg.derived.formula()} on every "
                f"call ({arg.derived.evidence or 'declared by the driver'}): the graph computes it from its "
                "input shapes"
            )
        elif not arg.constant:
            blockers.append(
                f"non-tensor argument {arg.tree_path} changes between calls ({arg.value_repr}): "
                "a graph would freeze it to one value"
            )
    if contract.structure_variants > 1:
        blockers.append(
            f"calls have {contract.structure_variants} different structures (tree spec or which leaves are "
            "tensors): one graph cannot serve them all; re-cut the candidate or split the calls"
        )
    if not contract.inputs:
        blockers.append("no tensor inputs after flattening: its outputs depend only on Python values")
    if not contract.outputs:
        blockers.append("no tensor outputs after flattening: nothing for a graph to return")
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
        if kind == "input":
            plane.append(
                f"input handling: {spec.name} is made from the user's input by {source} (loading, "
                "preprocessing and tokenising stay in Python)"
            )
        elif kind == "session":
            plane.append(
                f"session state: input {spec.name} is kept across calls by {source}; the session feeds it to every call"
            )
    for arg in contract.non_tensor_args:
        plane.append(f"Python argument {arg.tree_path} = {arg.value_repr} is decided outside the graph")
    per_frame = contract.calls_per_frame
    if per_frame is not None and abs(per_frame - round(per_frame)) > 1e-9:
        plane.append(
            f"the loop that calls it stays in Python: {contract.calls} calls, {per_frame:.2f} per "
            "main-path step on average (the count depends on the data, e.g. objects or prompts)"
        )
    return plane


# --------------------------------------------------------------------------- trial export


class _FlatCall(nn.Module):
    """Calls the candidate with its tensors in flat order and constants from the contract."""

    def __init__(self, module: nn.Module, contract: ContractSpec):
        super().__init__()
        self.module = module
        self.spec = pytree.spec_from_str(contract.in_spec)
        self.contract = contract
        self.tensor_positions = [s.flat_index for s in contract.inputs]

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves: list[Any] = [None] * self.spec.num_leaves
        args = self.contract.non_tensor_args
        for arg, value in zip(args, self.contract.call_values([a.value for a in args], tensors)):
            leaves[arg.flat_index] = value
        for position, tensor in zip(self.tensor_positions, tensors):
            leaves[position] = tensor
        args, kwargs = pytree.unflatten_call(leaves, self.spec)
        return tuple(pytree.flatten(self.module(*args, **kwargs)).tensors())


def _cannot_rebuild(contract: ContractSpec) -> list[str]:
    return [
        a.tree_path
        for a in contract.non_tensor_args
        if a.flat_index is None or (a.value is None and a.value_repr != "None")
    ]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _trial_export(
    contract: ContractSpec, module: nn.Module, strategy: ShapeStrategy, samples_root: Path | None
) -> tuple[bool, list[str]]:
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
    traced = max(
        samples,
        key=lambda sample: min(
            [sample.inputs[s.name].shape[d] for s, dims in zip(contract.inputs, dynamic_dims) for d in dims] or [0]
        ),
    )
    flat = _FlatCall(module, contract)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            program = torch.export.export(flat, feeds(traced), dynamic_shapes={"tensors": dynamic}, strict=False)
    except Exception as exc:  # the exporter's own error is the evidence
        return False, [
            f"trial torch.export failed (data-dependent control flow or unsupported Python): {_first_line(exc)}"
        ]
    reasons = [f"trial torch.export succeeded on the inputs of call {traced.call_index}"]
    replay = program.module()
    for sample in samples:
        try:
            with torch.no_grad():
                got = replay(*feeds(sample))
        except Exception as exc:
            return False, reasons + [
                f"the traced graph rejects the inputs of call {sample.call_index}: {_first_line(exc)}"
            ]
        for spec, tensor in zip(contract.outputs, got):
            expected = sample.outputs[spec.name].to(tensor.device)
            if tensor.shape != expected.shape or not torch.allclose(tensor, expected, rtol=1e-4, atol=1e-5):
                return False, reasons + [
                    f"the traced graph gives a different {spec.name} on call {sample.call_index}: Python "
                    "control flow inside depends on the input data or on module state"
                ]
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
        decision = analyze_boundary(
            contract,
            modules.get(contract.candidate),
            source_limits.get(contract.candidate),
            trial_export=trial_export,
            samples_root=samples_root,
        )
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
        calls = f"{c.calls}" + (f" ({c.calls_per_frame:.2g}/step)" if c.calls_per_frame is not None else "")
        exportable = "—" if decision is None else ("yes" if decision.exportable else "**no**: " + decision.reasons[0])
        lines.append(
            "| "
            + " | ".join(
                [
                    c.candidate,
                    f"`{c.module_path}`",
                    calls,
                    "<br>".join(_tensor_cell(s, True) for s in c.inputs) or "—",
                    "<br>".join(_tensor_cell(s, False) for s in c.outputs) or "—",
                    exportable.replace("|", "\\|"),
                    _strategy_cell(decision.shape_strategy if decision else None),
                    ", ".join(decision.merge_with) if decision and decision.merge_with else "—",
                ]
            )
            + " |"
        )
    return "\n".join(lines)
