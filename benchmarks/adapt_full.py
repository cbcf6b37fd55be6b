"""Benchmark: the whole adaptation at full scale, as a user runs it.

Measures the wall time and peak RSS of `omskills adapt` (the CLI and its MCP server
process, through getrusage of waited-for children), and reads from the same run the
spliced/eager per-step latency ratio (verify_main_path runs PyTorch and the spliced
pipeline one after the other in one process on the same inputs), the output checks, each
candidate's backend and probe figures, and each stage's time. Prints the figures.

    .venv/bin/python benchmarks/adapt_full.py [--task T] [--scale full] [--frames N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default=str(REPO / "task_records" / "sam3-video-text.yaml"))
    parser.add_argument("--scale", default="full", choices=["tiny", "full"])
    parser.add_argument("--frames", type=int)
    parser.add_argument("--out", default=str(REPO / "runs" / "benchmark-adapt"))
    ns = parser.parse_args()
    out = Path(ns.out)
    if (out / "task.yaml").exists():
        sys.exit(f"{out} holds an earlier run; a rerun would resume instead of measuring. Pick another --out.")
    cmd = [sys.executable, "-c", "import sys; from omskills.orchestrator.cli import main; sys.exit(main())",
           "adapt", ns.task, "--scale", ns.scale, "--out", str(out)] + (["--frames", str(ns.frames)] if ns.frames else [])
    start = time.perf_counter()
    proc = subprocess.run(cmd)
    wall = time.perf_counter() - start
    peak_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024**2
    report_path = out / "verify" / "report.json"
    print(f"\nadapt exit code      {proc.returncode}")
    print(f"adaptation wall time {wall / 60:.1f} min ({wall:.0f} s)")
    print(f"peak RSS             {peak_gb:.2f} GB (largest process: CLI or MCP server)")
    if report_path.exists():
        report = json.loads(report_path.read_text())
        m, unit = report["main_path"], report["step_name"]
        print(f"weights              {report['weights']} | scale {report['scale']} | {m['steps']} {unit}s | verdict {report['verdict']}")
        for check in m["checks"]:
            print(f"check                {check['title']}: worst {check['worst']} | passed {check['passed']}"
                  f"{'' if check['gating'] else ' (reported)'}")
        print(f"fallbacks            {m['fallbacks']}")
        print(f"latency per {unit:8s} torch {m['torch_s_per_step']:.2f} s | spliced {m['spliced_s_per_step']:.2f} s | "
              f"ratio spliced/eager {m['latency_ratio']:.2f}")
        for c in report["candidates"]:
            print(f"  {c['name']:38s} {c['status']:10s} {c['backend']:32s} probe {c['probe']['verdict']} "
                  f"cos {c['probe']['cosine']} max abs {c['probe']['max_abs']} | {c['calls']} calls")
        for name, why in report["not_spliced"].items():
            print(f"  {name:38s} pytorch: {why[:150]}")
    _print_stage_times(out / "task.yaml")
    return proc.returncode


def _print_stage_times(task: Path) -> None:
    if not task.exists():
        return
    import yaml

    stages = (yaml.load(task.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}).get("stages", {})
    totals: dict[str, float] = {}
    for step, result in stages.items():
        kind = step.split(":")[0]
        totals[kind] = totals.get(kind, 0.0) + float(result.get("seconds") or 0.0)
    print("stage times          " + ", ".join(f"{kind} {seconds:.0f} s" for kind, seconds in totals.items()))


if __name__ == "__main__":
    sys.exit(main())
