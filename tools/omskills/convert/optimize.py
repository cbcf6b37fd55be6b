"""Optimisation variants of an exported ONNX model, each checked and probed.

Variants: `original` (the export as is), `onnxslim` (onnxslim's graph simplification) and
`auto_optimizer` (Huawei's msit surgeon knowledge bases, through `auto_optimizer_compat`).
Both optimisers work on the graph with its weights detached (`onnxfiles.detached_weights`), so
a 2 GB model is rewritten as a graph of a few MB. A variant that changes nothing is `unchanged`:
not saved, not probed. On a big graph, a variant that adds or removes under MARGINAL_SHARE of
its nodes is `marginal`, not saved either: its probe would be a full run of the graph (minutes
for a full-scale backbone) for a rewrite ONNX Runtime and ATC make themselves when they load it.
A variant is checked — onnx checker, ONNX Runtime loads it, every graph output is produced,
parity against the PyTorch reference samples, where ONNX Runtime takes a sample's batch in
chunks one first chunk per shape (a rewrite computes every chunk of one shape with the same
operators, and verify runs the chosen variant on the whole main path) — most optimised first,
and the preferred one is the first of auto_optimizer -> onnxslim -> original that passes and is
no less accurate than the original; a variant under the chosen one is `not_checked`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from omskills.compare.parity import compare_outputs
from omskills.contracts.samples import input_shapes, read_arrays
from omskills.convert.auto_optimizer import AutoOptimizerUnavailable, apply_knowledges, load_auto_optimizer
from omskills.errors import InputError, OmskillsError
from omskills.isolation import ISOLATE_MIN_BYTES, ChildDied, model_bytes, return_freed_memory, run_in_child
from omskills.onnxfiles.detached_weights import attach, detach, discard
from omskills.onnxfiles.inspect import load_model_proto
from omskills.records.parity import OutputParity, ParityReport, Verdict, overall_verdict, verdict_rank
from omskills.records.toolchain import (
    BatchSplit,
    KnowledgeOutcome,
    OptimizeResult,
    VariantCheck,
    VariantName,
    VariantResult,
)
from omskills.runtime.base import BackendError
from omskills.runtime.onnxruntime_backend import open_onnxruntime
from omskills.stdio import stdout_to_stderr


@dataclass(frozen=True)
class FirstChunk:
    """The first chunk of a captured sample whose batch ONNX Runtime takes in chunks: its first
    `split.max_batch` items along each input's and output's batch axis (PyTorch's outputs of the
    whole batch, cut the same way)."""

    path: Path
    split: BatchSplit


# One probe sample: feeds by input name, reference (PyTorch) outputs by output name.
# (feeds, reference outputs), or a captured .npz sample, loaded only when it is run: the
# 4-frame samples of a full-scale video backbone are GBs each, too big to hold or to pickle.
ProbeSample = tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | Path | FirstChunk


def sample_arrays(sample: ProbeSample) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    if isinstance(sample, FirstChunk):
        feeds, outputs = sample_arrays(sample.path)
        split = sample.split
        return first_chunk(feeds, split.input_axes, split.max_batch), first_chunk(
            outputs, split.output_axes, split.max_batch
        )
    if isinstance(sample, Path):
        return read_arrays(sample)
    return sample


def first_chunk_arrays(path: Path, split: BatchSplit | None) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A sample's inputs and PyTorch outputs, cut to the first chunk of `split`'s batch."""
    return sample_arrays(FirstChunk(path, split) if split else path)


def first_chunk(arrays: dict[str, np.ndarray], axes: dict[str, int], max_batch: int) -> dict[str, np.ndarray]:
    """The first `max_batch` items of each array along its batch axis in `axes` (others whole)."""
    return {
        k: np.take(v, range(min(max_batch, v.shape[axis])), axis=axis) if (axis := axes.get(k)) is not None else v
        for k, v in arrays.items()
    }


def first_chunks(samples: Sequence[ProbeSample], split: BatchSplit | None) -> list[ProbeSample]:
    """Where ONNX Runtime takes the batch in chunks, the captured samples cut to their first chunk,
    one per shape of chunk: a call of 4 frames and one of 1 both start with a chunk of 1, which the
    graph computes with the same operators (`one_per_shape`'s reason, applied to what is run)."""
    if split is None:
        return list(samples)
    kept: list[ProbeSample] = []
    seen: set[tuple] = set()
    for sample in samples:
        if isinstance(sample, Path):
            shapes = _chunk_shapes(sample, split)
            if shapes in seen:
                continue
            seen.add(shapes)
            sample = FirstChunk(sample, split)
        kept.append(sample)
    return kept


def _chunk_shapes(path: Path, split: BatchSplit) -> tuple:
    """The input shapes of a sample's first chunk, from its array headers."""
    return tuple(
        (name, tuple(min(d, split.max_batch) if k == split.input_axes.get(name) else d for k, d in enumerate(shape)))
        for name, shape in input_shapes(path)
    )


VARIANTS: tuple[VariantName, ...] = ("original", "onnxslim", "auto_optimizer")
# Share of a big graph's nodes (ISOLATE_MIN_BYTES and more) a variant must add or remove to be
# kept and probed: on a 2 GB vision backbone of 2149 nodes onnxslim removed 5 and auto_optimizer
# merged one pair of Slices, and probing either variant took 100 s.
MARGINAL_SHARE = 0.01
PREFERENCE: tuple[VariantName, ...] = ("auto_optimizer", "onnxslim", "original")


def optimize_variants(
    original_path: str | Path,
    out_dir: str | Path,
    samples: Sequence[ProbeSample],
    variants: Sequence[VariantName] = VARIANTS,
    knowledges: list[str] | None = None,
    original_probe: ParityReport | None = None,
    isolate: bool | None = None,
    batch_split: BatchSplit | None = None,
) -> OptimizeResult:
    """Build each variant in `out_dir`, check and probe it, and choose the preferred one.

    `samples` are (feeds, reference outputs) pairs; without samples parity is not probed and
    the choice rests on the structural checks alone. `knowledges` restricts auto_optimizer to
    the named knowledges (default: all that the tool enables by default). `original_probe`:
    probe_onnx's report on the original file, reused instead of loading and probing it again
    (at full scale that is minutes for the 2 GB backbone). `isolate`: build and check each
    variant in a child process (default: for models of ISOLATE_MIN_BYTES and more).
    `batch_split`: run the samples' batches in chunks (what probe_onnx found this machine needs).
    """
    original = Path(original_path)
    load_model_proto(original)  # clear error for a missing or corrupt file, before any work
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise InputError(f"variants: unknown variant(s) {unknown}; expected some of {list(VARIANTS)}")
    if isolate is None:
        isolate = model_bytes(original) >= ISOLATE_MIN_BYTES
    results: list[VariantResult] = []
    for name in variants:
        if name == "original":
            results.append(
                check_variant(name, original, samples, probed=original_probe)
                if original_probe is not None
                else _run(
                    isolate,
                    _check,
                    VariantResult(name=name, status="ok", path=str(original)),
                    first_chunks(samples, batch_split),
                    batch_split,
                )
            )
            if isolate:
                # The checks read a big model here; glibc would keep its pages (GBs) while the
                # variants are built and probed in children.
                return_freed_memory()
        else:
            results.append(
                _run(
                    isolate,
                    _build,
                    name,
                    _source_for(name, original, results),
                    out / f"{original.stem}.{name}.onnx",
                    knowledges,
                )
            )
    results = _check_most_optimised_first(results, first_chunks(samples, batch_split), batch_split, isolate)
    preferred, why = choose_preferred(results)
    return OptimizeResult(
        original=str(original),
        variants=results,
        preferred=preferred.name if preferred else None,
        preferred_path=preferred.path if preferred else None,
        why=why,
    )


def _check_most_optimised_first(
    results: list[VariantResult], samples: Sequence[ProbeSample], split: BatchSplit | None, isolate: bool
) -> list[VariantResult]:
    """Probe the built variants in order of preference and stop at the first that passes: the
    ones after it would not be chosen, and probing a 2 GB graph is minutes of CPU."""
    by_name = {r.name: r for r in results}
    original = by_name.get("original")
    ceiling = _parity_ceiling(original)
    chosen = None
    for name in PREFERENCE:
        result = by_name.get(name)
        if name == "original" or result is None or result.status != "ok" or result.checks:
            continue
        if chosen is not None:
            by_name[name] = result.model_copy(
                update={
                    "status": "not_checked",
                    "reason": f"not probed: {chosen}, which is built on it, passed its checks",
                }
            )
            continue
        by_name[name] = checked = _run(isolate, _check, result, samples, split)
        if checked.status == "ok" and not _worse_than(checked, ceiling):
            chosen = name
    return [by_name[r.name] for r in results]


def _run(isolate: bool, work, *args) -> VariantResult:
    """`work` here, or in a fresh process for a big model (onnxslim's and ORT's copies of a 2 GB
    graph): if the OOM killer takes it, this variant fails instead of the tool server dying."""
    if not isolate:
        return work(*args)
    try:
        return run_in_child(work, *args)
    except ChildDied as err:
        name = args[0].name if isinstance(args[0], VariantResult) else args[0]
        return VariantResult(
            name=name,
            status="failed",
            built_from=str(args[1]) if work is _build else None,
            reason=f"the process {'building' if work is _build else 'checking'} the variant died ({err})",
        )


def _source_for(name: VariantName, original: Path, done: Sequence[VariantResult]) -> Path:
    """auto_optimizer works on the onnxslim variant when that one was built (msit's own flow
    simplifies first), so the preference order is also an order of increasing optimisation."""
    slim = next((r for r in done if r.name == "onnxslim" and r.status == "ok" and r.path), None)
    return Path(slim.path) if name == "auto_optimizer" and slim else original


def _build(name: VariantName, source: Path, destination: Path, knowledges: list[str] | None) -> VariantResult:
    """Make the variant; status ok (built, not yet checked), unchanged, marginal, unavailable or failed."""
    started = time.perf_counter()
    knowledge_outcomes = []
    share, min_share = None, MARGINAL_SHARE if model_bytes(source) >= ISOLATE_MIN_BYTES else 0.0
    try:
        if name == "onnxslim":
            share = make_onnxslim(source, destination, min_share)
        else:
            knowledge_outcomes, share = make_auto_optimizer(source, destination, knowledges, min_share)
    except AutoOptimizerUnavailable as err:
        return VariantResult(name=name, status="unavailable", built_from=str(source), reason=str(err))
    except Exception as err:  # one variant's failure must not stop the others
        return VariantResult(
            name=name,
            status="failed",
            built_from=str(source),
            reason=f"building the variant failed: {type(err).__name__}: {err}"[:1000],
        )
    changed = _worth_keeping(share, min_share)
    marginal = share is not None and not changed
    reason = None if changed else f"{name} left the graph as it was"
    if marginal:
        reason = (
            f"{name} added or removed {share:.2%} of the nodes, under the {min_share:.0%} worth a probe of a graph of "
            f"{model_bytes(source) / 2**30:.2f} GiB: the variant is not kept"
        )
    result = VariantResult(
        name=name,
        status="ok" if changed else "marginal" if marginal else "unchanged",
        path=str(destination) if changed else None,
        built_from=str(source),
        seconds=round(time.perf_counter() - started, 3),
        reason=reason,
        knowledges=knowledge_outcomes,
    )
    if name == "auto_optimizer":
        result.reason = "; ".join(filter(None, [result.reason, _knowledge_note(knowledge_outcomes)]))
    return result


def _knowledge_note(outcomes: list[KnowledgeOutcome]) -> str:
    by_outcome = {o: [k.name for k in outcomes if k.outcome == o] for o in ("applied", "failed", "rejected")}
    note = f"knowledges applied: {by_outcome['applied'] or 'none'}"
    if by_outcome["failed"]:
        note += f"; raised an error (skipped): {by_outcome['failed']}"
    if by_outcome["rejected"]:
        note += f"; broke the graph (undone): {by_outcome['rejected']}"
    return note


def _check(built: VariantResult, samples: Sequence[ProbeSample], split: BatchSplit | None) -> VariantResult:
    """check_variant on a built variant, keeping what the build recorded."""
    assert built.path is not None
    checked = check_variant(built.name, Path(built.path), samples, split=split)
    checked.seconds, checked.built_from, checked.knowledges = built.seconds or 0.0, built.built_from, built.knowledges
    checked.reason = "; ".join(filter(None, [checked.reason, built.reason])) or None
    return checked


def _signature(model: onnx.ModelProto) -> Counter[bytes]:
    """The graph's interface and its nodes as a multiset, node names aside: equal signatures,
    the same computation."""
    graph = model.graph
    nodes = Counter(
        f"{kind}:{value.name}".encode()
        for kind, values in (("input", graph.input), ("output", graph.output), ("initializer", graph.initializer))
        for value in values
    )
    for node in graph.node:
        unnamed = onnx.NodeProto()
        unnamed.CopyFrom(node)
        unnamed.name = ""
        nodes[unnamed.SerializeToString(deterministic=True)] += 1
    return nodes


def make_onnxslim(source: Path, target: Path, min_share: float = 0.0) -> float | None:
    """onnxslim on the graph with its weights detached (see onnxfiles.detached_weights). Returns
    None when it changed nothing, else the share of the graph's nodes it added or removed
    (`_operator_share`, 0 when it only rewrote some); nothing is kept when it changed nothing or
    under `min_share`."""
    import onnxslim

    model, weights = detach(source, target)
    before = _signature(model)
    with stdout_to_stderr():
        # Given a model only, slim() returns the result quietly; saving is ours.
        slim = onnxslim.slim(model)
    if not isinstance(slim, onnx.ModelProto):
        discard(target)
        raise OmskillsError(f"onnxslim returned {type(slim).__name__}, not a model, for {source}")
    share = _operator_share(model, slim) if _signature(slim) != before else None
    _keep(slim, weights, target, changed=_worth_keeping(share, min_share))
    return share


def make_auto_optimizer(
    source: Path, target: Path, knowledges: list[str] | None, min_share: float = 0.0
) -> tuple[list[KnowledgeOutcome], float | None]:
    """auto_optimizer's knowledges on the graph with its weights detached; the outcomes, and as
    `make_onnxslim` the share of the nodes they added or removed (None when none applied)."""
    model, weights = detach(source, target)
    with stdout_to_stderr():
        api = load_auto_optimizer()
        optimised, outcomes = apply_knowledges(api, model, knowledges)
    # Its graph object rewrites every Constant as an initializer: what changed is what applied.
    share = _operator_share(model, optimised) if any(o.outcome == "applied" for o in outcomes) else None
    _keep(optimised, weights, target, changed=_worth_keeping(share, min_share))
    return outcomes, share


def _operator_share(before: onnx.ModelProto, after: onnx.ModelProto) -> float:
    """Nodes added or removed, counted per operator type, as a share of `before`'s nodes.
    Constants aside (auto_optimizer turns them into initializers), and renamed tensors do not
    count (onnxslim renames them all over the graph)."""
    ops_before, ops_after = (
        Counter(n.op_type for n in m.graph.node if n.op_type != "Constant") for m in (before, after)
    )
    moved = sum((ops_before - ops_after).values()) + sum((ops_after - ops_before).values())
    return moved / max(sum(ops_before.values()), 1)


def _worth_keeping(share: float | None, min_share: float) -> bool:
    """A variant is kept when its optimiser changed the graph (`share` not None) by at least `min_share`."""
    return share is not None and share >= min_share


def _keep(model: onnx.ModelProto, weights: dict[str, str], target: Path, changed: bool) -> None:
    if not changed:
        discard(target)
        return
    onnx.save_model(attach(model, weights), str(target))


def check_variant(
    name: VariantName,
    path: Path,
    samples: Sequence[ProbeSample],
    probed: ParityReport | None = None,
    split: BatchSplit | None = None,
) -> VariantResult:
    """onnx checker, ORT load, outputs produced, and parity on `samples` (or, given `probed`,
    the load and parity that probe_onnx already measured on this file); `split`: the batch in chunks."""
    model = onnx.load(str(path), load_external_data=False)
    checks = [checker_check(path), outputs_produced_check(model)]
    metrics: list[OutputParity] = []
    verdict: Verdict | None = None
    backend = None
    if probed is not None:
        metrics, verdict = list(probed.outputs), probed.verdict
        checks.append(VariantCheck(name="ort_load", passed=True, detail="loaded by probe_onnx"))
        checks.append(
            VariantCheck(
                name="parity",
                passed=verdict != "fail",
                detail=f"probe_onnx on {len(samples)} sample(s): verdict {verdict} (its worst sample)",
            )
        )
    else:
        try:
            backend = open_onnxruntime(path, split)
        except Exception as err:
            checks.append(VariantCheck(name="ort_load", passed=False, detail=f"{type(err).__name__}: {err}"[:500]))
    if backend is not None:
        checks.append(VariantCheck(name="ort_load", passed=True, detail=backend.describe()))
        with backend:
            if samples:
                try:
                    metrics, verdict, detail = probe_parity(backend, samples)
                    checks.append(VariantCheck(name="parity", passed=verdict != "fail", detail=detail))
                except BackendError as err:
                    # A variant that loads but cannot run a real sample (onnxslim folding a shape
                    # the sample does not have) fails; the step goes on with the other variants.
                    checks.append(
                        VariantCheck(name="parity", passed=False, detail=f"does not run a sample: {err}"[:500])
                    )
    failed = [c.name for c in checks if not c.passed]
    return VariantResult(
        name=name,
        status="failed" if failed else "ok",
        path=str(path),
        reason=f"failed check(s): {failed}" if failed else None,
        node_count=len(model.graph.node),
        checks=checks,
        samples_probed=len(samples) if verdict is not None else 0,
        parity_verdict=verdict,
        parity=metrics,
    )


def checker_check(path: Path) -> VariantCheck:
    """onnx.checker on the file path (works past 2 GiB); full_check adds strict shape inference."""
    try:
        onnx.checker.check_model(str(path), full_check=True)
        return VariantCheck(name="onnx_checker", passed=True, detail="full_check")
    except Exception as full_err:
        try:
            onnx.checker.check_model(str(path))
        except Exception as err:
            return VariantCheck(name="onnx_checker", passed=False, detail=f"{type(err).__name__}: {err}"[:500])
        return VariantCheck(
            name="onnx_checker",
            passed=True,
            detail=f"structure valid; full_check (strict shape inference) failed: {full_err}"[:500],
        )


def outputs_produced_check(model: onnx.ModelProto) -> VariantCheck:
    """Every graph output must come from a node, a graph input or an initializer."""
    graph = model.graph
    produced = {o for node in graph.node for o in node.output if o}
    produced |= {i.name for i in graph.input} | {i.name for i in graph.initializer}
    dangling = [o.name for o in graph.output if o.name not in produced]
    names = [o.name for o in graph.output]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if dangling or duplicated:
        parts = ([f"not produced by any node: {dangling}"] if dangling else []) + (
            [f"listed twice: {duplicated}"] if duplicated else []
        )
        return VariantCheck(name="outputs_produced", passed=False, detail="; ".join(parts))
    return VariantCheck(name="outputs_produced", passed=True, detail=f"{len(names)} output(s)")


def probe_samples(path: Path, sample_paths: list[Path], split: BatchSplit | None = None) -> list[ParityReport]:
    """ONNX Runtime against each captured sample (loaded one at a time: 4-frame samples of the
    full-scale backbone are GBs). Where `split` says the batch goes in chunks, the samples' first
    chunks, one per shape of chunk (`first_chunks`): every chunk of one shape runs the same
    operators (as the probe keeps one sample per shape), and verify runs the whole batch, chunk by
    chunk, on the main path. A child process runs this for a big graph: this module imports no torch."""
    reports = []
    with open_onnxruntime(path, split) as backend:
        wanted = {spec.name for spec in backend.inputs}
        for sample in first_chunks(sample_paths, split):
            feeds, reference = sample_arrays(sample)
            reports.append(compare_outputs(reference, backend.run({k: v for k, v in feeds.items() if k in wanted})))
    return reports


def probe_parity(backend, samples: Sequence[ProbeSample]) -> tuple[list[OutputParity], Verdict, str]:
    """Run every sample and compare with its reference; per output, the worst sample counts."""
    worst: dict[str, OutputParity] = {}
    # An optimiser may drop graph inputs nothing reads (onnxslim does): feed what the variant takes.
    wanted = {spec.name for spec in backend.inputs}
    for feeds, reference in map(sample_arrays, samples):
        report = compare_outputs(reference, backend.run({k: v for k, v in feeds.items() if k in wanted}))
        for parity in report.outputs:
            if parity.name not in worst or _worse(parity, worst[parity.name]):
                worst[parity.name] = parity
    per_output = list(worst.values())
    verdict = overall_verdict(per_output)
    chunks = " (the first batch chunk of each)" if any(isinstance(s, FirstChunk) for s in samples) else ""
    return per_output, verdict, f"{len(samples)} sample(s){chunks}, {len(per_output)} output(s), verdict {verdict}"


def _worse(a: OutputParity, b: OutputParity) -> bool:
    rank_a, rank_b = verdict_rank(a.verdict), verdict_rank(b.verdict)
    if rank_a != rank_b:
        return rank_a > rank_b
    return (a.max_abs or 0.0) > (b.max_abs or 0.0)


def _parity_ceiling(original: VariantResult | None) -> int | None:
    return verdict_rank(original.parity_verdict) if original and original.parity_verdict else None


def _worse_than(result: VariantResult, ceiling: int | None) -> bool:
    return ceiling is not None and result.parity_verdict is not None and verdict_rank(result.parity_verdict) > ceiling


def choose_preferred(results: Sequence[VariantResult]) -> tuple[VariantResult | None, str]:
    """First of auto_optimizer -> onnxslim -> original that passed every check and is no less
    accurate than the original (an optimisation must not move a model down a parity tier)."""
    by_name = {r.name: r for r in results}
    ceiling = _parity_ceiling(by_name.get("original"))
    passed_over: list[str] = []
    for name in PREFERENCE:
        result = by_name.get(name)
        if result is None:
            continue
        if result.status != "ok":
            passed_over.append(f"{name}: {result.status}")
            continue
        if _worse_than(result, ceiling):
            passed_over.append(f"{name}: parity {result.parity_verdict} is worse than the original's")
            continue
        reason = f"first in order {list(PREFERENCE)} that passed its checks"
        return result, reason + (f" (passed over: {'; '.join(passed_over)})" if passed_over else "")
    return None, "no variant passed its checks: " + "; ".join(passed_over)
