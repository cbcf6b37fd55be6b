"""Run a task's driver once at tiny size and say what is missing before a whole adaptation.

Each part is tried in the order the stages need it: the driver is found, the intake parses,
the model builds, the inputs load, the main path runs and yields outputs, the comparison names
outputs that exist, and the seed candidates (the driver's, or the heaviest subtrees of the
profile) are called with contracts a graph can take. Every failure is a problem in the report,
not an exception: the point is to list them all.
"""

from __future__ import annotations

from pathlib import Path

from omskills.boundary.analysis import analyze_boundary
from omskills.compare.outputs import expand
from omskills.contracts.capture import capture_contracts
from omskills.errors import OmskillsError
from omskills.models.api import MainPathRun, RunHooks, run_seeded
from omskills.models.registry import bind_intake
from omskills.profiling.auto_seeds import seeds_from_profile, why_no_seeds
from omskills.profiling.discovery import discovery_profile
from omskills.profiling.profiler import ModuleProfiler
from omskills.records.profile import ProfileReport
from omskills.records.results import CandidateCheck, DriverCheck
from omskills.records.task import TaskRecord, load_record
from omskills.stages.main_path import summarise
from omskills.stages.model import open_model
from omskills.stages.study import declared_seeds


def check_driver(task_path: Path) -> DriverCheck:
    """The driver of the task record, tried once with the record's model spec at scale tiny."""
    report = DriverCheck(ok=False, task=str(task_path))
    try:
        _check(task_path, report)
    except OmskillsError as err:
        report.problems.append(str(err))
    except Exception as err:  # a driver's own bug: named, with its type, as the user must fix it
        report.problems.append(f"{type(err).__name__}: {err}")
    report.ok = not report.problems
    return report


def _check(task_path: Path, report: DriverCheck) -> None:
    record = load_record(task_path)
    workdir = TaskRecord.workdir(task_path)
    driver = bind_intake(record.intake, workdir).driver
    report.family, report.driver = driver.family, f"{type(driver).__module__}:{type(driver).__qualname__}"
    report.step_name = driver.step_name
    model = open_model(record, workdir, record.intake.model.model_copy(update={"scale": "tiny"}))
    bound, data, loaded = model.bound, model.data, model.loaded
    report.modules = sum(1 for _ in loaded.root.modules())
    report.parameters = sum(p.numel() for p in loaded.root.parameters())
    report.notes += list(loaded.notes)

    def run_pass(profiler: ModuleProfiler) -> MainPathRun:
        return run_seeded(
            driver, loaded, data, bound.inputs, bound.verification, RunHooks(on_step=lambda _i: profiler.mark_frame())
        )

    profile, run = discovery_profile(loaded.root, run_pass)
    report.steps = len(run.steps)
    if not run.steps:
        report.problems.append("run_main_path returned no steps: return (or yield) the model's outputs")
        return
    first = run.steps[0].outputs
    report.outputs = [summarise(name, value) for name, value in first.items()]
    if not first:
        report.problems.append("the first step has no outputs: return the tensors the model produced")
    checks = expand(driver.comparison(bound.verification), first)
    report.comparison = [c.title for c in checks]
    for check in checks:
        for name in [check.output] + ([check.key] if check.key else []):
            if name not in first:
                report.problems.append(
                    f"the comparison checks output {name!r}, which the main path does not return "
                    f"(it returns {sorted(first)})"
                )
    _check_candidates(report, driver, loaded, bound, data, profile)


def _check_candidates(report, driver, loaded, bound, data, profile: ProfileReport) -> None:
    declared = declared_seeds(driver)
    seeds = declared or seeds_from_profile(profile)
    report.seeds_from = "driver" if declared else "profile"
    missing = []
    for seed in seeds:
        try:
            loaded.root.get_submodule(seed.module_path)
        except AttributeError:
            missing.append(seed)
            report.problems.append(
                f"seed candidate {seed.name}: no module {seed.module_path!r} in {type(loaded.root).__name__}"
            )
    seeds = [s for s in seeds if s not in missing]
    if not seeds:
        found = f" ({why_no_seeds(profile)})" if not declared else ""
        report.problems.append(
            f"no candidate: name SEED_CANDIDATES, or check that the main path calls modules with parameters{found}"
        )
        return

    def run() -> None:
        run_seeded(driver, loaded, data, bound.inputs, bound.verification)

    try:
        contracts = capture_contracts(
            loaded.root, {s.name: s.module_path for s in seeds}, run, derived_args=driver.derived_args()
        )
    except OmskillsError as err:  # e.g. a seed never called on the main path
        report.problems.append(str(err))
        return
    for seed in seeds:
        graphs = [c for c in contracts if c.plan_candidate == seed.name]
        decisions = [analyze_boundary(c) for c in graphs]
        exportable = bool(decisions) and all(d.exportable for d in decisions)
        node = profile.node(seed.module_path)
        report.candidates.append(
            CandidateCheck(
                name=seed.name,
                module_path=seed.module_path,
                share=round(node.share, 4) if node else 0.0,
                calls=node.calls if node else 0,
                graphs=len(graphs),
                exportable=exportable,
                reason="; ".join(r for d in decisions for r in d.reasons[:1]) or "never called",
            )
        )
    if not any(c.exportable for c in report.candidates):
        report.problems.append("no candidate has a boundary a graph can take (see each candidate's reason)")
