"""Benchmark: Ascend precision emulated on CPU for a finished adaptation.

Prints every candidate's emulated figures per ATC precision mode (cosine, max abs, overflow,
the keep list proposed and the result with it, the mode chosen), then runs verify_main_path
with every spliced graph in its chosen mode emulated and prints the end-to-end checks beside
the fp32 ones. Emulated on ONNX Runtime CPU: none of these figures comes from an NPU.

    .venv/bin/python benchmarks/precision_emulated.py RUN_DIR   # a folder `omskills adapt` wrote
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="the run folder (holds task.yaml)")
    ns = parser.parse_args()
    task = Path(ns.run) / "task.yaml"
    if not task.is_file():
        sys.exit(f"{task}: no task record; run `omskills adapt` first")
    from omskills.records.task import load_record

    record = load_record(task)
    for name in record.graphs():
        report = record.toolchain_of(name).precision
        if report is None:
            print(f"{name:38s} no precision emulation recorded")
            continue
        for m in report.modes:
            r, k = m.result, m.with_keep
            kept = f" | keep {len(m.keep)} {m.keep[:4]} -> cos {k.cosine:.6f} max abs {k.max_abs:.3g} {'pass' if k.passed else 'fail'}" if k else ""
            print(f"{name:38s} {m.mode:24s} cos {r.cosine:.6f} max abs {r.max_abs:.3g} overflow {r.overflow} "
                  f"fp16 nodes {r.fp16_nodes} {'pass' if r.passed else 'fail'}{kept}")
        print(f"{name:38s} chosen {report.chosen_mode} keep {report.chosen_keep}")
    cmd = [sys.executable, "-c", "import sys; from omskills.orchestrator.cli import main; sys.exit(main())", "tool",
           "verify_main_path", "--args", json.dumps({"task": str(task), "precision": "emulated"})]
    start = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL)
    print(f"\nemulated verify exit {proc.returncode} in {time.perf_counter() - start:.0f} s")
    for label, path in (("fp32", "report.json"), ("emulated", "report-emulated.json")):
        file = Path(ns.run) / "verify" / path
        if file.is_file():
            report = json.loads(file.read_text())
            checks = "; ".join(f"{c['title']} worst {c['worst']}{'' if c['passed'] else ' (failed)'}" for c in report["main_path"]["checks"])
            print(f"{label:9s} verdict {report['verdict']} | {checks} | fallbacks {report['main_path']['fallbacks']}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
