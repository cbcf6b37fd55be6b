"""From calibration to ATC options: the keep list a graph needs for each precision mode, every
mode emulated with it, the mode to convert with, and the `--keep_dtype` / `--modify_mixlist`
files that carry the list to ATC.

Per graph, on one recorded call:
1. calibration (`ascend.calibration`): one fp32 pass; nodes whose values leave fp16's useful range
   are kept before anything is emulated.
2. each mode, fastest first, emulated with that keep list; the first that passes the graph's gate
   is chosen.
3. when a mode fails, a graph-local search: one side-by-side run ranks the nodes by the error each
   adds (its output's error beyond its inputs'), then bisection over prefixes of that order finds
   the fewest top-ranked nodes whose keeping makes the mode pass: at most 1 + 2 * ceil(log2 N)
   graph runs for N ranked nodes, capped at SEARCH_RUNS. A slower mode is tried only when no keep
   list within the cap passes; must_keep_origin_dtype is the last resort.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from omskills.ascend.calibration import calibrate, cube_macs, fp16_macs, weight_rules
from omskills.ascend.emulation import (
    PreparedGraph,
    compare_layers,
    node_errors,
    passes_output_gate,
    precisions_for,
    prepared_light,
    run_emulated_with_overflow,
    run_reference,
)
from omskills.ascend.pitfalls import check_pitfalls
from omskills.ascend.precision_modes import DEFAULT_MODES, SPEED_ORDER
from omskills.compare.parity import cosine_from, float64_blocks
from omskills.convert.optimize import first_chunk_arrays
from omskills.records.precision import (
    CubeMacs,
    EmulatedResult,
    GraphCalibration,
    LayerComparison,
    ModePrecision,
    NodeComparison,
    PrecisionGates,
    PrecisionReport,
    TensorError,
)
from omskills.records.toolchain import BatchSplit, PitfallHit
from omskills.records.toolchain_stage import CandidateToolchain

# Graph runs one mode's keep-list search may make, its side-by-side ranking run included: enough
# for 1 + 2 * ceil(log2 N) with N up to 64 ranked nodes; a larger graph's search stops at the cap
# with the prefix it reached.
SEARCH_RUNS = 13
ASSUMPTIONS = (
    "Emulated on ONNX Runtime CPU: fp16 rounding (Cast to float16 and back) of the inputs and outputs of every "
    "node the mode runs in fp16, arithmetic between roundings in fp32 (the Cube unit's fp32 accumulation; "
    "for vector ops an optimistic assumption, which calibration's range rules cover where a value is large). "
    "It cannot see ATC's own lowering of the graph (fused or rewritten operators, format changes): precheck_ops "
    "lists the known pitfalls, and compare_layers on an NPU dump is the check to run on the device."
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
    compare: bool = True,
) -> tuple[EmulatedResult, LayerComparison | None]:
    """The mode emulated once (outputs and overflow count); with `compare`, a failing mode is
    then compared node by node, for the report's first node over the gate."""
    precisions = precisions_for(prepared, mode, keep)
    if not _fp16_count(precisions):
        # Nothing computes in fp16: the emulated graph is the fp32 graph, nothing to run.
        return EmulatedResult(cosine=1.0, max_abs=0.0, overflow=0, passed=True, fp16_nodes=0), None
    reference = reference if reference is not None else run_reference(prepared, feeds)
    outputs, overflow = run_emulated_with_overflow(prepared, precisions, feeds)
    result = _result(outputs, overflow, reference, precisions, gates)
    if result.passed or not compare:
        return result, None
    comparison = compare_layers(prepared, precisions, feeds, gates, candidate=f"{mode} emulated")
    return emulated_result(comparison, _fp16_count(precisions)), comparison


def _result(
    outputs: Mapping[str, np.ndarray],
    overflow: int,
    reference: Mapping[str, np.ndarray],
    precisions: Mapping[str, str],
    gates: PrecisionGates,
) -> EmulatedResult:
    """An emulated run's outputs against the reference, judged by the graph's gate."""
    errors = [_output_error(name, reference[name], outputs[name]) for name in reference]
    return EmulatedResult(
        cosine=min((e.cosine for e in errors), default=1.0),
        max_abs=max((e.max_abs for e in errors), default=0.0),
        overflow=overflow,
        nan=sum(e.nan for e in errors),
        passed=not overflow and all(passes_output_gate(e, gates) for e in errors),
        fp16_nodes=_fp16_count(precisions),
    )


def _output_error(name: str, ref: np.ndarray, got: np.ndarray) -> TensorError:
    """One graph output, emulated against fp32 (float64 arithmetic, a block at a time)."""
    if ref.dtype.kind not in "fc":
        ref64, got64 = np.asarray(ref, np.float64).ravel(), np.asarray(got, np.float64).ravel()
        differs = int((ref64 != got64).sum())
        return TensorError(
            tensor=name,
            cosine=1.0 if not differs else 0.0,
            max_abs=float(np.abs(ref64 - got64).max(initial=0.0)),
            ref_max_abs=float(np.abs(ref64).max(initial=0.0)),
        )
    overflow = nan = 0
    max_abs = ref_max_abs = dot = norm2_ref = norm2_got = 0.0
    for a, b in zip(float64_blocks(ref), float64_blocks(got), strict=True):
        overflow += int((np.isinf(b) & np.isfinite(a)).sum())
        nan += int((np.isnan(b) & ~np.isnan(a)).sum())
        finite = np.isfinite(a) & np.isfinite(b)
        if not finite.all():
            a, b = a[finite], b[finite]
        max_abs = max(max_abs, float(np.abs(a - b).max(initial=0.0)))
        ref_max_abs = max(ref_max_abs, float(np.abs(a).max(initial=0.0)))
        dot, norm2_ref, norm2_got = (
            dot + float(np.dot(a, b)),
            norm2_ref + float(np.dot(a, a)),
            norm2_got + float(np.dot(b, b)),
        )
    cosine = 0.0 if overflow or nan else cosine_from(dot, math.sqrt(norm2_ref), math.sqrt(norm2_got))
    return TensorError(tensor=name, cosine=cosine, max_abs=max_abs, ref_max_abs=ref_max_abs, overflow=overflow, nan=nan)


def search_keep(
    prepared: PreparedGraph,
    mode: str,
    feeds: Mapping[str, np.ndarray],
    gates: PrecisionGates,
    reference: Mapping[str, np.ndarray],
    keep: Sequence[str] = (),
    budget: int = SEARCH_RUNS,
) -> tuple[list[str], EmulatedResult | None, int, str | None]:
    """The fewest nodes, besides `keep`, whose keeping makes `mode` pass: ranked by the error each
    adds in one side-by-side run, then bisection over prefixes of that order. Returns the nodes
    added, the result with them (None when none passed), the graph runs made and a note."""
    precisions = precisions_for(prepared, mode, keep)
    nodes, _ = node_errors(prepared, precisions, feeds, gates)
    order = ranked_by_added_error(prepared, nodes, precisions)
    runs = 1
    if not order:
        return [], None, runs, "the outputs miss the gate but no node computing in fp16 adds error: nothing to keep"

    def attempt(count: int) -> EmulatedResult:
        nonlocal runs
        runs += 1
        result, _ = emulate_mode(prepared, mode, feeds, gates, [*keep, *order[:count]], reference, compare=False)
        return result

    failing, passing, best = 0, None, None
    count = 1
    while runs < budget:  # doubling: 1, 2, 4, ... nodes, until a prefix passes
        result = attempt(count)
        if result.passed:
            passing, best = count, result
            break
        failing = count
        if count == len(order):
            break
        count = min(2 * count, len(order))
    if passing is None:
        return (
            [],
            None,
            runs,
            f"still failing with the {failing} node(s) that add most error kept ({runs} graph runs of "
            f"{budget}): a slower mode is next",
        )
    while passing - failing > 1 and runs < budget:  # bisection between the last failing and passing prefix
        middle = (failing + passing) // 2
        result = attempt(middle)
        if result.passed:
            passing, best = middle, result
        else:
            failing = middle
    return list(order[:passing]), best, runs, None


def ranked_by_added_error(
    prepared: PreparedGraph, nodes: Sequence[NodeComparison], precisions: Mapping[str, str]
) -> list[str]:
    """Nodes computing in fp16, ordered by the error each adds: its worst output's (1 - cosine) less
    its inputs' worst, an overflow or NaN first. Nodes that add none are left out."""
    bad = {n.node: _badness(n.worst) for n in nodes}
    added = {}
    for node in prepared.graph.node:
        if node.name not in bad or precisions.get(node.name, "fp32") == "fp32":
            continue
        feeding = [bad.get(prepared.producers[i].name, 0.0) for i in node.input if i in prepared.producers]
        gain = bad[node.name] - max(feeding, default=0.0)
        if gain > 0:
            added[node.name] = gain
    return sorted(added, key=lambda n: -added[n])


def _badness(error: TensorError) -> float:
    return 1.0 + error.overflow + error.nan if error.overflow or error.nan else 1.0 - error.cosine


def most_runs(ranked: int) -> int:
    """The graph runs a search over `ranked` nodes can take at most (the side-by-side run, doubling, bisection)."""
    steps = math.ceil(math.log2(ranked)) if ranked > 1 else 0
    return min(SEARCH_RUNS, 1 + 2 * steps + 1)


def op_types_of(prepared: PreparedGraph, nodes: Sequence[str]) -> list[str]:
    wanted = set(nodes)
    return sorted({n.op_type for n in prepared.graph.node if n.name in wanted})


def precision_on_sample(
    model: Path,
    feeds: dict[str, np.ndarray],
    sample_path: Path,
    sample: str,
    modes: list[str],
    split: BatchSplit | None,
) -> PrecisionReport:
    """`precision_report` against the sample's PyTorch outputs, read here: in a child, rather than
    held by the server for as long as the child runs, beside the child's own copy (the server
    grew by 0.9 GB for a full-scale backbone's sample). A child imports this module and what it
    needs, not torch: seconds of every emulation's start."""
    _, outputs = first_chunk_arrays(sample_path, split)
    return precision_report(model, feeds, sample, modes, None, outputs)


def precision_report(
    model: str | Path,
    feeds: Mapping[str, np.ndarray],
    sample: str,
    modes: Sequence[str] = DEFAULT_MODES,
    gates: PrecisionGates | None = None,
    outputs: Mapping[str, np.ndarray] | None = None,
) -> PrecisionReport:
    """Calibration in the fastest mode's first passes, then the modes in `modes` emulated on one
    sample, fastest first, each with the calibration's keep list and, where it fails, a graph-local
    search for more, until one passes: the slower ones would not be chosen. must_keep_origin_dtype,
    which runs nothing, is always listed. `outputs`: PyTorch's outputs for these feeds (the study
    captured them with the sample), compared with instead of a run of the graph in fp32."""
    gates = gates or PrecisionGates()
    hits = check_pitfalls(model)
    order = fastest_first(modes)
    with prepared_light(model) as prepared:
        # The probe found the graph computes PyTorch's outputs within its tolerance, far inside an
        # fp16 gate: comparing with them spares a run of the graph in fp32 (minutes for a backbone).
        given = outputs is not None and set(outputs) == {o.name for o in prepared.model.graph.output}
        reference = dict(outputs) if given else run_reference(prepared, feeds)
        calibration, first, macs = _calibration_passes(
            prepared, feeds, sample, order[0], _pitfall_nodes(hits, order[0]), reference, gates
        )
        results, skipped = _emulate_until_one_passes(
            prepared, order, feeds, gates, reference, calibration.nodes, hits, first
        )
        chosen, keep, why = _choose(results)
        fp16 = fp16_macs(macs, precisions_for(prepared, chosen, keep))
    if skipped:
        why += f"; not emulated, as slower: {', '.join(skipped)}"
    return PrecisionReport(
        model=str(model),
        sample=sample,
        gates=gates,
        calibration=calibration,
        macs=CubeMacs(total=sum(macs.values()), fp16=fp16, by_node=macs),
        modes=results,
        chosen_mode=chosen,
        chosen_keep=keep,
        why=why,
        not_evaluated=skipped,
        assumptions=ASSUMPTIONS,
        reference="PyTorch's outputs for the sample" if given else "the graph in fp32 on ONNX Runtime",
    )


# Emulated passes calibration may make: each keeps what the one before it found; a pass that finds
# nothing new is the fastest mode's first result.
CALIBRATION_PASSES = 3


def _calibration_passes(
    prepared: PreparedGraph,
    feeds: Mapping[str, np.ndarray],
    sample: str,
    mode: str,
    pitfalls: Sequence[str],
    reference: Mapping[str, np.ndarray],
    gates: PrecisionGates,
) -> tuple[GraphCalibration, tuple[tuple[str, ...], EmulatedResult] | None, dict[str, int]]:
    """`mode` emulated and observed until its magnitudes put no new node beyond fp16's range: the
    calibration, the last pass's result with the keep list it ran with (None when the passes ran
    out still finding nodes), and each Cube node's MACs."""
    keep, found, seconds, macs = list(pitfalls), {}, 0.0, {}
    weights = weight_rules(prepared)  # the same in every pass: read once
    for passes in range(1, CALIBRATION_PASSES + 1):
        precisions = precisions_for(prepared, mode, keep)
        calibration, run = calibrate(prepared, feeds, sample, precisions, weights)
        seconds += calibration.seconds
        macs = macs or (cube_macs(run.model, run.shapes) if run.model is not None else {})
        new = [k for k in calibration.keep if k.node not in found]
        found.update({k.node: k for k in new})
        added = [k.node for k in new if precisions.get(k.node, "fp32") != "fp32"]
        record = calibration.model_copy(
            update={"keep": list(found.values()), "seconds": round(seconds, 3), "passes": passes}
        )
        if not added:
            return record, (tuple(keep), _result(run.outputs, run.overflow, reference, precisions, gates)), macs
        keep += added
    return record, None, macs


def _pitfall_nodes(hits: Sequence[PitfallHit], mode: str) -> list[str]:
    """The nodes a known pitfall of `mode` says to keep (so what is emulated is what ATC is told)."""
    return list(dict.fromkeys(n for h in hits if mode in h.modes for n in h.keep_nodes))


def _emulate_until_one_passes(
    prepared: PreparedGraph,
    modes: Sequence[str],
    feeds: Mapping[str, np.ndarray],
    gates: PrecisionGates,
    reference: Mapping[str, np.ndarray],
    calibrated: Sequence[str],
    hits: Sequence[PitfallHit] = (),
    first: tuple[tuple[str, ...], EmulatedResult] | None = None,
) -> tuple[list[ModePrecision], list[str]]:
    """The modes emulated fastest first, each keeping the calibrated nodes and those a known pitfall
    of that mode names; after one passes, the slower ones are skipped. `first`: the fastest mode's
    result from calibration's last pass, and the keep list it ran with."""
    results, skipped = [], []
    for mode in modes:
        if any(_passes(r) for r in results) and mode != "must_keep_origin_dtype":
            skipped.append(mode)
            continue
        kept = list(dict.fromkeys([*calibrated, *_pitfall_nodes(hits, mode)]))
        results.append(
            mode_precision(prepared, mode, feeds, gates, reference, kept, first=first if mode == modes[0] else None)
        )
    return results, skipped


# A graph that misses its own gate by a little (no overflow, no NaN, cosine at least this) is left to
# the end-to-end check, which judges the pipeline and refits the graphs at fault: searched here, a
# deep random-weight backbone at 0.9985 kept most of its convolutions for a figure the pipeline
# never needed. A gross loss is searched at once.
SEARCH_BELOW = 0.99


def acceptable(result: EmulatedResult, lenient: bool = True) -> bool:
    """Whether a mode's result stands without a search: it passes its gate or (lenient) misses it by
    a little, with no overflow and no NaN."""
    return result.passed or (lenient and not result.overflow and not result.nan and result.cosine >= SEARCH_BELOW)


def fastest_first(modes: Sequence[str]) -> list[str]:
    return sorted(modes, key=lambda m: SPEED_ORDER.index(m) if m in SPEED_ORDER else len(SPEED_ORDER))


def _passes(mode: ModePrecision) -> bool:
    return acceptable(mode.result) or (mode.with_keep is not None and mode.with_keep.passed)


def mode_precision(
    prepared: PreparedGraph,
    mode: str,
    feeds: Mapping[str, np.ndarray],
    gates: PrecisionGates,
    reference: Mapping[str, np.ndarray],
    calibrated: Sequence[str] = (),
    budget: int = SEARCH_RUNS,
    first: tuple[tuple[str, ...], EmulatedResult] | None = None,
    lenient: bool = True,
) -> ModePrecision:
    """`mode` emulated with the calibrated nodes it would run in fp16 kept (`first`: a result of it
    already emulated, with the keep list it ran with), then searched unless it is `acceptable`."""
    defaults = precisions_for(prepared, mode)
    kept = [n for n in calibrated if defaults.get(n, "fp32") != "fp32"]
    if first is not None and set(first[0]) == set(kept):
        result = first[1]
    else:
        result, _ = emulate_mode(prepared, mode, feeds, gates, kept, reference, compare=False)
    if acceptable(result, lenient) or not result.fp16_nodes:
        if not result.fp16_nodes:
            note = "no node computes in fp16 under this mode: the graph runs as exported (fp32)"
        elif not result.passed:
            note = (
                f"misses its gate (cosine {result.cosine:.6f} < {gates.output_min_cosine}) by less than a search "
                f"(cosine {SEARCH_BELOW}): the end-to-end check decides, and refits it if it is at fault"
            )
        else:
            note = None
        return ModePrecision(mode=mode, result=result, keep=kept, keep_op_types=op_types_of(prepared, kept), note=note)
    added, with_keep, runs, note = search_keep(prepared, mode, feeds, gates, reference, kept, budget)
    keep = [*kept, *added] if with_keep is not None else kept
    return ModePrecision(
        mode=mode,
        result=result,
        keep=keep,
        keep_op_types=op_types_of(prepared, keep),
        searched=added,
        with_keep=with_keep,
        search_runs=runs,
        note=note,
    )


def own_choice(report: PrecisionReport) -> tuple[str, list[str]]:
    """The mode and keep list the graph's own emulation chose (the end-to-end check may have
    recorded another as `chosen_mode`): where a rerun of that check starts from."""
    mode, keep, _ = _choose(report.modes)
    return mode, keep


def _choose(results: list[ModePrecision]) -> tuple[str, list[str], str]:
    """The fastest mode that passes with its keep list."""
    by_mode = {m.mode: m for m in results}
    for mode in (by_mode[name] for name in fastest_first(list(by_mode))):
        if not _passes(mode):
            continue
        calibrated = len(mode.keep) - len(mode.searched)
        kept = [
            *([f"{calibrated} by calibration or a known pitfall"] if calibrated else []),
            *([f"{len(mode.searched)} found by the graph-local search"] if mode.searched else []),
        ]
        how = f"with {' and '.join(kept)} node(s) kept at their original dtype" if kept else "with nothing kept"
        if not mode.result.passed and mode.with_keep is None:
            return mode.mode, mode.keep, f"{mode.mode} {how} nearly passes in emulation; the end-to-end check decides"
        return mode.mode, mode.keep, f"{mode.mode} passes in emulation {how} (fastest passing mode)"
    return "must_keep_origin_dtype", [], "no emulated mode passes; must_keep_origin_dtype keeps every op's dtype"


def atc_keep_nodes(chain: CandidateToolchain, mode: str) -> list[str]:
    """The nodes a graph's ATC command keeps at their dtype under `mode`: those its emulation
    proposed (when the mode passed with them) and those a known pitfall of that mode names."""
    report = chain.precision
    emulated = report.mode(mode) if report else None
    keep = list(emulated.keep) if emulated and _passes(emulated) else []
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
