"""Benchmark: every zoo model (examples/zoo/) through the whole adaptation, one process each.

For each model of `examples/zoo/index.yaml` (or those named): `omskills adapt` on its record in
a fresh run folder, with the RSS of its whole process tree sampled every 0.5 s; then, in another
fresh process, the deployed model loaded with `load_adapted` and run on the model's held-out
inputs (another size than the task's, never seen by the adaptation), counting fallbacks. One
row per model: the stage reached, the verdict, graphs deployed / graphs planned, fallbacks,
the worst probe cosine, spliced/eager latency, emulated precision, the held-out run, wall, peak
tree RSS, tracebacks seen, and for a failure its category and one line. The table is printed and
appended, dated, to benchmarks/RESULTS.md (unless --no-results).

    .venv/bin/python benchmarks/zoo.py [NAMES...] [--slice] [--out DIR] [--no-results] [--keep]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import yaml
from _adapt_watch import ConsoleTracker, TreeSampler, tee
from pydantic import BaseModel, ConfigDict, Field

REPO = Path(__file__).resolve().parents[1]
ZOO = REPO / "examples" / "zoo"
RESULTS = REPO / "benchmarks" / "RESULTS.md"
CLI = "import sys; from omskills.orchestrator.cli import main; sys.exit(main())"
TRACEBACK = "Traceback (most recent call last)"
ADAPT_TIMEOUT_S = 3600


class ZooModel(BaseModel):
    """One entry of examples/zoo/index.yaml."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="The task record's id; its file is examples/zoo/<name>.yaml.")
    kind: str = Field(description="What the model does (detection, speech-recognition, ...).")
    package: str = Field(description="The PyPI package (and version) its source comes from.")
    entry: str = Field(description="The entry users call, which the driver runs.")
    weights: str = Field("random", description="'random' (seeded, from config) or what the builder loads itself.")
    held_out: dict[str, Any] = Field(description="Overrides of intake.inputs the deployed model must serve, unseen.")
    slice: bool = Field(False, description="Part of the fast slice the test suite runs.")

    @property
    def record(self) -> Path:
        return ZOO / f"{self.name}.yaml"


def zoo_models(names: list[str] | None = None, only_slice: bool = False) -> list[ZooModel]:
    entries = [ZooModel.model_validate(e) for e in yaml.safe_load((ZOO / "index.yaml").read_text())["models"]]
    unknown = sorted(set(names or []) - {e.name for e in entries})
    if unknown:
        raise SystemExit(f"no zoo model named {', '.join(unknown)}; known: {', '.join(e.name for e in entries)}")
    return [e for e in entries if (not names or e.name in names) and (e.slice or not only_slice)]


class HeldOut(BaseModel):
    ok: bool
    calls: int = 0
    fallbacks: int = 0
    reasons: list[str] = Field(default_factory=list)
    error: str | None = None

    def cell(self) -> str:
        if self.error:
            return f"error: {self.error}"
        return f"{self.fallbacks} fallbacks / {self.calls} calls" + (
            f" ({'; '.join(self.reasons[:2])})" if self.reasons else ""
        )


class ZooRow(BaseModel):
    name: str
    kind: str
    exit_code: int
    stage: str  # the last plan step that finished
    verdict: str | None = None
    deployed: int = 0  # graphs integrated (spliced, no fallback)
    planned: int = 0  # graphs of the plan's first batch
    fallbacks: int | None = None
    worst_probe_cosine: float | None = None
    latency_ratio: float | None = None
    precision: str = "-"  # emulated precision over the deployed graphs
    held_out: HeldOut | None = None
    wall_s: float = 0.0
    peak_tree_gb: float | None = None
    tracebacks: int = 0
    failure: str | None = None  # "<category>: <one line>"

    @property
    def passed(self) -> bool:
        return (
            self.exit_code == 0
            and self.verdict == "pass"
            and self.deployed > 0
            and self.fallbacks == 0
            and self.tracebacks == 0
        )


HELD_OUT = """
import json, sys
from omskills.deploy import load_adapted
with load_adapted(sys.argv[1], backend="onnxruntime") as model:
    model.run_main_path(json.loads(sys.argv[2]))
    stats = model.stats()
print(json.dumps({"ok": True, "calls": sum(s.calls for s in stats), "fallbacks": sum(s.fallbacks for s in stats),
                  "reasons": sorted({r for s in stats for r in s.fallback_reasons})}))
"""


def held_out_run(task: Path, overrides: dict[str, Any]) -> HeldOut:
    """The deployed model, in a fresh process, on inputs the adaptation never saw."""
    done = subprocess.run(
        [sys.executable, "-c", HELD_OUT, str(task), json.dumps(overrides)],
        capture_output=True,
        text=True,
        timeout=ADAPT_TIMEOUT_S,
    )
    if done.returncode != 0:
        return HeldOut(ok=False, error=_last_line(done.stderr))
    return HeldOut.model_validate_json(done.stdout.strip().splitlines()[-1])


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def adapt(model: ZooModel, out: Path, log: Path) -> tuple[int, float, float | None, str]:
    """`omskills adapt` on the model's record, its tree's memory sampled; exit code, wall, peak GB, output."""
    cmd = [sys.executable, "-c", CLI, "adapt", str(model.record), "--out", str(out)]
    tracker = ConsoleTracker()
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        readers = [
            threading.Thread(target=tee, args=(pipe, sink, tracker), daemon=True) for pipe in (proc.stdout, proc.stderr)
        ]
        sampler = TreeSampler(proc.pid, tracker)
        for thread in (*readers, sampler):
            thread.start()
        try:
            code = proc.wait(timeout=ADAPT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        wall = tracker.elapsed()
        sampler.stop()
        for thread in (*readers, sampler):
            thread.join(timeout=10)
    return code, wall, sampler.peak.tree_gb if sampler.peak else None, log.read_text(errors="replace")


def _stage_reached(output: str) -> str:
    done = re.findall(r"^\[(\d+)/(\d+)\] ([^:\n]+): ok", output, flags=re.M)
    return done[-1][2] if done else "none"


def _failure(code: int, output: str, row: ZooRow) -> str | None:
    """The category of what went wrong and its one line (None: nothing did)."""
    if code == 2:
        return "input: " + _error_line(output)
    failed = re.findall(r"^\[\d+/\d+\] [^:\n]+: FAILED in [\d.]+s — (.*)$", output, flags=re.M)
    if failed:
        return "step failed: " + failed[-1][:300]
    if code != 0:
        return "crash: " + _error_line(output)
    if row.tracebacks:
        return "traceback in the output (the run went on)"
    if row.verdict != "pass":
        return "parity: verdict " + str(row.verdict)
    if not row.deployed:
        return "nothing deployed"
    if row.fallbacks:
        return f"fallbacks: {row.fallbacks}"
    return None


def _error_line(output: str) -> str:
    errors = [line for line in output.splitlines() if line.startswith("omskills: error:")]
    return (errors[-1].removeprefix("omskills: error: ") if errors else _last_line(output))[:300]


def _from_record(row: ZooRow, task: Path) -> None:
    from omskills.records.task import load_record

    record = load_record(task)
    graphs = [g for name in (record.plan.first_batch if record.plan else []) for g in record.graphs(name)]
    row.planned = len(graphs)
    report = record.verification
    if report is not None:
        row.verdict, row.fallbacks, row.latency_ratio = (
            report.verdict,
            report.main_path.fallbacks,
            report.main_path.latency_ratio,
        )
        row.deployed = sum(1 for c in report.candidates if c.status == "integrated")
        deployed = [c.name for c in report.candidates if c.status == "integrated"]
    else:
        deployed = []
    probes = [p for g in graphs if (p := record.toolchain_of(g).probes.get("original")) and p.worst_cosine is not None]
    row.worst_probe_cosine = min((p.worst_cosine for p in probes), default=None)
    row.precision = _precision_cell(record, deployed)


def _precision_cell(record: Any, deployed: list[str]) -> str:
    if not deployed:
        return "-"
    failed = [g for g in deployed if (s := record.stages.get(f"precision:{g}")) and s.status == "failed"]
    modes = [record.toolchain_of(g).precision.chosen_mode for g in deployed if record.toolchain_of(g).precision]
    cell = f"{len(modes)}/{len(deployed)} emulated"
    if modes:
        cell += " (" + ", ".join(f"{m} x{modes.count(m)}" for m in dict.fromkeys(modes)) + ")"
    if failed:
        cell += f"; failed: {', '.join(failed)}"
    emulated = record.verification_emulated
    if emulated is not None:
        cell += f"; end to end {emulated.verdict}"
    return cell


def run_model(model: ZooModel, out: Path) -> ZooRow:
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    code, wall, peak, output = adapt(model, out, out.parent / f"{model.name}.log")
    row = ZooRow(
        name=model.name,
        kind=model.kind,
        exit_code=code,
        stage=_stage_reached(output),
        wall_s=round(wall, 1),
        peak_tree_gb=round(peak, 2) if peak else None,
        tracebacks=output.count(TRACEBACK),
    )
    if (out / "task.yaml").exists():
        _from_record(row, out / "task.yaml")
    if row.deployed:
        row.held_out = held_out_run(out / "task.yaml", model.held_out)
    row.failure = _failure(code, output, row)
    return row


def markdown(rows: list[ZooRow], title: str) -> str:
    head = (
        "| model | kind | stage reached | verdict | deployed / planned | fallbacks | worst probe cos | spliced/eager "
        "| emulated precision | held-out (load_adapted) | wall s | peak tree GB | tracebacks | failure |"
    )
    lines = [f"### {title}", "", head, "|" + "---|" * 14]
    for r in rows:
        cos = f"{r.worst_probe_cosine:.6f}" if r.worst_probe_cosine is not None else "-"
        ratio = f"{r.latency_ratio:.2f}" if r.latency_ratio is not None else "-"
        lines.append(
            f"| {r.name} | {r.kind} | {r.stage} | {r.verdict or '-'} | {r.deployed} / {r.planned} "
            f"| {r.fallbacks if r.fallbacks is not None else '-'} | {cos} | {ratio} | {r.precision} "
            f"| {r.held_out.cell() if r.held_out else '-'} | {r.wall_s:.0f} | {r.peak_tree_gb or '-'} "
            f"| {r.tracebacks} | {(r.failure or '-').replace('|', '/')} |"
        )
    passed = sum(r.passed for r in rows)
    served = sum(1 for r in rows if r.held_out and r.held_out.ok and r.held_out.fallbacks == 0)
    lines += [
        "",
        f"{passed} of {len(rows)} pass (verdict pass, a graph deployed, 0 fallbacks, no traceback); "
        f"{served} serve their held-out inputs with 0 fallbacks; tracebacks {sum(r.tracebacks for r in rows)}.",
    ]
    return "\n".join(lines) + "\n"


def append_results(table: str) -> None:
    text = RESULTS.read_text()
    head, _, rest = text.partition("\n## ")
    section = f"## {dt.date.today().isoformat()} — the zoo (`benchmarks/zoo.py`)\n\n{table}\n"
    RESULTS.write_text(f"{head}\n{section}\n## {rest}" if rest else f"{text}\n{section}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="zoo models to run (default: all)")
    parser.add_argument("--slice", action="store_true", help="only the fast slice the test suite runs")
    parser.add_argument("--out", default=str(REPO / "runs" / "zoo"), help="parent of the run folders")
    parser.add_argument("--no-results", action="store_true", help="print the table only")
    parser.add_argument("--keep", action="store_true", help="keep each run's ONNX files and samples")
    ns = parser.parse_args()
    rows = []
    for model in zoo_models(ns.names, ns.slice):
        print(f"== {model.name} ({model.kind})", flush=True)
        row = run_model(model, Path(ns.out) / model.name)
        print(f"   {'pass' if row.passed else 'FAIL'}: {row.model_dump_json(exclude_none=True)}", flush=True)
        rows.append(row)
        if not ns.keep:
            for heavy in ("onnx", "samples", "om"):
                shutil.rmtree(Path(ns.out) / model.name / heavy, ignore_errors=True)
    table = markdown(rows, f"{len(rows)} zoo models, tiny inputs, one `omskills adapt` each (machine: {_load()})")
    print("\n" + table)
    (Path(ns.out) / "zoo.json").write_text(json.dumps([r.model_dump() for r in rows], indent=1))
    if not ns.no_results:
        append_results(table)
    return 0 if all(r.passed for r in rows) else 1


def _load() -> str:
    import os

    return f"load {os.getloadavg()[0]:.1f} at start of table"


if __name__ == "__main__":
    sys.exit(main())
