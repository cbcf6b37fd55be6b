"""Benchmark: every zoo model (examples/zoo/) through the whole adaptation, through `omskills fleet`.

The models of `examples/zoo/index.yaml` (or those named) run as Ray tasks of a local Ray instance
(`omskills.orchestrator.fleet`), each `omskills adapt` in a fresh run folder with its process
tree's memory sampled; `--one-at-a-time` gives the instance one CPU, so the same tasks run one
after another (the baseline for the fleet's wall). Then, in another fresh process, each deployed
model is loaded with `load_adapted` and run on the model's held-out inputs (another size than
the task's, never seen by the adaptation), counting fallbacks. One row per model: the stage
reached, the verdict, graphs deployed / graphs planned, fallbacks, the worst probe cosine,
spliced/eager latency, emulated precision, the held-out run, wall, peak tree RSS, tracebacks
seen, and for a failure its category and one line. The table is printed and appended, dated,
to benchmarks/RESULTS.md (unless --no-results).

    .venv/bin/python benchmarks/zoo.py [NAMES...] [--slice] [--one-at-a-time] [--out DIR] [--no-results] [--keep]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from omskills.orchestrator.fleet import plan_adaptations, run_adaptation, run_fleet
from omskills.orchestrator.run_rows import AdaptationRow, cells, last_line
from pydantic import BaseModel, ConfigDict, Field

REPO = Path(__file__).resolve().parents[1]
ZOO = REPO / "examples" / "zoo"
RESULTS = REPO / "benchmarks" / "RESULTS.md"
ADAPT_TIMEOUT_S = 3600
# What each zoo adaptation asks Ray for (its records say scale "full": the models' own sizes, on
# small inputs). Every zoo model's process tree peaked under 2.6 GB in the 26-model table of
# RESULTS.md; a rerun into the same folders asks for its own measured peak instead.
ZOO_MEMORY_GB = 3.0


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


class ZooRow(AdaptationRow):
    kind: str
    held_out: HeldOut | None = None


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
        return HeldOut(ok=False, error=last_line(done.stderr))
    return HeldOut.model_validate_json(done.stdout.strip().splitlines()[-1])


def run_model(model: ZooModel, out: Path) -> ZooRow:
    """One model without Ray (the test suite's zoo slice): a fresh adaptation, then its held-out run."""
    shutil.rmtree(out, ignore_errors=True)
    [adaptation] = plan_adaptations([model.record], out.parent, None, [])
    attempt = run_adaptation(adaptation.model_copy(update={"run": out.resolve()}), 1)
    row = ZooRow(**attempt.row.model_dump(), kind=model.kind)
    if row.deployed:
        row.held_out = held_out_run(out / "task.yaml", model.held_out)
    return row


def markdown(rows: list[ZooRow], title: str) -> str:
    head = (
        "| model | kind | stage reached | verdict | deployed / planned | fallbacks | worst probe cos | spliced/eager "
        "| emulated precision | fp16 Cube MACs | precision runs / s | held-out (load_adapted) | wall s | peak tree GB "
        "| tracebacks | failure |"
    )
    lines = [f"### {title}", "", head, "|" + "---|" * 16]
    for r in rows:
        shown = cells(r)
        held = r.held_out.cell() if r.held_out else "-"
        lines.append("| " + " | ".join([r.name, r.kind, *shown[:9], held, *shown[9:]]) + " |")
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
    parser.add_argument("--one-at-a-time", action="store_true", help="a one-CPU Ray instance: one model at a time")
    parser.add_argument("--out", default=str(REPO / "runs" / "zoo"), help="parent of the run folders")
    parser.add_argument("--no-results", action="store_true", help="print the table only")
    parser.add_argument("--keep", action="store_true", help="keep each run's ONNX files and samples")
    ns = parser.parse_args()
    out = Path(ns.out)
    models = zoo_models(ns.names, ns.slice)
    for model in models:  # fresh runs: a benchmark measures whole adaptations, not resumes
        shutil.rmtree(out / model.name, ignore_errors=True)
    adaptations = plan_adaptations([m.record for m in models], out, None, [], ZOO_MEMORY_GB)
    load = _load()
    report = run_fleet(adaptations, local_cpus=1 if ns.one_at_a_time else None)
    rows = []
    for model, result in zip(models, report.results):
        last = result.attempts[-1].row
        row = ZooRow(**last.model_dump(), kind=model.kind)
        if row.deployed:
            row.held_out = held_out_run(out / model.name / "task.yaml", model.held_out)
        print(f"   {'pass' if row.passed else 'FAIL'}: {row.model_dump_json(exclude_none=True)}", flush=True)
        rows.append(row)
        if not ns.keep:
            for heavy in ("onnx", "samples", "om"):
                shutil.rmtree(out / model.name / heavy, ignore_errors=True)
    how = "one at a time" if ns.one_at_a_time else f"{report.nodes} node(s), as many at once as CPUs and memory allow"
    table = markdown(
        rows,
        f"{len(rows)} zoo models, tiny inputs, through `omskills fleet` ({how}): wall {report.wall_s:.0f} s "
        f"(machine: {load})",
    )
    print("\n" + table)
    (out / "zoo.json").write_text(json.dumps([r.model_dump() for r in rows], indent=1))
    if not ns.no_results:
        append_results(table)
    return 0 if all(r.passed for r in rows) else 1


def _load() -> str:
    import os

    return f"load {os.getloadavg()[0]:.1f} at start of table"


if __name__ == "__main__":
    sys.exit(main())
