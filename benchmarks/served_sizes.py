"""Benchmark: a deployed model on inputs of sizes its adaptation never saw, against eager PyTorch.

For each set of input overrides (fields of intake.inputs), `load_adapted` runs the main path with
the graphs spliced in, then the same main path with them taken out (eager PyTorch, same process,
same inputs). One row per input set and graph: its backend calls, the calls that fell back to
PyTorch (and why), the gear-sized calls a batch that is no gear ran as, the bytes a call sends to
the device and copies back (`splicing.traffic`), and the worst max-abs difference between the two
runs' outputs.

    .venv/bin/python benchmarks/served_sizes.py RUN_OR_BUNDLE --inputs '{"seconds": 13.8}' [--inputs ...]
        [--backend onnxruntime]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import Any

import numpy as np
from omskills.deploy import load_adapted
from omskills.models.api import MainPathRun


def worst_difference(eager: MainPathRun, spliced: MainPathRun) -> float:
    """The largest |eager - spliced| over every numeric output of every step."""
    worst = 0.0
    for a, b in zip(eager.steps, spliced.steps):
        for name, value in a.outputs.items():
            x, y = np.asarray(value), np.asarray(b.outputs.get(name))
            if x.shape == y.shape and x.dtype.kind in "fiub" and x.size:
                worst = max(worst, float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))))
    return worst


def graph_rows(model: Any) -> list[dict[str, Any]]:
    """Per graph: calls, fallbacks and their reasons, gear-sized chunks, bytes per call each way."""
    moved: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for step in model.handle.traffic.steps():
        for graph in step.graphs:
            counts = moved[graph.graph]
            counts[0] += graph.calls
            counts[1] += graph.bytes_in
            counts[2] += graph.bytes_out
    rows = []
    for stats in model.stats():
        spliced = model.handle.modules[stats.candidate]
        runner = next(r.backend for r in spliced.routes if r.contract.candidate == stats.candidate)
        calls, bytes_in, bytes_out = moved[stats.candidate]
        rows.append(
            {
                "graph": stats.candidate,
                "backend": runner.describe(),
                "calls": stats.calls,
                "fallbacks": stats.fallbacks,
                "reasons": stats.fallback_reasons,
                "gear_sized_calls": getattr(runner, "chunk_sizes", []),
                "bytes_in_per_call": bytes_in / calls if calls else 0.0,
                "bytes_out_per_call": bytes_out / calls if calls else 0.0,
            }
        )
    return rows


def measure(path: str, backend: str, overrides: dict[str, Any]) -> dict[str, Any]:
    with load_adapted(path, backend) as model:
        spliced = model.run_main_path(overrides)
        rows = graph_rows(model)
        model.handle.unsplice()
        eager = model.run_main_path(overrides)
    return {"inputs": overrides, "graphs": rows, "worst_max_abs": worst_difference(eager, spliced)}


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| inputs | graph | calls | fallbacks | gear-sized calls | bytes in / call | bytes out / call "
        "| worst max abs |",
        "|" + "---|" * 8,
    ]
    for result in results:
        for row in result["graphs"]:
            fell = f"{row['fallbacks']}" + (f" ({row['reasons'][0]})" if row["reasons"] else "")
            lines.append(
                f"| {json.dumps(result['inputs'])} | {row['graph']} | {row['calls']} | {fell} "
                f"| {row['gear_sized_calls'] or '-'} | {row['bytes_in_per_call']:,.0f} "
                f"| {row['bytes_out_per_call']:,.0f} | {result['worst_max_abs']:.3g} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="a verified run's task.yaml, or a bundle folder")
    parser.add_argument("--inputs", action="append", default=[], help="overrides of intake.inputs, as JSON")
    parser.add_argument("--backend", default="onnxruntime")
    args = parser.parse_args()
    results = [measure(args.path, args.backend, json.loads(text)) for text in args.inputs or ["{}"]]
    print(markdown(results))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
