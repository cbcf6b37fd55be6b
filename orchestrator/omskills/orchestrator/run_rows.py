"""One table row per adaptation run: what `omskills adapt` reached and what its record says.

Read from the run's console output (the plan runner's `[i/n] step: ok` lines, `omskills: error:`)
and from its task record. `omskills fleet` and `benchmarks/zoo.py` print these rows.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, Field

TRACEBACK = "Traceback (most recent call last)"


class AdaptationRow(BaseModel):
    name: str = Field(description="The run's name (its folder).")
    exit_code: int = Field(description="`omskills adapt`'s exit code (2: bad input).")
    stage: str = Field(description="The last plan step that finished.")
    verdict: str | None = Field(None, description="verify's verdict, when it ran.")
    deployed: int = Field(0, description="Graphs integrated (spliced, no fallback).")
    planned: int = Field(0, description="Graphs of the plan's first batch.")
    fallbacks: int | None = Field(None, description="Calls that fell back to PyTorch on the verified main path.")
    worst_probe_cosine: float | None = Field(None, description="The lowest probe cosine over the planned graphs.")
    latency_ratio: float | None = Field(None, description="Spliced over eager time per step.")
    precision: str = Field("-", description="Emulated ATC precision over the deployed graphs.")
    fp16_macs: float | None = Field(None, description="Share of the plan's Cube MACs in fp16 (emulated plan).")
    precision_runs: int | None = Field(None, description="Main-path runs of the precision step.")
    precision_s: float | None = Field(
        None, description="Seconds of the precision steps: per-graph emulation and the end-to-end check."
    )
    wall_s: float = Field(0.0, description="Wall time of the adaptation, seconds.")
    peak_tree_gb: float | None = Field(None, description="Peak RSS of the adaptation's whole process tree, GB.")
    tracebacks: int = Field(0, description="Python tracebacks in the output (a run that went on after one counts).")
    failure: str | None = Field(None, description="'<category>: <one line>' when the run did not pass.")

    @property
    def passed(self) -> bool:
        return (
            self.exit_code == 0
            and self.verdict == "pass"
            and self.deployed > 0
            and self.fallbacks == 0
            and self.tracebacks == 0
        )


def row_of_run(
    name: str, run: Path, exit_code: int, output: str, wall_s: float, peak_gb: float | None
) -> AdaptationRow:
    row = AdaptationRow(
        name=name,
        exit_code=exit_code,
        stage=stage_reached(output),
        wall_s=round(wall_s, 1),
        peak_tree_gb=round(peak_gb, 2) if peak_gb else None,
        tracebacks=output.count(TRACEBACK),
    )
    if (run / "task.yaml").exists():
        _from_record(row, run / "task.yaml")
    row.failure = failure_of(exit_code, output, row)
    return row


def stage_reached(output: str) -> str:
    done = re.findall(r"^\[(\d+)/(\d+)\] ([^:\n]+): ok", output, flags=re.M)
    return done[-1][2] if done else "none"


def failure_of(code: int, output: str, row: AdaptationRow) -> str | None:
    """The category of what went wrong and its one line (None: nothing did)."""
    if code == 2:
        return "input: " + error_line(output)
    failed = re.findall(r"^\[\d+/\d+\] [^:\n]+: FAILED in [\d.]+s — (.*)$", output, flags=re.M)
    if failed:
        return "step failed: " + failed[-1][:300]
    if code != 0:
        return "crash: " + error_line(output)
    if row.tracebacks:
        return "traceback in the output (the run went on)"
    if row.verdict != "pass":
        return "parity: verdict " + str(row.verdict)
    if not row.deployed:
        return "nothing deployed"
    if row.fallbacks:
        return f"fallbacks: {row.fallbacks}"
    return None


def error_line(output: str) -> str:
    errors = [line for line in output.splitlines() if line.startswith("omskills: error:")]
    return (errors[-1].removeprefix("omskills: error: ") if errors else last_line(output))[:300]


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def _from_record(row: AdaptationRow, task: Path) -> None:
    from omskills.records.task import load_record

    record = load_record(task)
    graphs = [g for name in (record.plan.first_batch if record.plan else []) for g in record.graphs(name)]
    row.planned = len(graphs)
    report = record.verification
    deployed = [c.name for c in report.candidates if c.status == "integrated"] if report else []
    if report is not None:
        row.verdict, row.fallbacks = report.verdict, report.main_path.fallbacks
        row.latency_ratio, row.deployed = report.main_path.latency_ratio, len(deployed)
    probes = [p for g in graphs if (p := record.toolchain_of(g).probes.get("original")) and p.worst_cosine is not None]
    row.worst_probe_cosine = min((p.worst_cosine for p in probes), default=None)
    row.precision = _precision_cell(record, deployed)
    plan = record.precision_plan
    if plan is not None:
        row.fp16_macs, row.precision_runs = plan.fp16_mac_share, plan.runs
        steps = [s for key, s in record.stages.items() if key == "precision_plan" or key.startswith("precision:")]
        row.precision_s = round(sum(s.seconds or 0.0 for s in steps), 1)


def _precision_cell(record, deployed: list[str]) -> str:
    if not deployed:
        return "-"
    failed = [g for g in deployed if (s := record.stages.get(f"precision:{g}")) and s.status == "failed"]
    modes = [record.toolchain_of(g).precision.chosen_mode for g in deployed if record.toolchain_of(g).precision]
    cell = f"{len(modes)}/{len(deployed)} emulated"
    if modes:
        cell += " (" + ", ".join(f"{m} x{modes.count(m)}" for m in dict.fromkeys(modes)) + ")"
    if failed:
        cell += f"; failed: {', '.join(failed)}"
    plan = record.precision_plan
    if plan is not None:
        cell += f"; end to end {plan.verdict}"
        if plan.verdict == "fail":
            cell += f" ({plan.attempts[-1].summary if plan.attempts else plan.why})"
    return cell


def cells(row: AdaptationRow) -> list[str]:
    """The row's cells from 'stage reached' to 'failure', as the tables print them."""
    cos = f"{row.worst_probe_cosine:.6f}" if row.worst_probe_cosine is not None else "-"
    ratio = f"{row.latency_ratio:.2f}" if row.latency_ratio is not None else "-"
    return [
        row.stage,
        row.verdict or "-",
        f"{row.deployed} / {row.planned}",
        str(row.fallbacks) if row.fallbacks is not None else "-",
        cos,
        ratio,
        row.precision,
        f"{row.fp16_macs:.1%}" if row.fp16_macs is not None else "-",
        f"{row.precision_runs} / {row.precision_s:.0f}" if row.precision_runs is not None else "-",
        f"{row.wall_s:.0f}",
        str(row.peak_tree_gb or "-"),
        str(row.tracebacks),
        (row.failure or "-").replace("|", "/"),
    ]


HEADERS = [
    "stage reached",
    "verdict",
    "deployed / planned",
    "fallbacks",
    "worst probe cos",
    "spliced/eager",
    "emulated precision",
    "fp16 Cube MACs",
    "precision runs / s",
    "wall s",
    "peak tree GB",
    "tracebacks",
    "failure",
]
