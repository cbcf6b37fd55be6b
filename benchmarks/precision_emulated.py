"""Benchmark: Ascend precision emulated on CPU for a finished adaptation.

Prints every candidate's emulated figures per ATC precision mode (cosine, max abs, overflow,
the keep list proposed and the result with it, the mode chosen), then runs verify_main_path
with every spliced graph in its chosen mode emulated and prints the end-to-end checks beside
the fp32 ones. Emulated on ONNX Runtime CPU: none of these figures comes from an NPU.

    .venv/bin/python benchmarks/precision_emulated.py RUN_DIR   # a folder `omskills adapt` wrote
        [--against-pytorch NAME ...]   # also compare those graphs with their PyTorch submodules
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
    parser.add_argument("--against-pytorch", nargs="*", default=[], metavar="NAME")
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
            kept = (
                f" | keep {len(m.keep)} {m.keep[:4]} -> cos {k.cosine:.6f} max abs {k.max_abs:.3g} "
                f"{'pass' if k.passed else 'fail'}"
                if k
                else ""
            )
            print(
                f"{name:38s} {m.mode:24s} cos {r.cosine:.6f} max abs {r.max_abs:.3g} overflow {r.overflow} "
                f"fp16 nodes {r.fp16_nodes} {'pass' if r.passed else 'fail'}{kept}"
            )
        print(f"{name:38s} chosen {report.chosen_mode} keep {report.chosen_keep}")
    for name in ns.against_pytorch:
        _print_against_pytorch(task, name)
    cmd = [*TOOL, "verify_main_path", "--args", json.dumps({"task": str(task), "precision": "emulated"})]
    start = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL)
    print(f"\nemulated verify exit {proc.returncode} in {time.perf_counter() - start:.0f} s")
    for label, path in (("fp32", "report.json"), ("emulated", "report-emulated.json")):
        file = Path(ns.run) / "verify" / path
        if file.is_file():
            report = json.loads(file.read_text())
            checks = "; ".join(
                f"{c['title']} worst {c['worst']}{'' if c['passed'] else ' (failed)'}"
                for c in report["main_path"]["checks"]
            )
            print(f"{label:9s} verdict {report['verdict']} | {checks} | fallbacks {report['main_path']['fallbacks']}")
    return proc.returncode


TOOL = [sys.executable, "-c", "import sys; from omskills.orchestrator.cli import main; sys.exit(main())", "tool"]


def _print_against_pytorch(task: Path, name: str) -> None:
    """The export of `name` node by node against its PyTorch submodules, on the first sample."""
    start = time.perf_counter()
    proc = subprocess.run(
        [*TOOL, "compare_layers", "--args", json.dumps({"task": str(task), "candidate": name, "against": "pytorch"})],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        print(f"{name:38s} against pytorch failed: {proc.stderr.strip().splitlines()[-1:]}")
        return
    r = json.loads(proc.stdout)
    worst = min((o["cosine"] for o in r["outputs"]), default=float("nan"))
    print(
        f"{name:38s} against pytorch: {r['nodes_compared']} module outputs compared, {r['nodes_flagged']} flagged, "
        f"{r['unmatched']} unmatched, output cos {worst:.6f}, first {r['first'] and r['first']['node']} "
        f"in {time.perf_counter() - start:.0f} s"
    )
    for note in r["notes"]:
        print(f"{'':38s}   note: {note}")


if __name__ == "__main__":
    sys.exit(main())
