"""The study run: the main path once, instrumented for both stage 1 and stage 2.

One model run gives the profile (hooks on every module), the contracts of every seed
candidate (hooks on the candidates, provenance of every tensor) and the main-path
outputs. Profiling first and capturing later would mean two runs of minutes each.

A driver that names no seed candidates gets them from a discovery run first: the main path
once with the profiler only, whose heaviest subtrees become the seeds (see
`omskills.profiling.auto_seeds`).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from omskills import progress
from omskills.contracts.capture import capture_contracts
from omskills.contracts.provenance import ProvenanceTracker
from omskills.contracts.routing import route_forward_calls
from omskills.errors import InputError, StageError
from omskills.models.api import LoadedModel, MainPathRun, ModelDriver, RunHooks, driver_checks, run_seeded
from omskills.models.registry import BoundIntake, driver_for
from omskills.profiling.auto_seeds import seeds_from_profile, why_no_seeds
from omskills.profiling.discovery import discovery_profile
from omskills.profiling.profiler import ModuleProfiler
from omskills.records.names import safe_name
from omskills.records.plan import Seed, StudyRun
from omskills.records.results import ModuleShare, ProfileSummary
from omskills.records.stage_order import step_key
from omskills.records.task import TaskRecord, load_record
from omskills.report.wording import counted
from omskills.stages.main_path import write_main_path
from omskills.stages.model import open_model
from omskills.stages.steps import StepStart, artifacts_of, fingerprint

STEP = step_key("study")
MAX_SAMPLES = 2


def study_inputs_hash(record: TaskRecord, driver: ModelDriver) -> str:
    """The intake and the driver's code: either changing means another main path. Names in
    intake.target.deploy count too, as they can add seeds (whose contracts the study captures)."""
    intake = record.intake
    return fingerprint(
        intake.model,
        intake.inputs,
        intake.verification,
        driver.code_fingerprint(),
        *([intake.shape_inputs] if intake.shape_inputs else []),
        *([sorted(intake.target.deploy)] if intake.target.deploy else []),
    )


def _counting_hooks(profiler: ModuleProfiler, done: list[int], what: str) -> RunHooks:
    def on_step(_index: int) -> None:
        done[0] += 1
        profiler.mark_frame()
        progress.report(done[0], None, f"{what}: {done[0]} steps")

    return RunHooks(on_step=on_step, on_prompt=profiler.mark_prompt)


ROOT_SEED = (
    "names the model's root module: a graph takes the place of a module inside its parent, "
    "and the root has none; seed its children, or have the builder return (entry, holder) with the "
    "network as an attribute of a holder module"
)


def declared_seeds(driver: ModelDriver) -> list[Seed]:
    """The driver's seed candidates, as the record stores them (empty: the profile will say)."""
    seeds = [
        Seed(name=s.name, module_path=s.module_path, description=s.description, group=s.group)
        for s in driver.seed_candidates()
    ]
    root = next((s for s in seeds if not s.module_path), None)
    if root is not None:
        raise InputError(f"seed candidate {root.name} {ROOT_SEED} ({driver.family} driver)")
    for seed in seeds:
        try:
            safe_name(seed.name)
        except ValueError as err:
            raise InputError(f"seed candidate name: {err} ({driver.family} driver)") from None
    return seeds


def _discover_seeds(bound: BoundIntake, loaded: LoadedModel, data: Any, named: list[str]) -> list[Seed]:
    """The main path under the profiler alone (warm passes for a fast model); its heaviest subtrees become the seeds."""

    def run_pass(profiler: ModuleProfiler) -> None:
        run_seeded(
            bound.driver,
            loaded,
            data,
            bound.inputs,
            bound.verification,
            _counting_hooks(profiler, [0], "discovery run"),
        )

    profile, _ = discovery_profile(loaded.root, run_pass)
    seeds = seeds_from_profile(profile, named)
    if not seeds:
        raise StageError(
            "the profile shows no subtree with parameters worth a graph: name seed candidates in the "
            f"driver. {why_no_seeds(profile)}"
        )
    return seeds


def _run_shape_inputs(bound: BoundIntake, loaded: LoadedModel, workdir: Path, steps_done: list[int]) -> None:
    """The main path on each of intake.shape_inputs, for the contracts alone (not profiled): the
    candidates' calls then show the sizes the deployment must serve."""
    driver = bound.driver

    def on_step(_index: int) -> None:
        steps_done[0] += 1

    for index, inputs in enumerate(bound.shape_inputs):
        progress.report(steps_done[0], None, f"study run: shape inputs {index + 1} of {len(bound.shape_inputs)}...")
        with driver_checks(driver, f"load_inputs of intake.shape_inputs[{index}]"):
            data = driver.load_inputs(inputs, workdir)
        run_seeded(driver, loaded, data, inputs, bound.verification, RunHooks(on_step=on_step))


def ensure_study(task_path: Path) -> TaskRecord:
    """Run the study unless a finished one with the same intake is in the record."""
    start = StepStart.of(task_path, STEP)
    record, workdir = start.record, start.workdir
    inputs_hash = study_inputs_hash(record, driver_for(record.intake.model, workdir))
    samples_present = all((workdir / p).exists() for c in record.contracts.values() for p in c.samples)
    if start.done(inputs_hash) and record.contracts and samples_present:
        return record
    model = open_model(record, workdir)
    bound, driver, data, loaded = model.bound, model.driver, model.data, model.loaded
    with start.running(inputs_hash) as step:
        declared = declared_seeds(driver)
        progress.report(
            0, None, "study: seeds from the driver" if declared else "study: discovery run to find seed candidates..."
        )
        seeds = declared or _discover_seeds(bound, loaded, data, record.intake.target.deploy)
        tracker = ProvenanceTracker()
        profiler = ModuleProfiler(loaded.root)
        steps_done = [0]
        outcome: list[MainPathRun] = []

        def run() -> None:
            with contextlib.ExitStack() as stack:
                for src in driver.provenance_sources(loaded):
                    stack.enter_context(tracker.wrap_callable(src.owner, src.attribute, src.kind, src.source))
                stack.enter_context(route_forward_calls([loaded.root.get_submodule(s.module_path) for s in seeds]))
                with profiler:
                    outcome.append(
                        run_seeded(
                            driver,
                            loaded,
                            data,
                            bound.inputs,
                            bound.verification,
                            _counting_hooks(profiler, steps_done, "study run"),
                        )
                    )
                _run_shape_inputs(bound, loaded, workdir, steps_done)

        start = time.perf_counter()
        progress.report(
            0, None, f"study run: setup and {driver.step_name} 1 under the profiler and contract capture..."
        )
        contracts = capture_contracts(
            loaded.root,
            {s.name: s.module_path for s in seeds},
            run,
            tracker,
            samples_dir=workdir / "samples",
            max_samples=MAX_SAMPLES + len(bound.shape_inputs),
            frame_counter=lambda: steps_done[0],
            relative_to=workdir,
            derived_args=driver.derived_args(),
            input_sets=1 + len(bound.shape_inputs),
        )
        seconds = time.perf_counter() - start
        progress.report(
            steps_done[0], None, f"study run done ({seconds:.1f} s); writing the profile, contracts and outputs..."
        )
        profile = profiler.report(notes=[f"instrumented run (profiler + contract capture); weights: {loaded.weights}"])
        report = write_main_path(record, bound, loaded, outcome[0], data, workdir / "study", model.load_seconds)
        study = StudyRun(
            inputs_hash=inputs_hash,
            main_path_json=str(Path("study") / "main_path.json"),
            seeds=seeds,
            seeds_from="driver" if declared else "profile",
            contracts_captured=[c.candidate for c in contracts],
            seconds=round(seconds, 3),
            source_limits=driver.source_limits(loaded),
            weights=loaded.weights,
        )

        def store(rec: TaskRecord) -> None:
            rec.study, rec.profile = study, profile
            rec.contracts = {c.candidate: c for c in contracts}
            if rec.inventory is not None:
                rec.inventory = rec.inventory.merge_runtime_findings(report.portability_findings)

        step.update(store)
        # The samples every later step reads: checked before a rerun reuses anything built on them.
        step.result.artifacts += artifacts_of([workdir / p for c in contracts for p in c.samples], workdir)
        step.result.note = (
            f"{counted(len(outcome[0].steps), driver.step_name)}, {len(contracts)} contracts, "
            f"seeds from the {study.seeds_from}, weights {loaded.weights}"
        )
    return load_record(task_path)


def require_study(record: TaskRecord) -> None:
    if record.profile is None or not record.contracts or record.study is None:
        raise StageError("no study run in the task record: run profile_main_path first")


def profile_main_path(task_path: Path, top: int = 12) -> ProfileSummary:
    """The study (run unless done with the same intake), summarised: the heaviest modules and
    the share of each seed candidate."""
    record = ensure_study(task_path)
    require_study(record)
    profile, study = record.profile, record.study
    assert profile is not None and study is not None
    nodes = sorted((n for n in profile.nodes if n.depth >= 1), key=lambda n: n.inclusive_s, reverse=True)[:top]
    return ProfileSummary(
        weights=record.weights(),
        scale=record.intake.model.scale,
        frames=profile.frames,
        total_seconds=profile.total_seconds,
        control_plane_seconds=round(profile.control_plane_seconds, 3),
        top_modules=[
            ModuleShare(
                path=n.path,
                module_class=n.module_class,
                share=round(n.share, 5),
                calls=n.calls,
                calls_per_frame=n.calls_per_frame,
            )
            for n in nodes
        ],
        seeds_from=study.seeds_from,
        candidate_shares={s.name: round(profile.subtree_share(s.module_path), 5) for s in study.seeds},
        main_path_json=study.main_path_json,
    )
