"""How close `omskills.profiling.memory_estimate` comes to ONNX Runtime's real peak on the CPU.

    .venv/bin/python benchmarks/memory_estimate_calibration.py [--out DIR] [--models attention,conv,mlp]
        [--run RUN/task.yaml]

Small models are exported with torch.onnx (dynamo, dynamic batch) and each is run on ONNX Runtime
(the project's backend: CPU, no memory arena) in a fresh process per batch size. That process
makes its feeds, resets its peak RSS (`VmHWM`, via /proc/self/clear_refs) and reads its RSS less
the feeds' bytes (the baseline: an idle Python with onnxruntime and the project imported); after
two runs it reads its peak again; measured = peak - baseline (the feeds are in both, as graph
inputs are in the estimate), with attention as exported (the graph the estimate is of, and the
one the backend falls back to). Printed, one row per model and batch: the graph estimate (weights
+ folded constants + live activations), the measured peak, their ratio, what the probe budgets
for the session (`session_need_bytes`: the estimate with the calibrated factors) and whether that
covers the measured peak, the weights, the measured peak once the session is loaded (before any
run), the measured peak of the session the backend opens by default (attention fused into
MultiHeadAttention where it matches, see omskills.runtime.attention_fusion), and the largest
tensor.

- attention: a two-block ViT-style encoder (scaled_dot_product_attention, 4 heads, 2048 tokens):
  the score matrices dominate, as in SAM's vision backbone.
- conv: five 3x3 convolutions on 256x256 images (activations dominate, plus im2col scratch).
- mlp: four 2048x2048 linear layers on a few tokens (weights dominate).

With `--run RUN/task.yaml`, every exported graph of an adaptation is measured too, on its largest
captured sample's inputs (the batch column then shows dim 0 of each input).

Each child takes at most about 1 GB at the largest batches; run it when the machine has room.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from omskills.profiling.memory_estimate import GIB, estimate_peak, session_need_bytes
from torch import nn
from torch.nn import functional as F

MIB = 2**20


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        # As SAM's ViT calls it; exported as MatMul + Softmax + MatMul (ATC's opsets have no Attention op).
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class Attention(nn.Module):
    tokens, dim = 2048, 64

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(self.dim, 4), Block(self.dim, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)

    def example(self, batch: int) -> torch.Tensor:
        return torch.randn(batch, self.tokens, self.dim)


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        widths = [3, 32, 64, 64, 32, 16]
        self.layers = nn.Sequential(
            *[layer for i in range(5) for layer in (nn.Conv2d(widths[i], widths[i + 1], 3, padding=1), nn.ReLU())]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def example(self, batch: int) -> torch.Tensor:
        return torch.randn(batch, 3, 256, 256)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(2048, 2048), nn.ReLU())])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def example(self, batch: int) -> torch.Tensor:
        return torch.randn(batch, 16, 2048)


MODELS = {"attention": (Attention, (1, 2, 4)), "conv": (Conv, (2, 4, 8)), "mlp": (Mlp, (1, 4, 16))}

# Runs in a fresh interpreter: the baseline is taken after the imports, before the feeds exist.
# ru_maxrss is no use here: Linux carries it across fork+exec, so a child of this (torch-sized)
# process starts with our peak. VmHWM belongs to the new address space, and writing 5 to
# clear_refs resets it to the current RSS after the imports.
_CHILD = """
import json, sys
import numpy as np
from omskills.convert.optimize import sample_arrays
from omskills.runtime.onnxruntime_backend import OnnxRuntimeBackend
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
rss = lambda: status("VmHWM")
path, kind, value, fuse = sys.argv[1:5]
if kind == "shape":
    feeds = {"x": np.random.default_rng(0).standard_normal(json.loads(value), dtype=np.float32)}
else:  # a captured sample's inputs, as the probe feeds them (its reference outputs dropped)
    feeds = sample_arrays(__import__("pathlib").Path(value))[0]
# The feeds are part of the estimate (graph inputs); what reading them left behind is not.
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
baseline = status("VmRSS") - sum(array.nbytes for array in feeds.values())
backend = OnnxRuntimeBackend(path, providers=["CPUExecutionProvider"], fuse_attention=fuse == "fused")
with backend:
    loaded = rss()
    feeds = {name: array for name, array in feeds.items() if name in {spec.name for spec in backend.inputs}}
    for _ in range(2):
        backend.run(feeds)
print(json.dumps({"baseline": baseline, "loaded": loaded, "peak": rss()}))
"""


def export(name: str, folder: Path) -> Path:
    torch.manual_seed(0)
    model = MODELS[name][0]().eval()
    path = folder / f"{name}.onnx"
    with torch.no_grad():
        torch.onnx.export(
            model,
            (model.example(2),),
            str(path),
            dynamo=True,
            external_data=False,
            opset_version=18,
            dynamic_shapes={"x": {0: torch.export.Dim("batch", min=1, max=64)}},
        )
    return path


def measure(
    path: Path, shape: list[int] | None = None, sample: Path | None = None, fused: bool = False
) -> dict[str, int]:
    """Baseline, after-load and peak RSS of a fresh process running `path` on random feeds of
    `shape` (input "x") or on a captured sample's inputs; with `fused`, as the backend opens it by
    default (attention fused into MultiHeadAttention where it matches)."""
    feed = ["shape", json.dumps(shape)] if sample is None else ["sample", str(sample)]
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), *feed, "fused" if fused else "exported"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def row(
    name: str, batch: int | str, estimate, path: Path, shape: list[int] | None = None, sample: Path | None = None
) -> str:
    rss = measure(path, shape, sample)
    measured = rss["peak"] - rss["baseline"]
    fused = measure(path, shape, sample, fused=True)
    top = estimate.largest[0]
    return (
        f"{name:<36} {batch:>5} {estimate.peak_bytes / MIB:>12.1f} {measured / MIB:>11.1f} "
        f"{measured / estimate.peak_bytes:>6.2f} {session_need_bytes(estimate) / MIB:>8.1f} "
        f"{'yes' if session_need_bytes(estimate) >= measured else 'NO':>7} {estimate.weights_bytes / MIB:>10.1f} "
        f"{(rss['loaded'] - rss['baseline']) / MIB:>9.1f} {(fused['peak'] - fused['baseline']) / MIB:>8.1f}  "
        f"{top.op} {top.shape} (unknown sizes: {estimate.unknown_shapes})"
    )


def run_folder_rows(task: Path) -> None:
    """One row per graph of an adaptation's run folder: its largest captured sample, as probed."""
    from omskills.profiling.memory_estimate import GraphMemory, sample_sizes
    from omskills.records.task import TaskRecord, load_record

    record, workdir = load_record(task), TaskRecord.workdir(task)
    for name, exported in record.exports.items():
        graph = GraphMemory(workdir / exported.path)
        paths = [workdir / p for p in record.contracts[name].samples]
        sample = max(paths, key=lambda p: sample_sizes(p).input_bytes)
        shapes = {k: v for k, v in sample_sizes(sample).inputs.items() if k in graph.input_names}
        batch = ",".join(str(shape[0]) for shape in shapes.values() if shape)[:5]
        print(row(name, batch, graph.estimate(shapes), workdir / exported.path, sample=sample), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where the exported models go (default: a temporary folder)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {sorted(MODELS)}")
    parser.add_argument(
        "--run", type=Path, help="also every graph of this adaptation's task.yaml, on its largest sample"
    )
    args = parser.parse_args()
    folder = args.out or Path(tempfile.mkdtemp(prefix="memory-calibration-"))
    folder.mkdir(parents=True, exist_ok=True)
    print(
        f"{'model':<36} {'batch':>5} {'predicted MB':>12} {'measured MB':>11} {'ratio':>6} {'need MB':>8} "
        f"{'covered':>7} "
        f"{'weights MB':>10} {'loaded MB':>9} {'fused MB':>8}  largest tensor"
    )
    for name in filter(None, args.models.split(",")):
        path = export(name, folder)
        for batch in MODELS[name][1]:
            shape = list(MODELS[name][0]().example(batch).shape)
            print(row(name, batch, estimate_peak(path, {"x": shape}), path, shape), flush=True)
    if args.run:
        run_folder_rows(args.run)
    print(f"models in {folder}; 1 GB = {GIB} bytes")


if __name__ == "__main__":
    main()
