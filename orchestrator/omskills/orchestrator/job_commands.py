"""`omskills main-path` and `omskills adapt`: the main jobs, thin over the engine."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .command_table import command

if TYPE_CHECKING:
    from omskills.records.intake import Intake


def _main_path_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("task", help="task record (YAML)")
    _override_args(p)
    p.add_argument("--out", help="output folder (default: runs/<task id>-<scale>/main_path)")


def _override_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scale", choices=["tiny", "full"], help="override intake.model.scale")
    p.add_argument("--frames", type=int, help="override intake.inputs.frames (drivers whose inputs have frames)")
    p.add_argument("--source", help="override intake.model.source (a checkout path, or `package`)")
    p.add_argument("--soc", help="override intake.target.soc (the Ascend SoC the ATC command targets)")


def _with_overrides(record, base_dir: Path, ns: argparse.Namespace):
    """Apply --scale/--frames/--source/--soc to the record in memory (the YAML file is not changed)."""
    from omskills.errors import InputError
    from omskills.models.registry import bind_intake, driver_for

    driver = driver_for(record.intake.model, base_dir)
    if ns.source:
        record.intake.model.source = ns.source
    elif driver.source_env and os.environ.get(driver.source_env):
        # Into the run's copy of the record: every stage reads one source.
        record.intake.model.source = os.environ[driver.source_env]
    if ns.scale:
        record.intake.model.scale = ns.scale
    if ns.soc:
        record.intake.target.soc = ns.soc
    if ns.frames is not None:
        if "frames" not in driver.inputs_model.model_fields:
            raise InputError(f"--frames: the inputs of the {driver.family} driver have no frames field")
        if ns.frames < 1:
            raise InputError("--frames must be at least 1")
        record.intake.inputs["frames"] = ns.frames
    bind_intake(record.intake, base_dir)  # a malformed intake field is named before any work starts
    return record


class PhaseLines:
    """Shows the engine's progress reports as lines on stderr, with the seconds since the start:
    a log file keeps them, where it hides tqdm's redrawn bars."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._last: str | None = None

    def __call__(self, done: float, total: float | None, message: str) -> None:
        if message != self._last:  # a repeated message adds nothing to a log
            self._last = message
            print(f"[{time.perf_counter() - self._start:6.1f} s] {message}", file=sys.stderr, flush=True)


@command("main-path", _main_path_args)
def _main_path(ns: argparse.Namespace) -> int:
    """Run the model's main path once and write main_path.json, outputs.npz and its pictures."""
    from omskills import progress

    with progress.reporting_to(PhaseLines()):
        # Said before the imports: reading the record imports its driver (torch, the model's package).
        progress.report(0, None, f"reading {ns.task} and loading its model driver...")
        from omskills.records.task import load_record
        from omskills.report.wording import counted
        from omskills.stages.main_path import run_and_report

        task_path = Path(ns.task)
        base = task_path.resolve().parent
        record = _with_overrides(load_record(task_path), base, ns)
        out = Path(ns.out) if ns.out else Path("runs") / f"{record.id}-{record.intake.model.scale}" / "main_path"
        if out.exists() and not out.is_dir():  # said now, not after the model has run
            from omskills.errors import InputError

            raise InputError(f"--out: {out} is a file, not a folder")
        report, _ = run_and_report(record, base, out)
    unit = report.step_name
    print(
        f"{report.model_family} {report.scale} | weights: {report.weights} | {counted(report.num_steps, unit)} "
        f"in {report.total_seconds:.1f} s ({report.seconds_per_step:.2f} s/{unit}) | load {report.load_seconds:.1f} s "
        f"| peak RSS {report.peak_rss_mb / 1024:.2f} GB",
        file=sys.stderr,
    )
    for line in report.verification:
        print(f"  verification: {line}", file=sys.stderr)
    for line in report.notes:
        print(f"  note: {line}", file=sys.stderr)
    for step in report.steps:
        shown = ", ".join(
            f"{o.name} {o.values if o.values is not None and len(str(o.values)) < 60 else o.shape}"
            for o in step.outputs
        )
        print(f"  {unit} {step.index}: {shown}", file=sys.stderr)
    print(f"  {len(report.portability_findings)} portability sites touched; outputs in {out}", file=sys.stderr)
    print(str(out / "main_path.json"))
    return 0


def adaptation_plan(task: str, precision_budget: int | None = None) -> list:
    """The built-in deterministic plan: the declared adaptation steps (records.stage_order), each a
    skill tool called through MCP. `precision_budget`: spliced runs the end-to-end precision check
    may make (the tool's default if None)."""
    from omskills.records.stage_order import ADAPTATION_STEPS

    from .plan_runner import PlanStep

    extra = {"check_precision_plan": {"budget": precision_budget}} if precision_budget is not None else {}
    return [
        PlanStep(tool=s.tool, args={"task": task, **extra.get(s.tool, {})}, stage=s.stage, label=s.label)
        for s in ADAPTATION_STEPS
    ]


def _precision_budget(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 8:
        raise argparse.ArgumentTypeError(f"a whole number of runs from 1 to 8, got {text!r}")
    return int(text)


def _adapt_args(p: argparse.ArgumentParser) -> None:
    from .commands import _agent_limits

    p.add_argument("task", help="task record (YAML); it is copied into the output folder, which holds the run")
    _override_args(p)
    p.add_argument("--out", help="run folder (default: runs/<task id>-<scale>); a rerun resumes there")
    p.add_argument("--agent", choices=["plan", "claude"], default="plan", help="built-in deterministic plan, or Claude")
    p.add_argument(
        "--precision-budget",
        type=_precision_budget,
        default=None,
        metavar="N",
        help="spliced main-path runs the end-to-end precision check may make (default 2: the confirmation, "
        "and one after the graphs at fault get longer keep lists; each is one full pass of the main path)",
    )
    _agent_limits(p)


@command("adapt", _adapt_args)
def _adapt(ns: argparse.Namespace) -> int:
    """Adapt a model end to end: inventory, plan, contracts, ONNX/ATC, splice and verify."""
    import asyncio

    from omskills.models.registry import localised_intake
    from omskills.records.task import load_record, save_record, updating

    from .run_lock import claim_run_folder

    base = Path(ns.task).resolve().parent
    source = _with_overrides(load_record(ns.task), base, ns)
    out = Path(ns.out) if ns.out else Path("runs") / f"{source.id}-{source.intake.model.scale}"
    # One adapt per run folder (exit 2 naming the owner); the record may name inputs beside the given one.
    claim_run_folder(out, inputs_from=(base, ns.source))
    out.mkdir(parents=True, exist_ok=True)
    task = out / "task.yaml"
    intake = _driver_in_run(localised_intake(source.intake, base), out)  # paths stay valid from the run folder
    if task.exists():  # resume: keep the results, take the intake from the command line
        with updating(task) as record:
            record.intake = intake
            for step in record.interrupted_on_load:
                print(
                    f"omskills: step {step} was left running by a process that is gone: "
                    "marked interrupted, this run redoes it",
                    file=sys.stderr,
                )
    else:
        source.intake = intake
        save_record(source, task)
    if ns.agent == "claude":
        from .agent import agent_settings, run_agent

        settings = agent_settings(ns.model, ns.max_turns, ns.max_tokens, ns.retry_seconds)
        result = asyncio.run(run_agent(str(task), settings=settings, workspace=out))
        why = f" ({result.error})" if result.error else ""
        print(f"agent stopped: {result.stop}{why}; transcript {result.transcript_path}", file=sys.stderr)
        return 0 if result.stop == "end_turn" else 1
    from .plan_runner import run_plan

    result = asyncio.run(run_plan(adaptation_plan("task.yaml", ns.precision_budget), workspace=out))
    _print_summary(task)
    if not result.ok:
        print(f"omskills: error: {result.error}", file=sys.stderr)
        # Exit 2 for an error the user acts on (a driver's check, a record field), as the tool's CLI.
        return 2 if result.failed is not None and result.failed.outcome.users_error else 1
    return 0


def _driver_in_run(intake: Intake, out: Path) -> Intake:
    """The intake with its driver file copied into the run folder (`driver/`), as a bundle carries
    it: a tool called by hand on the run, or `load_adapted` on it, then finds it inside, where a
    driver file must be (it is checked before it is copied, as any input)."""
    from omskills.records.intake import allowed_input_roots, confined_path

    path_part, sep, name = (intake.model.driver or "").partition(":")
    if not path_part.endswith(".py"):
        return intake
    given = confined_path(path_part, "intake.model.driver", out, allowed_input_roots(out))
    copy = out.resolve() / "driver" / given.name
    if given != copy:
        copy.parent.mkdir(exist_ok=True)
        if not copy.is_file() or copy.read_bytes() != given.read_bytes():
            shutil.copyfile(given, copy)
    driver = f"driver/{given.name}{sep}{name}"
    return intake.model_copy(update={"model": intake.model.model_copy(update={"driver": driver})})


def _print_summary(task: Path) -> None:
    from omskills.records.task import load_record
    from omskills.report.stage_status import stage_status
    from omskills.report.wording import counted

    record = load_record(task)
    if record.plan is None:
        return
    verification = record.verification
    # One row per graph: a candidate dispatched on a non-tensor argument has one per value.
    rows = [
        (cand, graph)
        for cand in record.plan.candidates
        for graph in ([c.candidate for c in record.contracts_of(cand.name)] or [cand.name])
    ]
    backends = {
        graph: verification.backend_per_candidate.get(graph, verification.backend_per_candidate.get(cand.name, "-"))
        if verification
        else "-"
        for cand, graph in rows
    }
    width = max([31, *map(len, backends.values())])  # a label may say "(batch in chunks of 1)"
    name_width = max([22, *(len(graph) for _, graph in rows)])
    failed = {
        row.graph: [c.stage for c in row.cells if c.status == "failed"] for row in stage_status(record, verification)
    }
    modes = {graph: p.chosen_mode for graph, chain in record.toolchain.items() if (p := chain.precision)}
    mode_width = max([22, *map(len, modes.values())])
    print(
        f"\n{'candidate':{name_width}s} status       share   {'backend':{width}s} probe    cos        max abs  "
        f"{'ATC precision mode':{mode_width}s} failed stages",
        file=sys.stderr,
    )
    for cand, graph in rows:
        probe = record.toolchain_of(graph).probes.get("original")
        print(
            f"{graph:{name_width}s} {cand.status:12s} {cand.share:6.1%}  {backends[graph]:{width}s} "
            f"{probe.verdict if probe else '-':8s} {f'{probe.worst_cosine:.6f}' if probe else '-':10s} "
            f"{f'{probe.worst_max_abs:.1e}' if probe else '-':8s} {modes.get(graph, '-'):{mode_width}s} "
            f"{', '.join(failed.get(graph, [])) or '-'}",
            file=sys.stderr,
        )
    if verification:
        m, unit = verification.main_path, verification.step_name
        print(
            f"\nmain path: {m.shown_verdict} | weights {verification.weights} | {counted(m.steps, unit)} | "
            f"{m.summary()} "
            f"| fallbacks {m.fallbacks} | torch {m.torch_s_per_step:.2f} s/{unit}, "
            f"spliced {m.spliced_s_per_step:.2f} s/{unit} "
            f"(ratio {m.latency_ratio:.2f}) | report {task.parent / verification.report_html}",
            file=sys.stderr,
        )
    plan, emulated = record.precision_plan, record.verification_emulated
    if plan is not None:
        figures = f" | {emulated.main_path.summary()}" if emulated is not None else ""
        worth = f" | Cube MACs in fp16: {plan.fp16_mac_share:.1%}"
        if plan.predicted is not None and plan.predicted.plan_ms is not None:
            t = plan.predicted
            others = " / ".join(f"{v:.3g} ms" if v is not None else "-" for v in (t.all_fp16_ms, t.all_fp32_ms))
            worth += f" | predicted Cube time on {t.soc}: {t.plan_ms:.3g} ms (all fp16 / all fp32: {others})"
        print(
            "precision plan end to end (Ascend modes emulated on CPU, not an NPU): "
            f"{plan.verdict} in {plan.runs} main-path run(s){figures}{worth} | {plan.why}",
            file=sys.stderr,
        )
