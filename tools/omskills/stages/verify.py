"""Stage 4: splice the compiled candidates into the live model and verify the main path.

The same inputs go through the PyTorch reference and the spliced pipeline in one process. Per
step every output check of the driver is applied (ids, region IoU, coordinates, tensors), and
the report says which backend really ran each graph. A rerun reuses the recorded verification
while everything it depends on is unchanged (`_inputs_hash`) and the reports it wrote are intact.
"""

from __future__ import annotations

from pathlib import Path

from omskills import progress
from omskills.deploy.manifest import graph_from_record
from omskills.errors import InputError
from omskills.isolation import return_freed_memory
from omskills.models.api import MainPathRun, RunHooks
from omskills.models.registry import driver_for
from omskills.records.contracts import ContractSpec, ShapeStrategy
from omskills.records.stage_order import step_key
from omskills.records.task import TaskRecord
from omskills.records.verify import VerifyReport
from omskills.report.wording import plural
from omskills.runtime import BACKENDS
from omskills.splicing.splice import SpliceBackend, splice
from omskills.stages.glue import captured_hops, decided
from omskills.stages.merged_graphs import merged_run
from omskills.stages.model import TaskModel, open_model
from omskills.stages.spliced_runs import chosen_emulation, chosen_modes, open_spliced, page_out_spliced, spliceable
from omskills.stages.steps import StepStart, artifacts_of, fingerprint
from omskills.stages.study import study_inputs_hash
from omskills.stages.verify_report import verification_report, write_verification_report


def verify_main_path(task_path: Path, backend: str = "onnxruntime", precision: str = "fp32") -> VerifyReport:
    """The main path through PyTorch and through the spliced pipeline. `precision`: "fp32" (the
    graphs as exported), or "emulated" (each in its chosen ATC precision mode, emulated on
    ONNX Runtime CPU: the parity to expect on Ascend from the numerics alone)."""
    if backend not in BACKENDS:
        raise InputError(f"backend: no runtime backend named {backend!r}; installed: {', '.join(BACKENDS.names())}")
    if precision not in ("fp32", "emulated"):
        raise InputError(f"precision: {precision!r} is not one of 'fp32', 'emulated'")
    emulated = precision == "emulated"
    if emulated and backend != "onnxruntime":
        raise InputError(f"precision 'emulated' runs on onnxruntime (CPU), not on {backend!r}")
    start = StepStart.of(task_path, step_key("verify", None, "emulated" if emulated else None))
    record, workdir = start.record, start.workdir
    names, skipped = spliceable(record)
    start.require_intact(
        {step_key(kind, n): None for n in names for kind in ("export", "optimize")},
        "export_onnx / optimize_onnx",
    )
    modes = chosen_modes(record, names) if emulated else {}
    inputs_hash = _inputs_hash(record, workdir, names, skipped, backend, modes)
    recorded = record.verification_emulated if emulated else record.verification
    if start.done(inputs_hash) and recorded is not None:
        return recorded
    model = open_model(record, workdir)
    driver, loaded = model.driver, model.loaded
    with start.running(inputs_hash) as step:
        progress.report(0, 3, f"verify: reference run of the main path in PyTorch ({plural(driver.step_name)})...")
        reference = model.run()
        notes = page_out_spliced(loaded.root, record, names, workdir)
        return_freed_memory()  # the reference run's activations go back too
        replacements = [
            (
                record.contracts[n],
                open_spliced(record, workdir, n, backend, chosen_emulation(record, n) if emulated else None),
            )
            for n in names
        ]
        strategies = {n: record.boundaries[n].shape_strategy for n in names if record.boundaries[n].shape_strategy}
        progress.report(1, 3, f"verify: spliced run, {len(names)} graph(s) on {backend}...")
        with splice(loaded.root, replacements, strategies=strategies) as handle:
            spliced = model.run(RunHooks(on_step=handle.traffic.step_done))
        progress.report(2, 3, "verify: comparing outputs, writing the report and pictures...")
        report = verification_report(record, workdir, model, reference, spliced, handle, names, modes, backend)
        report.notes += notes
        if not emulated and report.traffic is not None:
            _boundaries(record, workdir, model, reference, replacements, strategies, report, backend)
        report = write_verification_report(report, record, model, reference, spliced, workdir)
        written = [report.report_html, report.report_json, *report.figures]
        step.result.artifacts += artifacts_of([workdir / path for path in written], workdir)
        step.update(_stored(report))
    return report


def _inputs_hash(
    record: TaskRecord, workdir: Path, names: list[str], skipped: dict[str, str], backend: str, modes: dict[str, str]
) -> str:
    """What a verification depends on: the intake and the driver's code (as the study does), the
    graphs spliced and why the others are not, each graph as a deployment opens it (its export,
    contract, shape strategy, files, precision), the backend, and the packages that run them."""
    environment = record.environment
    packages = (environment.torch.version, environment.packages) if environment else None
    return fingerprint(
        study_inputs_hash(record, driver_for(record.intake.model, workdir)),
        names,
        skipped,
        [record.exports[n].sha256 for n in names],
        [graph_from_record(record, workdir, n) for n in names],
        backend,
        modes,
        packages,
    )


def _boundaries(
    record: TaskRecord,
    workdir: Path,
    model: TaskModel,
    reference: MainPathRun,
    replacements: list[tuple[ContractSpec, SpliceBackend]],
    strategies: dict[str, ShapeStrategy],
    report: VerifyReport,
    backend: str,
) -> None:
    """The host code between the graphs captured (`stages.glue`), then graphs that read only
    another's unchanged outputs, or its outputs through glue worth taking in, composed with it and
    verified. A composed graph is an ONNX graph: on another backend the merges are proposed, not run."""
    if backend != "onnxruntime":
        report.notes.append(f"merge proposals not run: composed graphs are ONNX, the spliced run used {backend}")
        return
    found, recorder = [], None
    if len(replacements) > 1:
        progress.report(2, 3, "verify: the main path again, recording the host code between the graphs...")
        found, recorder = captured_hops(record, model, replacements, strategies)
    if any(m.mergeable for m in report.traffic.merges) or any(hop.program is not None for hop in found):  # type: ignore[union-attr]
        progress.report(2, 3, "verify: the main path again with mergeable graphs composed into one...")
        report.merged = merged_run(
            record,
            workdir,
            model,
            reference,
            replacements,
            strategies,
            report.traffic.merges,  # type: ignore[union-attr]
            report.comparison,
            backend,
            found,
        )
    if recorder is not None:
        report.glue = decided(found, recorder, report.merged)
        if recorder.error:
            report.notes.append(f"the capture of the host code between the graphs stopped at {recorder.error}")


def _stored(report: VerifyReport):
    def store(rec: TaskRecord) -> None:
        summary = (
            f"{report.main_path.summary()}; fallbacks {report.main_path.fallbacks}, "
            f"spliced/torch latency {report.main_path.latency_ratio:.2f}"
        )
        if report.precision == "emulated":  # expected parity on Ascend; statuses stay those of fp32
            rec.verification_emulated = report
            rec.decide("verify_main_path", f"main path with Ascend precision emulated: {report.verdict}", summary)
            return
        rec.verification = report
        # A candidate with several graphs is integrated when every one of them is.
        for c in sorted(report.candidates, key=lambda c: c.status == "fallback"):
            rec.set_status(c.name, c.status)
        rec.decide("verify_main_path", f"main path {report.verdict}", summary)

    return store
