"""The environment gate: what the task asks is checked before any model runs, then what this
machine can run for it is probed; both go into the task record.

Checked, in order of cost, each a one-line InputError naming the field (the record is not written
then): the intake read through its driver (bounds such as a driver's most frames included), the
target SoC against ATC's list (with a did-you-mean), every path the record names inside the run
folder or an allowed input root, the inputs' files (a video's frame count against the frames
asked), the builder, the checkpoint (it reads, and its keys fit the model at the scale asked).
A target SoC other than the one recorded ATC commands were written for drops those results.

The checks run every time (they are quick, and the intake may have changed); the machine's probe
(packages imported in children, toolchains, devices) is reused from the record while the
machine's state (`machine.probe.machine_state`) is the one it was probed in.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import NamedTuple

from omskills.ascend.atc import check_soc, soc_of_command
from omskills.errors import InputError, OmskillsError
from omskills.machine.probe import device_problem, machine_state, probe_environment
from omskills.models.api import ModelDriver, driver_checks
from omskills.models.registry import BoundIntake, bind_intake, confine_intake, resolved_spec
from omskills.models.weights import gate_line
from omskills.records.environment import EnvironmentReport
from omskills.records.intake import ModelSpec, allowed_input_roots, confined_path
from omskills.records.stage_order import step_key
from omskills.records.stages import StageResult
from omskills.records.task import TaskRecord, load_record, now_iso, updating
from omskills.stages.steps import is_done

logger = logging.getLogger(__name__)

SOC_FIELD = "intake.target.soc"


def check_environment(task_path: Path) -> EnvironmentReport:
    started, clock = now_iso(), time.perf_counter()
    record = load_record(task_path)
    workdir = TaskRecord.workdir(task_path)
    check_soc(record.intake.target.soc, SOC_FIELD)
    bound = bind_intake(record.intake, workdir)
    confine_record(record, workdir, bound.driver)
    spec = resolved_spec(record.intake.model, workdir)
    try:
        bound.driver.source_root(spec)
        model_problem = None
    except OmskillsError as err:
        model_problem = str(err)
    checked = check_task_inputs(bound, spec, workdir, model_found=model_problem is None)
    state = machine_state(record.intake, model_problem)
    reused = is_done(record, step_key("environment"), state) and record.environment is not None
    report = record.environment if reused else probe_environment(record.intake, model_problem)
    if reused:
        logger.info("environment: the probe of %s reused (the same machine state)", report.probed_at)
    report.checked = checked
    device = device_problem(report.torch, record.intake.model.device)
    if device:
        raise InputError(f"intake.model.device: {device}")
    with updating(task_path) as rec:
        rec.environment = report
        dropped = drop_results_for_other_soc(rec)
        if dropped.atc or dropped.precheck:
            rec.decide(
                "check_environment",
                dropped.summary(),
                f"they were written for another SoC than {SOC_FIELD} {rec.intake.target.soc}",
            )
        blocked = [s.stage for s in report.stages if not s.can_run]
        can = f"cannot run here: {', '.join(blocked)}" if blocked else "every stage can run here"
        rec.stages[step_key("environment")] = StageResult(
            status="done",
            inputs_hash=state,
            started=started,
            seconds=round(time.perf_counter() - clock, 3),
            note=can,  # the same whether the probe ran or was reused: a rerun leaves the record as it was
        )
    return report


def confine_record(record: TaskRecord, workdir: Path, driver: ModelDriver) -> None:
    """Every path the record names (the intake's source, checkpoint and input files, the exports
    and optimised variants) must resolve inside the run folder or an allowed input root: the
    $OMSKILLS_INPUT_ROOTS folders and the checkout the driver's own environment variable names."""
    from_env = os.environ.get(driver.source_env or "", "").strip() or None
    roots = allowed_input_roots(workdir, from_env)
    confine_intake(record.intake, workdir, roots)
    inside_run = roots[:1]  # what the stages wrote stays in the run folder
    for graph, export in record.exports.items():
        confined_path(export.path, f"exports.{graph}.path", workdir, inside_run)
    for graph, chain in record.toolchain.items():
        optimize = chain.optimize
        for variant in optimize.variants if optimize else []:
            if variant.path:
                confined_path(
                    variant.path, f"toolchain.{graph}.optimize.variants.{variant.name}.path", workdir, inside_run
                )
        if optimize and optimize.preferred_path:
            confined_path(optimize.preferred_path, f"toolchain.{graph}.optimize.preferred_path", workdir, inside_run)


def check_task_inputs(bound: BoundIntake, spec: ModelSpec, workdir: Path, model_found: bool) -> list[str]:
    """The inputs' files, the checkpoint file, the builder and the checkpoint's keys, cheapest
    first; what was found, in words."""
    from omskills.models.checkpoints import key_mismatch, read_state_dict

    driver = bound.driver
    with driver_checks(driver, "check_inputs"):
        checked = driver.check_inputs(bound.inputs, workdir)
    for index, shape_inputs in enumerate(bound.shape_inputs):
        where = f"intake.shape_inputs[{index}]"
        with driver_checks(driver, f"check_inputs of {where}"):
            checked += [f"{where}: {line}" for line in driver.check_inputs(shape_inputs, workdir)]
    found = read_state_dict(Path(spec.checkpoint)) if spec.checkpoint else None
    if not model_found:  # the probe reports the missing source; the builder and the keys need it
        return checked
    with driver_checks(driver, "check_builder"):
        checked.append(driver.check_builder(spec))
    if found is None:
        return checked + [gate_line(driver, spec)]
    with driver_checks(driver, "expected_state_keys"):
        expected = driver.expected_state_keys(spec)
    mismatch = key_mismatch(expected, found) if expected is not None else None
    if mismatch:
        raise InputError(
            f"intake.model.checkpoint: {spec.checkpoint} does not fit the {spec.scale} "
            f"{driver.family} model: {mismatch}"
        )
    fit = (
        f"its keys fit the {spec.scale} model"
        if expected is not None
        else f"keys not checked here (the {driver.family} driver cannot list them without building the model)"
    )
    return checked + [f"intake.model.checkpoint: {spec.checkpoint}, {len(found)} tensors, {fit}"]


class DroppedForSoc(NamedTuple):
    """The graphs whose ATC results, and whose operator prechecks, were made for another SoC."""

    atc: list[str]
    precheck: list[str]

    def summary(self) -> str:
        parts = [
            f"{what} dropped for {', '.join(graphs)}"
            for what, graphs in (("ATC results", self.atc), ("operator prechecks", self.precheck))
            if graphs
        ]
        return "; ".join(parts)


def drop_results_for_other_soc(record: TaskRecord) -> DroppedForSoc:
    """ATC results and operator prechecks made for another SoC than the target's are dropped (ATC's
    with its step), so they rerun and no delivery document ships commands for the old SoC."""
    soc = record.intake.target.soc
    dropped = DroppedForSoc(atc=[], precheck=[])
    for graph, chain in record.toolchain.items():
        if chain.atc is not None and soc_of_command(chain.atc.command) not in (None, soc):
            chain.atc = None
            record.stages.pop(step_key("atc", graph), None)
            dropped.atc.append(graph)
        if chain.precheck is not None and chain.precheck.soc != soc:
            chain.precheck = None
            dropped.precheck.append(graph)
    return dropped
