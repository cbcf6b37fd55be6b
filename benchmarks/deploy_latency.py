"""Benchmark: the deployed path (omskills.deploy.load_adapted) against eager PyTorch, same run.

Each side runs in its own fresh process, one after the other, on the record's inputs:
- deployed: import omskills.deploy, load_adapted(RUN, backend), run the main path;
- eager: import the driver, build the same model, run the same main path in PyTorch.
Prints per side the import time, the load time (manifest + model build + sessions), the time per
step and the process's peak RSS, then the deployed/eager ratios. `--repeat N` runs the main path N
times in each process and reports the last run (the first pays one-off costs).

    .venv/bin/python benchmarks/deploy_latency.py RUN_OR_BUNDLE [--backend onnxruntime] [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def child(side: str, path: str, backend: str, repeat: int) -> None:
    import resource

    started = time.perf_counter()
    if side == "deployed":
        from omskills.deploy import load_adapted

        imported = time.perf_counter() - started
        model = load_adapted(path, backend)
        loaded = time.perf_counter() - started - imported
        runs = [model.run_main_path() for _ in range(repeat)]
        extra = {"backends": model.backend_of(), "fallbacks": len(model.fallbacks()), "load_parts_s": vars(model.times)}
    else:
        from omskills.deploy.adapted import build_model
        from omskills.deploy.manifest import manifest_from_record, read_bundle
        from omskills.models.api import RunHooks

        imported = time.perf_counter() - started
        root = Path(path).resolve() if Path(path).is_dir() else Path(path).resolve().parent
        manifest = read_bundle(root, check_hashes=False) if Path(path).is_dir() else manifest_from_record(Path(path))
        bound, data, loaded_model = build_model(manifest.intake, root)
        loaded = time.perf_counter() - started - imported
        runs = [
            bound.driver.run_main_path(loaded_model, data, bound.inputs, bound.verification, RunHooks())
            for _ in range(repeat)
        ]
        extra = {}
    last = runs[-1]
    print(
        json.dumps(
            {
                "side": side,
                "import_s": imported,
                "load_s": loaded,
                "steps": len(last.steps),
                "s_per_step": sum(s.seconds for s in last.steps) / max(len(last.steps), 1),
                "setup_s": last.setup_seconds,
                "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2,
                **extra,
            }
        )
    )


def measure(side: str, path: str, backend: str, repeat: int) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", side, path, "--backend", backend, "--repeat", str(repeat)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        sys.exit(f"{side} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="a verified run's task.yaml, or a bundle folder")
    parser.add_argument("--backend", default="onnxruntime", choices=["auto", "om", "onnxruntime"])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--child", choices=["deployed", "eager"], help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.child:
        child(ns.child, ns.path, ns.backend, ns.repeat)
        return 0
    eager = measure("eager", ns.path, ns.backend, ns.repeat)
    deployed = measure("deployed", ns.path, ns.backend, ns.repeat)
    for row in (eager, deployed):
        print(
            f"{row['side']:9s} import {row['import_s']:6.2f} s | load {row['load_s']:7.2f} s | "
            f"setup {row['setup_s']:6.2f} s | "
            f"{row['s_per_step']:8.3f} s per step over {row['steps']} | peak RSS {row['peak_rss_gb']:.2f} GB"
        )
    print(f"load parts (deployed): {json.dumps({k: round(v, 2) for k, v in deployed['load_parts_s'].items()})}")
    print(f"fallbacks (deployed): {deployed['fallbacks']}")
    for graph, backend in sorted(deployed["backends"].items()):
        print(f"  {graph:40s} {backend}")
    print(
        f"ratio deployed/eager: import {deployed['import_s'] / eager['import_s']:.2f} | "
        f"load {deployed['load_s'] / eager['load_s']:.2f} | per step {deployed['s_per_step'] / eager['s_per_step']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
