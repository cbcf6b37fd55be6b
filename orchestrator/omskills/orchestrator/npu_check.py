"""`omskills npu-check`, on an Ascend host: run the deployment on the NPU and write down what it produced.

`omskills npu-check TASK` verifies the main path with every graph on its OM
(`verify_main_path --backend om`), bundles the OMs, runs the bundle's example in a fresh process
on the OM backend, checks that its outputs are the verified ones bit for bit, and writes
`npu/figures.json` and `npu/FIGURES.md`. Every figure names the device the runtime reported.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from omskills.deploy.bundle import write_bundle
from omskills.errors import StageError
from omskills.models.api import load_run
from omskills.records.base import Record
from omskills.records.task import TaskRecord, load_record
from omskills.stages.verify import verify_main_path


class ExampleRun(Record):
    backend: str
    graphs: dict[str, str]  # graph -> backend and device the runtime reported
    import_s: float
    load_s: float
    steps: int
    s_per_step: float
    fallbacks: int
    merged_calls: dict[str, int] = {}  # graph -> calls answered inside the call of the graph before it


class NpuFigures(Record):
    task_id: str
    verdict: str  # verify_main_path --backend om
    summary: str
    latency_ratio: float  # spliced / PyTorch per step, in the verify run
    backend_per_candidate: dict[str, str]
    backend_ms_per_call: dict[str, float | None]
    bundle: str
    example: ExampleRun
    example_matches_verify: bool  # the example's outputs equal verify's spliced outputs, bit for bit
    figures_json: str
    figures_md: str


def npu_check(task_path: Path, timeout: float | None = None) -> NpuFigures:
    task_path = Path(task_path)
    record = load_record(task_path)
    workdir = TaskRecord.workdir(task_path)
    unbuilt = {
        name: tc.atc.script if tc.atc else "convert_atc"
        for name, tc in record.toolchain.items()
        if name in record.exports and not (tc.atc and tc.atc.status == "converted")
    }
    if unbuilt:
        listed = "; ".join(f"{name}: {script}" for name, script in unbuilt.items())
        raise StageError(f"no OM for {sorted(unbuilt)}: run convert_atc (or the scripts) on this host first ({listed})")
    report = verify_main_path(task_path, backend="om")
    bundle = write_bundle(task_path, artifact="om")
    out = workdir / "npu"
    out.mkdir(exist_ok=True)
    outputs = out / "example-outputs.npz"
    example = _run_example(Path(bundle.path) / "example.py", outputs, timeout)
    matches = _same_outputs(load_run(outputs), load_run(workdir / str(report.outputs_spliced)))
    figures = NpuFigures(
        task_id=record.id,
        verdict=report.verdict,
        summary=report.main_path.summary(),
        latency_ratio=report.main_path.latency_ratio,
        backend_per_candidate=report.backend_per_candidate,
        backend_ms_per_call={c.name: c.backend_ms_per_call for c in report.candidates},
        bundle=bundle.path,
        example=example,
        example_matches_verify=matches,
        figures_json="npu/figures.json",
        figures_md="npu/FIGURES.md",
    )
    (out / "figures.json").write_text(figures.model_dump_json(indent=2))
    (out / "FIGURES.md").write_text(_markdown(figures))
    return figures


def _run_example(script: Path, outputs: Path, timeout: float | None) -> ExampleRun:
    proc = subprocess.run(
        [sys.executable, str(script), "--backend", "om", "--outputs", str(outputs)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise StageError(f"the bundle's example failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    start = proc.stdout.find("\n{")
    return ExampleRun.model_validate(json.loads(proc.stdout[start + 1 :]))


def _same_outputs(a: dict[int, dict[str, np.ndarray]], b: dict[int, dict[str, np.ndarray]]) -> bool:
    return a.keys() == b.keys() and all(
        a[i].keys() == b[i].keys() and all(np.array_equal(a[i][k], b[i][k]) for k in a[i]) for i in a
    )


def _markdown(f: NpuFigures) -> str:
    rows = "\n".join(
        f"| {name} | {backend} | {f.backend_ms_per_call.get(name) or '-'} |"
        for name, backend in f.backend_per_candidate.items()
    )
    return (
        f"# {f.task_id} on the OM backend\n\n"
        f"verify_main_path --backend om: **{f.verdict}** ({f.summary}); "
        f"spliced/PyTorch per step {f.latency_ratio:.2f}.\n\n"
        f"| graph | backend (as the runtime reported it) | ms per call |\n|---|---|---|\n{rows}\n\n"
        f"Bundle example (`{f.bundle}/example.py --backend om`, a fresh process): import {f.example.import_s:.2f} s, "
        f"load {f.example.load_s:.2f} s, {f.example.s_per_step:.3f} s per step over {f.example.steps} steps, "
        f"{f.example.fallbacks} fallbacks; outputs equal to verify's: {f.example_matches_verify}.\n"
    )
