"""Benchmark: a CLIP-style text tower's calls when N images are classified against one prompt set.

The zoo's open-clip-zero-shot (examples/zoo/: open_clip's CLIP, tiny config, random weights) is
adapted once (or `--run` names a verified run), then its deployed model (`load_adapted`, ONNX
Runtime CPU) runs the main path on N images of the built-in clip, each classified against the
record's prompt set, which the entry encodes again for every image. Three ways:
- main's rule: a graph is remembered only when every contract input's provenance is "input" (the
  rule before roots were traced, applied to the same contracts: the tower's input is the token
  embedding's output, so it never is);
- this rule (`splicing.memo.why_not_memoisable`): inputs derived from user inputs and the model's
  constants alone;
- a bundle written with `--precompute` of the prompt set, loaded with `load_adapted`.
For each: the text tower's calls, the calls its backend ran, the calls answered from memory and the
seconds its backend took, over `--repeat` passes in one process. (The main path's own time is left
out: at this size it is the tokenizer and the image preprocessing, and the order the three ways run
in moves it more than the tower does.)

    .venv/bin/python benchmarks/memo_text_tower.py [--images 8] [--repeat 3] [--run RUN] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RECORD = REPO / "examples" / "zoo" / "open-clip-zero-shot.yaml"
TOWER = "text_tower"
CLI = "import sys; from omskills.orchestrator.cli import main; sys.exit(main())"


def main_rule(contract) -> bool:
    """The memo rule of main (before roots were traced): every input's provenance "input", small."""
    from omskills.splicing.memo import MAX_INPUT_BYTES

    inputs = contract.inputs
    if not inputs or any(s.provenance is None or s.provenance.kind != "input" for s in inputs):
        return False
    return sum(np.dtype(s.dtype).itemsize * math.prod(s.shape) for s in inputs) <= MAX_INPUT_BYTES


def adapted_run(out: Path) -> Path:
    """The zoo record adapted into `out` with `omskills adapt`: its task.yaml."""
    done = subprocess.run([sys.executable, "-c", CLI, "adapt", str(RECORD), "--out", str(out)], text=True)
    if done.returncode != 0:
        sys.exit(f"omskills adapt {RECORD.name} failed (exit {done.returncode})")
    return out / "task.yaml"


def measure(path: Path, images: int, repeat: int, rule=None) -> dict:
    """The deployed model at `path` on `images` images, `repeat` times in one process: the text
    tower's figures over all passes."""
    from omskills.deploy import load_adapted

    patched = mock.patch("omskills.splicing.splice.memoisable", rule) if rule else contextlib.nullcontext()
    with patched, load_adapted(path, backend="onnxruntime", providers=["CPUExecutionProvider"], strict=True) as model:
        for _ in range(repeat):
            model.run_main_path({"count": images})
        tower = {s.candidate: s for s in model.stats()}[TOWER]
    return {
        "calls": tower.calls,
        "backend": tower.backend_calls,
        "memory": tower.memo_hits,
        "backend_s": tower.total_backend_seconds,
        "fallbacks": tower.fallbacks,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=8, help="images per pass (the built-in clip has 30)")
    parser.add_argument("--repeat", type=int, default=3, help="passes over the images in each process")
    parser.add_argument("--run", type=Path, help="a verified run's task.yaml of the record (default: adapt it)")
    parser.add_argument("--out", type=Path, help="where to adapt and bundle (default: a temporary folder)")
    args = parser.parse_args()
    from omskills.deploy.bundle import write_bundle
    from omskills.records.task import load_record

    out = args.out or Path(tempfile.mkdtemp(prefix="memo-text-tower-"))
    task = args.run or adapted_run(out / "run")
    prompts = load_record(task).intake.inputs["prompts"]
    bundle = write_bundle(task, out / "bundle", precompute=[{"prompts": prompts}])
    rows = {
        "main's rule (every input 'input')": measure(task, args.images, args.repeat, main_rule),
        "this rule (inputs and constants)": measure(task, args.images, args.repeat),
        "bundle --precompute, load_adapted": measure(Path(bundle.path), args.images, args.repeat),
    }
    print(
        f"### {TOWER} of {RECORD.stem}: {args.images} images x {args.repeat} passes, one set of "
        f"{len(prompts)} prompts (ONNX Runtime CPU)\n"
    )
    print("| memo rule | text tower calls | backend runs | from memory | fallbacks | backend s |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        cells = [name, r["calls"], r["backend"], r["memory"], r["fallbacks"], f"{r['backend_s']:.4f}"]
        print("| " + " | ".join(map(str, cells)) + " |")
    kept = bundle.remembered.get(TOWER)
    print(
        f"\nbundle: {kept.entries if kept else 0} call(s) of {TOWER} computed ahead, {kept.bytes if kept else 0} bytes"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
