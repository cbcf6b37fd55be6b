"""From the per-layer bisect to ATC options: the smallest keep list that makes a mode pass in
emulation, every mode emulated without and with its list, the mode to convert with, and the
`--keep_dtype` / `--modify_mixlist` files that carry the list to ATC.

The keep list grows one finding at a time: the first node whose error crosses the gate is
kept when it loses precision by itself (local); when its error was accumulated, the fp16
nodes that feed it are kept instead. Each round emulates the graph again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from omskills.ascend.emulation import (
    PreparedGraph,
    compare_layers,
    passes_output_gate,
    precisions_for,
    prepared_light,
    run_emulated_with_overflow,
    run_reference,
)
from omskills.ascend.precision_modes import DEFAULT_MODES, SPEED_ORDER
from omskills.compare.parity import cosine_of
from omskills.records.precision import (
    EmulatedResult,
    LayerComparison,
    ModePrecision,
    PrecisionGates,
    PrecisionReport,
    TensorError,
)
from omskills.records.toolchain_stage import CandidateToolchain

MAX_KEEP_ROUNDS = 6
ASSUMPTIONS = (
    "Emulated on ONNX Runtime CPU: fp16 rounding (Cast to float16 and back) of the inputs and outputs of every "
    "node the mode runs in fp16, arithmetic between roundings in fp32 (the Cube unit's fp32 accumulation; "
    "for vector ops an optimistic assumption). It cannot see ATC's own lowering of the graph (fused or "
    "rewritten operators, format changes): precheck_ops lists the known pitfalls, and compare_layers on an "
    "NPU dump is the check to run on the device."
)


def emulated_result(comparison: LayerComparison, fp16_nodes: int) -> EmulatedResult:
    outputs = comparison.outputs
    return EmulatedResult(
        cosine=min((o.cosine for o in outputs), default=1.0),
        max_abs=max((o.max_abs for o in outputs), default=0.0),
        overflow=comparison.overflow,
        nan=sum(o.nan for o in outputs),
        passed=comparison.outputs_pass and not comparison.overflow,
        fp16_nodes=fp16_nodes,
        first=comparison.first,
    )


def _fp16_count(precisions: Mapping[str, str]) -> int:
    return sum(1 for p in precisions.values() if p != "fp32")


def emulate_mode(
    prepared: PreparedGraph,
    mode: str,
    feeds: Mapping[str, np.ndarray],
    gates: PrecisionGates,
    keep: Sequence[str] = (),
    reference: Mapping[str, np.ndarray] | None = None,
) -> tuple[EmulatedResult, LayerComparison | None]:
    """The mode emulated once (outputs and overflow count); only when that fails is the graph
    compared node by node, for the bisect."""
    precisions = precisions_for(prepared, mode, keep)
    if not _fp16_count(precisions):
        # Nothing computes in fp16: the emulated graph is the fp32 graph, nothing to run.
        return EmulatedResult(cosine=1.0, max_abs=0.0, overflow=0, passed=True, fp16_nodes=0), None
    reference = reference if reference is not None else run_reference(prepared, feeds)
    outputs, overflow = run_emulated_with_overflow(prepared, precisions, feeds)
    errors = [_output_error(name, reference[name], outputs[name]) for name in reference]
    passed = not overflow and all(passes_output_gate(e, gates) for e in errors)
    if passed:
        return EmulatedResult(
            cosine=min(e.cosine for e in errors),
            max_abs=max(e.max_abs for e in errors),
            overflow=0,
            passed=True,
            fp16_nodes=_fp16_count(precisions),
        ), None
    comparison = compare_layers(prepared, precisions, feeds, gates, candidate=f"{mode} emulated")
    return emulated_result(comparison, _fp16_count(precisions)), comparison


def _output_error(name: str, ref: np.ndarray, got: np.ndarray) -> TensorError:
    """One graph output, emulated against fp32 (float64 arithmetic)."""
    ref64, got64 = np.asarray(ref, np.float64).ravel(), np.asarray(got, np.float64).ravel()
    if ref.dtype.kind not in "fc":
        differs = int((ref64 != got64).sum())
        return TensorError(
            tensor=name,
            cosine=1.0 if not differs else 0.0,
            max_abs=float(np.abs(ref64 - got64).max(initial=0.0)),
            ref_max_abs=float(np.abs(ref64).max(initial=0.0)),
        )
    overflow = int((np.isinf(got64) & np.isfinite(ref64)).sum())
    nan = int((np.isnan(got64) & ~np.isnan(ref64)).sum())
    finite = np.isfinite(ref64) & np.isfinite(got64)
    a, b = ref64[finite], got64[finite]
    cosine = 0.0 if overflow or nan else cosine_of(a, b)
    return TensorError(
        tensor=name,
        cosine=cosine,
        max_abs=float(np.abs(a - b).max(initial=0.0)),
        ref_max_abs=float(np.abs(a).max(initial=0.0)),
        overflow=overflow,
        nan=nan,
    )


def propose_keep(
    prepared: PreparedGraph,
    mode: str,
    feeds: Mapping[str, np.ndarray],
    gates: PrecisionGates,
    first: LayerComparison,
    reference: Mapping[str, np.ndarray] | None = None,
) -> tuple[list[str], EmulatedResult | None, str | None]:
    """The keep list for `mode`, grown from `first` (the mode emulated with nothing kept), and
    the emulated result with it; a note when no list makes the mode pass."""
    keep: list[str] = []
    comparison = first
    for _ in range(MAX_KEEP_ROUNDS):
        finding = comparison.first
        if finding is None:
            return keep, None, "the outputs miss the gate but no single node does: no node to keep"
        added = _to_keep(prepared, mode, keep, finding.node, finding.origin)
        if not added:
            return keep, None, f"{finding.node} is already computed in fp32; its inputs carry the error"
        keep += added
        result, comparison = emulate_mode(prepared, mode, feeds, gates, keep, reference)
        if comparison is None or result.passed:
            return keep, result, None
    return (
        keep,
        emulated_result(comparison, _fp16_count(precisions_for(prepared, mode, keep))),
        (f"still failing after {MAX_KEEP_ROUNDS} rounds; must_keep_origin_dtype is the safe choice"),
    )


def _to_keep(prepared: PreparedGraph, mode: str, keep: list[str], node_name: str, origin: str) -> list[str]:
    precisions = precisions_for(prepared, mode, keep)
    if origin == "local" and precisions.get(node_name, "fp32") != "fp32":
        return [node_name]
    node = prepared.node_named[node_name]
    feeders = [prepared.producers[i].name for i in node.input if i in prepared.producers]
    chosen = [f for f in dict.fromkeys(feeders) if precisions.get(f, "fp32") != "fp32"]
    if chosen:
        return chosen
    return [node_name] if precisions.get(node_name, "fp32") != "fp32" else []


def op_types_of(prepared: PreparedGraph, nodes: Sequence[str]) -> list[str]:
    wanted = set(nodes)
    return sorted({n.op_type for n in prepared.graph.node if n.name in wanted})


def precision_report(
    model: str | Path,
    feeds: Mapping[str, np.ndarray],
    sample: str,
    modes: Sequence[str] = DEFAULT_MODES,
    gates: PrecisionGates | None = None,
    outputs: Mapping[str, np.ndarray] | None = None,
) -> PrecisionReport:
    """The modes in `modes` emulated on one sample, fastest first, with its keep list where one
    fails, until one passes: the slower ones would not be chosen. must_keep_origin_dtype, which
    runs nothing, is always listed."""
    gates = gates or PrecisionGates()
    with prepared_light(model) as prepared:
        # `outputs`: PyTorch's outputs for these feeds (the study captured them with the sample). The
        # graph computes them within the probe's tolerance, far inside an fp16 gate: comparing with
        # them spares a run of the graph in fp32 (minutes for a full-scale backbone).
        given = outputs is not None and set(outputs) == {o.name for o in prepared.model.graph.output}
        reference = dict(outputs) if given else run_reference(prepared, feeds)
        results, skipped = _emulate_until_one_passes(prepared, modes, feeds, gates, reference)
    chosen, keep, why = _choose(results)
    if skipped:
        why += f"; not emulated, as slower: {', '.join(skipped)}"
    return PrecisionReport(
        model=str(model),
        sample=sample,
        gates=gates,
        modes=results,
        chosen_mode=chosen,
        chosen_keep=keep,
        why=why,
        not_evaluated=skipped,
        assumptions=ASSUMPTIONS,
        reference="PyTorch's outputs for the sample" if given else "the graph in fp32 on ONNX Runtime",
    )


def _emulate_until_one_passes(
    prepared: PreparedGraph,
    modes: Sequence[str],
    feeds: Mapping[str, np.ndarray],
    gates: PrecisionGates,
    reference: Mapping[str, np.ndarray],
) -> tuple[list[ModePrecision], list[str]]:
    """The modes emulated fastest first; after one passes, the slower ones are skipped."""
    results, skipped = [], []
    for mode in fastest_first(modes):
        if any(_passes(r) for r in results) and mode != "must_keep_origin_dtype":
            skipped.append(mode)
            continue
        results.append(_mode_precision(prepared, mode, feeds, gates, reference))
    return results, skipped


def fastest_first(modes: Sequence[str]) -> list[str]:
    return sorted(modes, key=lambda m: SPEED_ORDER.index(m) if m in SPEED_ORDER else len(SPEED_ORDER))


def _passes(mode: ModePrecision) -> bool:
    return mode.result.passed or (mode.with_keep is not None and mode.with_keep.passed)


def _mode_precision(
    prepared: PreparedGraph,
    mode: str,
    feeds: Mapping[str, np.ndarray],
    gates: PrecisionGates,
    reference: Mapping[str, np.ndarray],
) -> ModePrecision:
    result, comparison = emulate_mode(prepared, mode, feeds, gates, reference=reference)
    if result.passed or comparison is None:
        note = (
            None if result.fp16_nodes else "no node computes in fp16 under this mode: the graph runs as exported (fp32)"
        )
        return ModePrecision(mode=mode, result=result, note=note)
    keep, with_keep, note = propose_keep(prepared, mode, feeds, gates, comparison, reference)
    return ModePrecision(
        mode=mode, result=result, keep=keep, keep_op_types=op_types_of(prepared, keep), with_keep=with_keep, note=note
    )


def _choose(results: list[ModePrecision]) -> tuple[str, list[str], str]:
    """The fastest mode that passes as is or with its keep list."""
    by_mode = {m.mode: m for m in results}
    for mode in (by_mode[name] for name in fastest_first(list(by_mode))):
        if mode.result.passed:
            return mode.mode, [], f"{mode.mode} passes in emulation with nothing kept (fastest passing mode)"
        if mode.with_keep is not None and mode.with_keep.passed:
            return (
                mode.mode,
                mode.keep,
                (
                    f"{mode.mode} passes in emulation with {len(mode.keep)} node(s) kept at "
                    f"their original dtype (fastest passing mode)"
                ),
            )
    return "must_keep_origin_dtype", [], "no emulated mode passes; must_keep_origin_dtype keeps every op's dtype"


def atc_keep_nodes(chain: CandidateToolchain, mode: str) -> list[str]:
    """The nodes a graph's ATC command keeps at their dtype under `mode`: those its emulation
    proposed (when the mode passed with them) and those a known pitfall of that mode names."""
    report = chain.precision
    emulated = report.mode(mode) if report else None
    keep = list(emulated.keep) if emulated and emulated.with_keep is not None and emulated.with_keep.passed else []
    for hit in chain.precheck.pitfalls if chain.precheck else []:
        if mode in hit.modes:
            keep += [n for n in hit.keep_nodes if n not in keep]
    return keep


def emulate_graph(
    model: Path, mode: str, keep: Sequence[str], feeds: Mapping[str, np.ndarray], gates: PrecisionGates
) -> EmulatedResult:
    """`model` emulated once in `mode` with `keep` against its fp32 run on `feeds` (a graph no
    per-graph emulation chose for: a composition of graphs, say)."""
    with prepared_light(model) as prepared:
        result, _ = emulate_mode(prepared, mode, feeds, gates, keep)
    return result


def keep_dtype_text(nodes: Sequence[str]) -> str:
    """ATC's --keep_dtype file: one node name per line, written bare (`OpType::` lines would name
    Ascend IR types, which the emulation does not use)."""
    return "".join(f"{name}\n" for name in nodes)


def write_keep_dtype(keep: Sequence[str], folder: Path, stem: str) -> Path | None:
    """ATC's --keep_dtype file for a keep list (one bare node name per line; it works under the
    mixed modes too), or None when nothing is kept."""
    if not keep:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stem}.keep_dtype.cfg"
    path.write_text(keep_dtype_text(keep))
    return path
