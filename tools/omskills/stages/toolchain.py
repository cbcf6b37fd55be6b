"""onnx-atc-pipeline stage functions over a task record (stage 3).

Each step works on one candidate, is recorded as `<step>:<candidate>` with a fingerprint of
its inputs, and is skipped on a rerun when already done with the same inputs: a crash
mid-stage redoes only the unfinished candidate.
"""

from __future__ import annotations

import logging
from pathlib import Path

from omskills import progress
from omskills.ascend.atc import AtcOptions, build_atc_command, run_atc
from omskills.ascend.ops import precheck_ops as _precheck
from omskills.ascend.pitfalls import check_pitfalls
from omskills.ascend.precision_fix import atc_keep_nodes, write_keep_dtype
from omskills.ascend.precision_modes import UNCHECKED_PRECISION_MODE
from omskills.contracts.batch_axes import batch_axes
from omskills.contracts.samples import Sample, load_sample, one_per_shape, read_arrays
from omskills.convert.export import dynamic_dims_from_strategy
from omskills.convert.export import export_onnx as _export
from omskills.convert.optimize import optimize_variants, probe_samples
from omskills.errors import StageError, one_line
from omskills.isolation import ISOLATE_MIN_BYTES, ChildDied, model_bytes, run_in_child
from omskills.models import cache as model_cache
from omskills.profiling.memory_estimate import plan_probe, probe_budget_bytes
from omskills.records.contracts import ContractSpec, ShapeStrategy
from omskills.records.export import ExporterName, ExportResult
from omskills.records.parity import ParityReport, verdict_rank
from omskills.records.stage_order import TOOLCHAIN_STEPS, step_key
from omskills.records.task import TaskRecord, load_record, updating
from omskills.records.toolchain import AtcResult, BatchIndependence, BatchSplit, OpPrecheck, OptimizeResult
from omskills.run_folder import RunFolder
from omskills.runtime.batch_independence import UNCHECKED, check_batch_independence
from omskills.runtime.batch_split import batch_split_for
from omskills.stages.model import open_model
from omskills.stages.steps import StepStart, artifacts_of, fingerprint, require_intact

logger = logging.getLogger(__name__)


def _sample_paths(record: TaskRecord, workdir: Path, name: str) -> list[Path]:
    contract = record.contract(name)
    if not contract.samples:
        raise StageError(f"candidate {name!r} has no captured samples")
    return [workdir / p for p in contract.samples]


def _probed_sample_paths(record: TaskRecord, workdir: Path, name: str) -> list[Path]:
    """The samples a probe runs: one per distinct set of input shapes. A traced graph computes
    every call of one shape with the same operators, so a second call adds only other values,
    at the price of another run (a minute of CPU for a full-scale backbone on a 4-frame call)."""
    return one_per_shape(_sample_paths(record, workdir, name))


def _samples(record: TaskRecord, workdir: Path, name: str) -> list[Sample]:
    return [load_sample(p) for p in _sample_paths(record, workdir, name)]


def export_candidate(task_path: Path, name: str, exporter: ExporterName = "dynamo") -> ExportResult:
    start = StepStart.of(task_path, step_key("export", name))
    record, workdir = start.record, start.workdir
    contract = record.contract(name)
    boundary = record.boundaries.get(name)
    if boundary is None or not boundary.exportable or boundary.shape_strategy is None:
        raise StageError(f"candidate {name!r} has no exportable boundary: run analyze_boundaries first")
    inputs_hash = fingerprint(contract, boundary.shape_strategy, exporter)
    if start.done(inputs_hash):
        return record.exports[name]
    start.require_intact({"study": contract.samples}, "profile_main_path")  # the samples it traces with
    dims = dynamic_dims_from_strategy(contract, boundary.shape_strategy)
    sample = _tracing_sample(_samples(record, workdir, name), dims)
    model = open_model(record, workdir)
    driver, loaded = model.driver, model.loaded
    module = loaded.root.get_submodule(contract.module_path)
    out = workdir / "onnx" / name / f"{name}.onnx"
    out.parent.mkdir(parents=True, exist_ok=True)
    with start.running(inputs_hash) as handle:
        run = start.run
        handle.result.logs.append(run.stored(out.parent / f"{name}.onnx.export.log"))
        with driver.export_patches(loaded, contract.plan_candidate):
            result = _export(
                module,
                contract,
                [sample.inputs[s.name] for s in contract.inputs],
                out,
                dynamic_dims=dims,
                exporter=exporter,
                log_path=out.parent / f"{name}.onnx.export.log",
            )
        result.path = run.stored(result.path)
        result.log_path = run.stored(result.log_path)

        def store(rec: TaskRecord) -> None:
            rec.exports[name] = result
            rec.toolchain.pop(name, None)  # probes, variants and ATC of an earlier export no longer apply
            for later in [s for s in rec.stages if s.split(":")[:2] in ([k, name] for k in TOOLCHAIN_STEPS)]:
                del rec.stages[later]  # nor their statuses: a stage says done only beside its results
            rec.set_status(name, "exported")

        handle.update(store)
        onnx_file = workdir / result.path
        handle.result.artifacts += artifacts_of([onnx_file, onnx_file.with_name(onnx_file.name + ".data")], workdir)
    return result


def _tracing_sample(samples: list[Sample], dims: dict[str, dict[int, str]]) -> Sample:
    """The first sample in which no dynamic dim is 1: torch.export specialises a dim whose example
    value is 1 (a detector batching frames may see chunks of 1 and 2), so its graph would only run at 1."""

    def has_a_one(sample: Sample) -> bool:
        return any(
            sample.inputs[name].shape[i] == 1 for name, axes in dims.items() for i in axes if name in sample.inputs
        )

    return next((s for s in samples if not has_a_one(s)), samples[0])


def probe_candidate(task_path: Path, name: str, variant: str = "original") -> ParityReport:
    start = StepStart.of(task_path, step_key("probe", name, variant))
    record, workdir = start.record, start.workdir
    path = record.model_path(workdir, name, variant)
    start.require_intact(_model_steps(name, variant, record.contract(name).samples), "export_onnx / optimize_onnx")
    # A variant is made from the export deterministically: its sha and the samples fix the result.
    inputs_hash = fingerprint(record.exports[name].sha256, variant, record.contract(name).samples)
    existing = record.toolchain_of(name).probes.get(variant)
    if start.done(inputs_hash) and existing is not None:
        return existing
    sample_paths = _probed_sample_paths(record, workdir, name)
    captured = len(record.contract(name).samples)
    # Probing needs no PyTorch model; at full scale the model next to a 2 GB backbone's ORT
    # session on 4-frame samples went past 24 GB. Big models are probed in a child process.
    model_cache.release()
    with start.running(inputs_hash) as handle:
        reports, split, predicted = _probe_reports(record, name, path, sample_paths)
        checked = _batch_independence(record, name, path, sample_paths) if variant == "original" else None
        # The sample that fares worst speaks for the candidate: worst verdict, then lowest cosine.
        report = max(reports, key=lambda r: (verdict_rank(r.verdict), -r.worst_cosine))
        if split is not None:
            report = report.model_copy(update={"batch_chunks_of": split.max_batch})

        def store(rec: TaskRecord) -> None:
            chain = rec.toolchain_entry(name)
            chain.probes[variant] = report
            chain.batch_split = split
            if variant == "original":  # a property of the graph: the variants made from it keep it
                chain.batch_independence = checked
            chunked = (
                f"; batch in chunks of {split.max_batch}, one first chunk per shape probed: {split.reason}"
                if split
                else ""
            )
            chunked += f"; {predicted}" if predicted else ""
            if checked is not None:
                chunked += f"; batch {'independent' if checked.independent else 'not split'}: {checked.reason}"
            rec.decide(
                "probe_onnx",
                f"{name}/{variant}: probe {report.verdict}",
                f"{_probed_count(len(sample_paths), captured)}; worst cosine {report.worst_cosine:.6f}, "
                f"max abs {report.worst_max_abs:.2e}{chunked}",
            )

        handle.update(store)
    return report


def _batch_independence(
    record: TaskRecord, name: str, path: Path, sample_paths: list[Path]
) -> BatchIndependence | None:
    """Whether the graph computes its batch items independently (checked on the smallest sample,
    in a child for a big graph), or None when its strategy has no batch gears to split into."""
    decision = record.boundaries.get(name)
    strategy = decision.shape_strategy if decision else None
    contract = record.contract(name)
    if isinstance(batch_axes(contract, strategy), str):
        return None
    smallest = min(sample_paths, key=lambda p: p.stat().st_size)
    if model_bytes(path) < ISOLATE_MIN_BYTES:
        return _check_on_sample(path, smallest, contract, strategy)
    try:
        return run_in_child(_check_on_sample, path, smallest, contract, strategy)
    except ChildDied as err:
        return BatchIndependence(independent=False, reason=f"{UNCHECKED}: the process checking it died ({err})")


def _check_on_sample(
    path: Path, sample: Path, contract: ContractSpec, strategy: ShapeStrategy | None
) -> BatchIndependence | None:
    feeds, _ = read_arrays(sample)
    return check_batch_independence(path, feeds, contract, strategy)


def _probed_count(probed: int, captured: int) -> str:
    return (
        f"{captured} captured samples"
        if probed == captured
        else f"{probed} of {captured} captured samples (one per input shape)"
    )


def _model_steps(
    name: str, variant: str | None = None, samples: list[str] | None = None
) -> dict[str, list[str] | None]:
    """The steps whose files a step reading this graph's ONNX depends on, with the files it reads:
    the graph's samples (study) when given, the export, and the optimised variants unless only
    the original is read."""
    steps: dict[str, list[str] | None] = {"study": samples} if samples is not None else {}
    steps[step_key("export", name)] = None
    if variant != "original":
        steps[step_key("optimize", name)] = None
    return steps


def _relative_optimize(result: OptimizeResult, workdir: Path) -> OptimizeResult:
    """The variants' paths relative to the run folder (a copied run must not read the original's files)."""

    rel = RunFolder(workdir).stored_if_inside

    variants = [v.model_copy(update={"path": rel(v.path), "built_from": rel(v.built_from)}) for v in result.variants]
    return result.model_copy(
        update={"original": rel(result.original), "variants": variants, "preferred_path": rel(result.preferred_path)}
    )


def _relative_atc(result: AtcResult, workdir: Path) -> AtcResult:
    run = RunFolder(workdir)
    return result.model_copy(
        update={
            "command": run.command(result.command),
            "script": run.stored_if_inside(result.script),
            "log": run.stored_if_inside(result.log),
            "om_path": run.stored_if_inside(result.om_path),
            "reason": run.text(result.reason) if result.reason else result.reason,
            "errors": [e.model_copy(update={"message": run.text(e.message)}) for e in result.errors],
        }
    )


def _probe_reports(
    record: TaskRecord, name: str, path: Path, sample_paths: list[Path]
) -> tuple[list[ParityReport], BatchSplit | None, str | None]:
    """Probe reports, the batch split they needed, and what was predicted of the memory when no
    split came of it. A big model is probed in a child, its batch in chunks when the peak predicted
    from the graph does not fit the memory there is (ORT on CPU materialises attention scores); a
    probe that dies anyway is probed again in chunks of its smallest gear."""
    split = record.batch_split_of(name)
    if model_bytes(path) < ISOLATE_MIN_BYTES:
        return probe_samples(path, sample_paths, split), split, None
    recorded, predicted = split is not None, None
    if not recorded:
        split, predicted = _split_from_prediction(record, name, path, sample_paths)
    try:
        return run_in_child(probe_samples, path, sample_paths, split), split, predicted
    except ChildDied as err:
        died = (
            f"the process probing {path.name}{f' in batch chunks of {split.max_batch}' if split else ''} died ({err})"
        )
        retry = None if recorded else _split_after_death(record, name)
        if retry is None or (split is not None and retry.max_batch >= split.max_batch):
            raise StageError(f"{name}: {died}") from err
        if split is not None:  # the prediction was wrong: say so beside it
            retry = retry.model_copy(
                update={
                    "reason": f"{split.reason}; yet the process probing in chunks of "
                    f"{split.max_batch} died, so chunks of the smallest gear"
                }
            )
    logger.warning("%s: %s; probing again with the batch in chunks of %d", name, died, retry.max_batch)
    try:
        return run_in_child(probe_samples, path, sample_paths, retry), retry, predicted
    except ChildDied as err:
        raise StageError(f"{name}: {died}; in batch chunks of {retry.max_batch} it died too ({err})") from err


def _split_from_prediction(
    record: TaskRecord, name: str, path: Path, sample_paths: list[Path]
) -> tuple[BatchSplit | None, str | None]:
    """The batch split the peak predicted for the largest sample asks for, or None with what was
    predicted (the whole batch fits, cannot be split, or the prediction failed: the probe then
    runs whole and a death stays the handled failure)."""
    decision = record.boundaries.get(name)
    try:
        # In a child too: a graph under 2 GB keeps its weights inline, and reading it would leave
        # this long-lived process that much bigger.
        plan = run_in_child(
            plan_probe,
            path,
            sample_paths,
            record.contract(name),
            decision.shape_strategy if decision else None,
            probe_budget_bytes(),
        )
    except Exception as err:  # the prediction only advises: whatever stops it, the probe runs whole
        return None, f"peak not predicted ({one_line(err)})"
    if plan.split is not None:
        logger.warning("%s: %s", name, plan.note)
        return plan.split, None
    return None, plan.note


def _split_after_death(record: TaskRecord, name: str) -> BatchSplit | None:
    decision = record.boundaries.get(name)
    strategy = decision.shape_strategy if decision else None
    if strategy is None or not strategy.gears:
        return None
    smallest = min(gear[0] for gear in strategy.gears)
    return batch_split_for(
        record.contract(name),
        strategy,
        smallest,
        "the process probing the whole batch died (out of memory?); "
        "the chunks' outputs are compared with PyTorch's whole-batch run",
    )


def optimize_candidate(task_path: Path, name: str) -> OptimizeResult:
    start = StepStart.of(task_path, step_key("optimize", name))
    record, workdir = start.record, start.workdir
    original = record.model_path(workdir, name)
    split = record.batch_split_of(name)
    # The split is part of the inputs only when there is one, so earlier records stay done.
    inputs_hash = fingerprint(record.exports[name].sha256, *([split] if split else []))
    existing = record.toolchain_of(name).optimize
    if start.done(inputs_hash) and existing is not None:
        return existing
    start.require_intact(_model_steps(name, "original", record.contract(name).samples), "export_onnx")
    samples = _probed_sample_paths(record, workdir, name)  # loaded one at a time, where they are run
    # At full scale the model (several GB) plus a 2 GB ONNX in three variants and their ORT
    # sessions exceeded 24 GB; optimising needs no PyTorch model, verify reloads it.
    model_cache.release()
    with start.running(inputs_hash) as handle:
        progress.report(0, None, f"optimize {name}: building and checking each variant (onnxslim, auto_optimizer)...")
        probed = record.toolchain_of(name).probes.get("original")
        result = _relative_optimize(
            optimize_variants(original, original.parent, samples, original_probe=probed, batch_split=split), workdir
        )
        made = [workdir / v.path for v in result.variants if v.path and v.name != "original"]
        handle.result.artifacts += artifacts_of(made + [p.with_name(p.name + ".data") for p in made], workdir)

        def store(rec: TaskRecord) -> None:
            rec.toolchain_entry(name).optimize = result
            if result.preferred:
                rec.set_status(name, "optimised")
            rec.decide("optimize_onnx", f"{name}: preferred variant {result.preferred}", result.why)

        handle.update(store)
    return result


def precheck_candidate(task_path: Path, name: str, soc: str | None = None) -> OpPrecheck:
    record = load_record(task_path)
    workdir = TaskRecord.workdir(task_path)
    model = record.preferred_model(workdir, name)
    require_intact(record, workdir, _model_steps(name), "export_onnx / optimize_onnx")
    result = _precheck(model, soc or record.intake.target.soc)
    result.model = RunFolder(workdir).stored_if_inside(result.model) or result.model
    result.pitfalls = check_pitfalls(model, record.toolchain_of(name).precision)
    # Reading the op types costs little next to a record write: the same result leaves the record as it is.
    if record.toolchain_of(name).precheck == result:
        return result
    with updating(task_path) as rec:
        rec.toolchain_entry(name).precheck = result
        pitfalls = "; ".join(f"{h.id} ({h.count} node(s), {'/'.join(h.modes)})" for h in result.pitfalls) or "none"
        decide_unless_repeated(
            rec,
            "precheck_ops",
            name,
            f"{name}: operator precheck {result.verdict}",
            f"counts {result.counts} against {result.table}; known precision pitfalls: {pitfalls}",
        )
    return result


def decide_unless_repeated(rec: TaskRecord, by: str, name: str, what: str, why: str) -> None:
    """A decision about candidate `name`, unless the last one `by` made about it says the same
    (a tool called again with the same result adds nothing to the record's history)."""
    last = next((d for d in reversed(rec.decisions) if d.by == by and d.what.startswith(f"{name}:")), None)
    if last is None or (last.what, last.why) != (what, why):
        rec.decide(by, what, why)


def convert_candidate(task_path: Path, name: str, precision_mode: str | None = None) -> AtcResult:
    start = StepStart.of(task_path, step_key("atc", name))
    record, workdir = start.record, start.workdir
    boundary = record.boundaries.get(name)
    if boundary is None or boundary.shape_strategy is None:
        raise StageError(f"candidate {name!r} has no shape strategy: run analyze_boundaries first")
    model = record.preferred_model(workdir, name)
    start.require_intact(_model_steps(name), "export_onnx / optimize_onnx")
    out_dir = workdir / "om" / name
    options = AtcOptions.from_strategy(
        boundary.shape_strategy,
        model=str(model),
        output=str(out_dir / name),
        soc_version=record.intake.target.soc,
        **_precision_options(record, name, precision_mode, out_dir),
    )
    # Relative paths: the same ATC run in a copied run folder has the same inputs.
    inputs_hash = fingerprint(RunFolder(workdir).command(build_atc_command(options)))
    existing = record.toolchain_of(name).atc
    # Converted with this command and the OM as ATC wrote it: reused. "not_run" and "failed" run
    # again (CANN may have been installed or fixed since); their decision is not repeated.
    if start.done(inputs_hash) and existing is not None and existing.status == "converted":
        return existing
    with start.running(inputs_hash) as handle:
        result = _relative_atc(run_atc(options, out_dir), workdir)
        handle.result.logs += [p for p in (result.log, result.script) if p]
        if result.om_path:
            handle.result.artifacts += artifacts_of([workdir / result.om_path], workdir)
        if result.status == "not_run":
            handle.result.status = "not_run"
            handle.result.note = result.reason
        elif result.status == "failed":
            handle.result.status = "failed"
            handle.result.error = result.reason

        def store(rec: TaskRecord) -> None:
            rec.toolchain_entry(name).atc = result
            if result.status == "converted":
                rec.set_status(name, "converted")
                cand = rec.plan_candidate_of(name)
                if (
                    cand is not None and len(rec.contracts_of(cand.name)) <= 1
                ):  # graphs of one value each keep theirs in atc
                    cand.om_path = result.om_path
            decide_unless_repeated(
                rec,
                "convert_atc",
                name,
                f"{name}: ATC {result.status}",
                result.reason or "ATC exited 0 and wrote the OM",
            )
            if precision_mode is None and rec.toolchain_of(name).precision is None:
                failed = rec.stages.get(step_key("precision", name))
                why = f"its emulation failed ({failed.error})" if failed and failed.error else "no mode was emulated"
                decide_unless_repeated(
                    rec,
                    "convert_atc",
                    name,
                    f"{name}: --precision_mode={UNCHECKED_PRECISION_MODE}",
                    f"{why}: every op stays in its original dtype, slower but safe; "
                    "emulate_precision again to choose a faster mode",
                )

        handle.update(store)
    return result


def _precision_options(record: TaskRecord, name: str, asked: str | None, out_dir: Path) -> dict[str, str]:
    """The precision options for ATC: the mode asked for, else the one emulate_precision chose,
    else (no emulation result) the mode that keeps every fp32 op in fp32: ATC's own default
    (force_fp16) is then a mode nothing here checked. The nodes its emulation proposed to keep and
    those a known pitfall of that mode names go into a --keep_dtype file."""
    chain = record.toolchain_of(name)
    report = chain.precision
    mode = asked or (report.chosen_mode if report else None) or UNCHECKED_PRECISION_MODE
    keep = atc_keep_nodes(chain, mode)
    options = {"precision_mode": mode}
    path = write_keep_dtype(keep, out_dir, name) if mode != "must_keep_origin_dtype" else None
    if path is not None:
        options["keep_dtype"] = str(path)
    return options
