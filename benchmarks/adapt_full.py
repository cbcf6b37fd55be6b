"""Benchmark: the whole adaptation, as a user runs it, beside its floor.

Runs `omskills adapt` and measures, in the same run:
- memory: every 0.5 s the RSS of the whole process tree (the CLI, the MCP server and every child
  they start), its peak, the largest process and the plan step at that moment; the samples go to
  RUN/benchmark/memory.csv and memory.png. The tree figure is a sum of RSS: pages shared between
  processes are counted in each, so it is an upper bound;
- time: each plan step's seconds from the task record (its steps grouped by kind: `export:x` ->
  export) and between its lines on the console (which also holds the model load and the tool
  call's overhead);
- the floor: what an adaptation cannot do without, from this run's verify report: one eager
  main-path pass E (session setup and every step) and one spliced pass S. Study = E (one
  instrumented pass), export = itself, probe = one ONNX Runtime run per candidate on its samples
  ~ E x the probed candidates' share of main-path time, optimize and precision emulation =
  optional, the precision plan = S (a plan the user ships is confirmed by one spliced pass, its
  graphs emulated), precheck and ATC = itself, verify = E + S.
It prints each step beside its floor (rows above 1.5x marked), the verify summary, and a Markdown
table for benchmarks/RESULTS.md; the figures go to RUN/benchmark/summary.json. Exits with adapt's code.

    .venv/bin/python benchmarks/adapt_full.py [--task T] [--scale full] [--frames N] [--out DIR] [--resume]
"""

from __future__ import annotations

import argparse
import datetime as dt
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from _adapt_watch import (
    AFTER_PLAN,
    BEFORE_PLAN,
    ConsoleStage,
    ConsoleTracker,
    MemoryPeak,
    TreeSampler,
    plot_memory,
    tee,
    write_memory_csv,
)
from pydantic import BaseModel

if TYPE_CHECKING:
    from omskills.records.task import TaskRecord
    from omskills.records.verify import VerifyReport

REPO = Path(__file__).resolve().parents[1]
ABOVE = 1.5  # a step slower than this many times its floor is marked
RSS_NOTE = (
    "tree RSS = the sum of every process's RSS; pages shared between processes are counted in each, "
    "so it is an upper bound"
)

FloorRule = Literal["pass", "itself", "optional", "none"]

# The console names the plan's tools (omskills.orchestrator.job_commands, adaptation_plan), the record
# names the steps they write (`export:x`, ...); this joins the two and says what each one's floor is.
# A record step kind no tool here claims still gets a row of its own.
TOOL_STEPS: dict[str, tuple[tuple[str, ...], FloorRule]] = {
    "check_environment": (("environment",), "none"),
    "inventory_entries": (("inventory",), "none"),
    "profile_main_path": (("study",), "pass"),
    "plan_candidates": (("plan",), "none"),
    "capture_contracts": ((), "none"),
    "analyze_boundaries": (("boundaries",), "none"),
    "export_onnx": (("export",), "itself"),
    "probe_onnx": (("probe",), "pass"),
    "optimize_onnx": (("optimize",), "optional"),
    "emulate_precision": (("precision",), "optional"),
    "check_precision_plan": (("precision_plan",), "pass"),
    "precheck_ops": ((), "itself"),
    "convert_atc": (("atc",), "itself"),
    "verify_main_path": (("verify",), "pass"),
    "write_delivery_doc": ((), "none"),
}


class StageRow(BaseModel):
    stage: str
    tool: str | None = None
    record_kinds: list[str] = []
    record_steps: int = 0
    record_seconds: float | None = None  # the record's step seconds, summed
    console_seconds: float | None = None  # between the step's start and end lines on the console
    floor_rule: FloorRule = "none"
    floor_seconds: float | None = None  # None: not part of the floor, or unknown (see note)
    ratio: float | None = None
    above_floor: bool = False  # more than ABOVE x its floor
    note: str = ""

    @property
    def seconds(self) -> float | None:
        return self.record_seconds if self.record_seconds is not None else self.console_seconds


class Floor(BaseModel):
    """The passes this run measured that bound the adaptation from below."""

    steps: int
    step_name: str
    eager_seconds: float  # E: one eager main-path pass, PyTorch, in verify
    whole_pass: bool = True  # E and S include the session setup (False: a report without it, steps only)
    spliced_seconds: float  # S: the spliced pass, in verify
    study_load_seconds: float | None  # the study's model build, outside its record step
    study_setup_seconds: float | None  # the study's session setup before the first step, instrumented
    probed_share: float | None  # share of main-path time of the first-batch candidates probed
    probed_candidates: list[str]
    probe_ort_seconds: float | None  # verify's ONNX Runtime seconds per call x the probed samples


class AdaptBenchmark(BaseModel):
    date: str
    command: list[str]
    out: str
    exit_code: int
    wall_seconds: float
    floor: Floor | None
    floor_seconds: float | None  # sum of the rows' floors
    stages: list[StageRow]
    peak: MemoryPeak | None
    rss_note: str = RSS_NOTE
    memory_csv: str
    memory_png: str | None
    resumed: bool = False  # a rerun: stages the record already held as done were neither timed nor sampled


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default=str(REPO / "task_records" / "sam3-video-text.yaml"))
    parser.add_argument("--scale", default="full", choices=["tiny", "full"])
    parser.add_argument("--frames", type=int)
    parser.add_argument("--precision-budget", type=int, help="passed to omskills adapt")
    parser.add_argument("--out", default=str(REPO / "runs" / "benchmark-adapt"))
    parser.add_argument(
        "--resume",
        action="store_true",
        help="measure a rerun of --out: only the stages it still has to do are timed and sampled",
    )
    ns = parser.parse_args()
    out = Path(ns.out)
    if (out / "task.yaml").exists() and not ns.resume:
        sys.exit(
            f"{out} holds an earlier run; a rerun would resume instead of measuring. Pick another --out "
            "(or --resume to measure what the rerun still does)."
        )
    cmd = (
        [
            sys.executable,
            "-c",
            "import sys; from omskills.orchestrator.cli import main; sys.exit(main())",
            "adapt",
            ns.task,
            "--scale",
            ns.scale,
            "--out",
            str(out),
        ]
        + (["--frames", str(ns.frames)] if ns.frames else [])
        + (["--precision-budget", str(ns.precision_budget)] if ns.precision_budget else [])
    )
    tracker, sampler, exit_code, wall = _run_watched(cmd)
    bench = out / ("benchmark-resumed" if ns.resume else "benchmark")
    bench.mkdir(parents=True, exist_ok=True)
    write_memory_csv(sampler.samples, bench / "memory.csv")
    png = bench / "memory.png" if sampler.samples else None
    if png is not None:
        plot_memory(sampler.samples, tracker.stages, png, f"omskills adapt, {ns.scale}, tree RSS (upper bound)")

    print(f"\nadapt exit code      {exit_code}")
    print(f"adaptation wall time {wall / 60:.1f} min ({wall:.0f} s)")
    record, report = _record(out), _verify_report(out)
    _print_verify(report)
    floor = _floor(out, record, report)
    rows = _rows(record, tracker.stages, wall, floor)
    floor_sum = (
        round(sum(r.floor_seconds or 0.0 for r in rows if r.floor_rule in ("pass", "itself")), 1)
        if floor is not None
        else None
    )
    # The command as a person reads it: the interpreter, then the CLI's arguments (the -c code left out).
    result = AdaptBenchmark(
        date=dt.date.today().isoformat(),
        command=cmd[:1] + cmd[3:],
        out=str(out),
        exit_code=exit_code,
        wall_seconds=round(wall, 1),
        floor=floor,
        floor_seconds=floor_sum,
        stages=rows,
        peak=sampler.peak,
        memory_csv=str(bench / "memory.csv"),
        memory_png=str(png) if png else None,
        resumed=ns.resume,
    )
    _print_table(result)
    (bench / "summary.json").write_text(result.model_dump_json(indent=2) + "\n")
    print(f"\nsamples {bench / 'memory.csv'}, picture {png or '-'}, figures {bench / 'summary.json'}")
    print("\n" + _markdown(result, ns.scale, ns.frames))
    return exit_code


def _run_watched(cmd: list[str]) -> tuple[ConsoleTracker, TreeSampler, int, float]:
    """Run `cmd`, echoing its output while reading its stage lines and sampling its tree's memory;
    its exit code and wall seconds."""
    tracker = ConsoleTracker()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    readers = [
        threading.Thread(target=tee, args=(pipe, stream, tracker), daemon=True)
        for pipe, stream in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))
    ]
    sampler = TreeSampler(proc.pid, tracker)
    for thread in (*readers, sampler):
        thread.start()
    try:
        code = proc.wait()
    except KeyboardInterrupt:  # the child got the same SIGINT: let it stop and record what it did
        code = proc.wait()
    wall = tracker.elapsed()
    sampler.stop()
    for thread in (*readers, sampler):
        thread.join(timeout=10)
    return tracker, sampler, code, wall


def _print_verify(report: VerifyReport | None) -> None:
    if report is None:
        print("verify report        none (the adaptation stopped before verify)")
        return
    m, unit = report.main_path, report.step_name
    print(
        f"weights              {report.weights} | scale {report.scale} | {m.steps} {unit}s | verdict {report.verdict}"
    )
    for check in m.checks:
        print(
            f"check                {check.title}: worst {check.worst} | passed {check.passed}"
            f"{'' if check.gating else ' (reported)'}"
        )
    print(f"fallbacks            {m.fallbacks}")
    print(
        f"latency per {unit:8s} torch {m.torch_s_per_step:.2f} s | spliced {m.spliced_s_per_step:.2f} s | "
        f"ratio spliced/eager {m.latency_ratio:.2f}"
    )
    for c in report.candidates:
        print(
            f"  {c.name:38s} {c.status:10s} {c.backend:32s} probe {c.probe.get('verdict')} "
            f"cos {c.probe.get('cosine')} max abs {c.probe.get('max_abs')} | {c.calls} calls"
        )
    for name, why in report.not_spliced.items():
        print(f"  {name:38s} pytorch: {why[:150]}")


def _verify_report(out: Path) -> VerifyReport | None:
    from omskills.records.verify import VerifyReport

    path = out / "verify" / "report.json"
    return VerifyReport.model_validate_json(path.read_text()) if path.exists() else None


def _record(out: Path) -> TaskRecord | None:
    from omskills.records.task import load_record

    return load_record(out / "task.yaml") if (out / "task.yaml").exists() else None


def _floor(out: Path, record: TaskRecord | None, report: VerifyReport | None) -> Floor | None:
    """E and S from verify, the study's load and setup, and the share of the main path the probes cover."""
    from omskills.records.main_path import MainPathReport

    if report is None or record is None:
        return None
    m = report.main_path
    study_path = out / "study" / "main_path.json"
    study = MainPathReport.model_validate_json(study_path.read_text()) if study_path.exists() else None
    # Graphs probed as exported ("probe:<graph>:original"); a variant's probe is the optimizer's business.
    probed = sorted(
        {step.split(":")[1] for step in record.stages if step.startswith("probe:") and step.endswith(":original")}
    )
    owners = {g: record.plan_candidate_of(g) for g in probed}
    first_batch = set(record.plan.first_batch) if record.plan else set()
    candidates = sorted({c.name for c in owners.values() if c is not None and c.name in first_batch})
    share = sum(c.share for c in record.plan.candidates if c.name in candidates) if record.plan and candidates else None
    per_call = {c.name: c.backend_ms_per_call for c in report.candidates}
    known = all(per_call.get(g) is not None and g in record.contracts for g in probed)
    ort = sum(per_call[g] / 1000 * len(record.contracts[g].samples) for g in probed) if probed and known else None
    # The whole pass (session setup included) where the report has it; older reports: the steps only.
    return Floor(
        steps=m.steps,
        step_name=report.step_name,
        whole_pass=m.torch_pass_s is not None,
        eager_seconds=m.torch_pass_s if m.torch_pass_s is not None else m.torch_s_per_step * m.steps,
        spliced_seconds=m.spliced_pass_s if m.spliced_pass_s is not None else m.spliced_s_per_step * m.steps,
        study_load_seconds=study.load_seconds if study else None,
        study_setup_seconds=study.setup_seconds if study else None,
        probed_share=share,
        probed_candidates=candidates,
        probe_ort_seconds=round(ort, 3) if ort is not None else None,
    )


def _rows(record: TaskRecord | None, stages: list[ConsoleStage], wall: float, floor: Floor | None) -> list[StageRow]:
    steps = record.stages if record is not None else {}
    by_kind: dict[str, list[float]] = {}
    for name, result in steps.items():
        by_kind.setdefault(name.split(":")[0], []).append(result.seconds or 0.0)
    first = stages[0].started if stages else wall
    rows = [
        StageRow(
            stage=BEFORE_PLAN,
            console_seconds=round(first, 1),
            note="process start, imports, reading the task record, the MCP server's start",
        )
    ]
    claimed: set[str] = set()
    for i, stage in enumerate(stages):
        kinds, rule = TOOL_STEPS.get(stage.tool, ((), "none"))
        end = stage.ended if stage.ended is not None else (stages[i + 1].started if i + 1 < len(stages) else wall)
        claimed.update(kinds)
        rows.append(_row(stage.label, stage.tool, kinds, by_kind, end - stage.started, rule, floor))
    if stages and stages[-1].ended is not None:
        rows.append(StageRow(stage=AFTER_PLAN, console_seconds=round(wall - stages[-1].ended, 1)))
    for kind in [
        k for k in by_kind if k not in claimed
    ]:  # steps the console did not show (a changed plan, a failed parse)
        rule = next((r for ks, r in TOOL_STEPS.values() if kind in ks), "none")
        rows.append(_row(f"record step {kind}", None, [kind], by_kind, None, rule, floor))
    return rows


def _row(
    label: str,
    tool: str | None,
    kinds: list[str],
    by_kind: dict[str, list[float]],
    console: float | None,
    rule: FloorRule,
    floor: Floor | None,
) -> StageRow:
    """`kinds`: the record step kinds the tool writes (they choose the floor); the record may hold none of them."""
    seconds = [s for k in kinds for s in by_kind.get(k, [])]
    row = StageRow(
        stage=label,
        tool=tool,
        record_kinds=[k for k in kinds if k in by_kind],
        record_steps=len(seconds),
        record_seconds=round(sum(seconds), 1) if seconds else None,
        console_seconds=round(console, 1) if console is not None else None,
        floor_rule=rule,
    )
    if rule == "itself":
        row.floor_seconds = row.seconds
        row.note = "no pass of the model bounds it: its own seconds are its floor"
    elif rule == "optional":
        row.floor_seconds = 0.0
        row.note = "optional: nothing later requires it"
    elif rule == "pass":
        _pass_floor(row, kinds, floor)
    if row.floor_seconds is not None:
        row.floor_seconds = round(row.floor_seconds, 1)
    if row.floor_seconds and row.seconds is not None and rule == "pass":
        row.ratio = round(row.seconds / row.floor_seconds, 2)
        row.above_floor = row.ratio > ABOVE
    return row


def _pass_floor(row: StageRow, kinds: list[str], floor: Floor | None) -> None:
    if floor is None:
        row.note = "floor unknown: no verify report (E and S come from it)"
        return
    e, s, unit = floor.eager_seconds, floor.spliced_seconds, floor.step_name
    if "study" in kinds:
        row.floor_seconds = e
        outside = []
        if floor.study_load_seconds is not None:
            outside.append(f"model load {floor.study_load_seconds:.1f} s")
        if floor.study_setup_seconds is not None and not floor.whole_pass:
            outside.append(f"session setup {floor.study_setup_seconds:.1f} s (instrumented)")
        what = f"setup + {floor.steps} {unit}s" if floor.whole_pass else f"{floor.steps} {unit}s"
        row.note = f"E = one eager pass ({what})" + (f"; outside E: {', '.join(outside)}" if outside else "")
    elif "precision_plan" in kinds:
        row.floor_seconds = s
        row.note = f"S {s:.1f} s: one spliced pass confirms the plan (its graphs emulated)"
    elif "verify" in kinds:
        row.floor_seconds = e + s
        setups = "" if floor.whole_pass else " and the two session setups"
        row.note = f"E {e:.1f} + S {s:.1f} s; model load{setups} outside"
    elif "probe" in kinds:
        ort = (
            f"; verify's ORT s/call x samples: {floor.probe_ort_seconds:.1f} s"
            if floor.probe_ort_seconds is not None
            else ""
        )
        if floor.probed_share is None:
            row.note = "floor unknown: no plan shares for the probed candidates" + ort
            return
        row.floor_seconds = e * floor.probed_share
        row.note = f"E x {floor.probed_share:.1%} (share of {len(floor.probed_candidates)} probed candidates){ort}"


def _ratio_text(row: StageRow) -> str:
    if row.floor_rule == "itself":
        return "itself"
    if row.floor_rule == "optional":
        return "optional"
    if row.ratio is None:
        return "-"
    return f"{row.ratio:.2f}" + (" !" if row.above_floor else "")


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _print_table(result: AdaptBenchmark) -> None:
    width = max(len(r.stage) for r in result.stages)
    print(f"\n{'stage':{width}s} {'record s':>9s} {'console s':>9s} {'floor s':>8s} {'ratio':>8s}  note")
    for r in result.stages:
        floor = "-" if r.floor_rule == "none" or r.floor_seconds is None else _num(r.floor_seconds)
        print(
            f"{r.stage:{width}s} {_num(r.record_seconds):>9s} {_num(r.console_seconds):>9s} {floor:>8s} "
            f"{_ratio_text(r):>8s}  {r.note}"
        )
    total_ratio = f"{result.wall_seconds / result.floor_seconds:.2f}" if result.floor_seconds else "-"
    print(
        f"{'total':{width}s} {'':>9s} {result.wall_seconds:9.1f} {_num(result.floor_seconds):>8s} {total_ratio:>8s}  "
        "wall from launch to exit; floor = the sum of the rows' floors"
    )
    if result.floor is not None:
        f = result.floor
        print(
            f"E (eager pass)       {f.eager_seconds:.1f} s = {f.steps} {f.step_name}s | "
            f"S (spliced pass) {f.spliced_seconds:.1f} s"
        )
    print(f"marked ' !'          above {ABOVE}x the floor")
    if result.resumed:
        print(
            "resumed run          stages the record already held as done were skipped, neither timed nor sampled here"
        )
    if result.peak is not None:
        p = result.peak
        print(
            f"peak RSS (tree)      {p.tree_gb:.2f} GB at {p.seconds:.0f} s, {p.processes} processes, during {p.stage}"
        )
        print(f"largest process      {p.largest_gb:.2f} GB then: {p.largest_command}")
    print(f"                     ({RSS_NOTE})")


def _markdown(result: AdaptBenchmark, scale: str, frames: int | None) -> str:
    lines = [
        f"### {result.date} — `benchmarks/adapt_full.py`: the adaptation beside its floor ({scale} scale"
        f"{f', {frames} frames' if frames else ''})",
        "",
        "| stage | record s | console s | floor s | ratio | note |",
        "|---|---|---|---|---|---|",
    ]
    for r in result.stages:
        floor = "-" if r.floor_rule == "none" or r.floor_seconds is None else _num(r.floor_seconds)
        ratio = _ratio_text(r).replace(" !", " **!**")
        lines.append(
            f"| {r.stage} | {_num(r.record_seconds)} | {_num(r.console_seconds)} | {floor} | {ratio} | {r.note} |"
        )
    total_ratio = f"{result.wall_seconds / result.floor_seconds:.2f}" if result.floor_seconds else "-"
    lines.append(
        f"| **total** | | {result.wall_seconds:.1f} | {_num(result.floor_seconds)} | {total_ratio} | "
        "wall, launch to exit |"
    )
    if result.resumed:
        lines += [
            "",
            "- Resumed run: stages the record already held as done were skipped, neither timed nor sampled here.",
        ]
    if result.floor is not None:
        f = result.floor
        lines += [
            "",
            f"- E (eager main-path pass, verify) {f.eager_seconds:.1f} s for {f.steps} {f.step_name}s; "
            f"S (spliced pass) {f.spliced_seconds:.1f} s; adapt exit code {result.exit_code}.",
        ]
    if result.peak is not None:
        p = result.peak
        lines.append(
            f"- Peak RSS of the process tree {p.tree_gb:.2f} GB at {p.seconds:.0f} s during {p.stage}; "
            f"largest process then {p.largest_gb:.2f} GB (`{p.largest_command}`). {RSS_NOTE[0].upper() + RSS_NOTE[1:]}."
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
