"""Benchmark: the memory an emulated attention layer takes on ONNX Runtime CPU, whole and split by heads.

Builds one attention layer as PyTorch exports it (scaled Q times K^T, a per-head bias, softmax,
times V) at full-scale image-token counts, emulates ATC's force_fp16 on it as the precision plan
does (`save_emulated`), and runs it in a fresh child process per variant, opened as the spliced
pipeline opens a graph (`open_backend`): the exported graph in fp32,
the emulated graph whole, and the emulated graph split by heads (what `save_emulated` writes).
Prints each child's peak resident memory and seconds, and checks that split and whole agree bit
for bit. Emulated on CPU: nothing here ran on an NPU.

    .venv/bin/python benchmarks/emulated_attention_memory.py [--tokens 5184] [--heads 16] [--dim 64]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

CHILD = r"""
import json, resource, sys, time
import numpy as np
from omskills.runtime import open_backend
path, feeds_path, out_path = sys.argv[1:4]
feeds = dict(np.load(feeds_path))
backend = open_backend(path, "onnxruntime")
started = time.perf_counter()
out = backend.run(feeds)["out"]
seconds = time.perf_counter() - started
np.save(out_path, out)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"peak_bytes": peak, "seconds": seconds}))
"""


def attention_graph(folder: Path, tokens: int, heads: int, dim: int) -> tuple[Path, Path]:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    vi = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    nodes = [
        helper.make_node("Mul", ["q", "scale"], ["qs"], name="scale_q"),
        helper.make_node("MatMul", ["qs", "kt"], ["scores"], name="qk"),
        helper.make_node("Add", ["scores", "bias"], ["biased"], name="add_bias"),
        helper.make_node("Softmax", ["biased"], ["probs"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["probs", "v"], ["out"], name="pv"),
    ]
    bias = numpy_helper.from_array(rng.normal(size=(1, 1, tokens, tokens)).astype(np.float32), "bias")
    scale = numpy_helper.from_array(np.array(dim**-0.5, np.float32), "scale")
    graph = helper.make_graph(
        nodes,
        "attention",
        [vi("q", [1, heads, tokens, dim]), vi("kt", [1, heads, dim, tokens]), vi("v", [1, heads, tokens, dim])],
        [vi("out", [1, heads, tokens, dim])],
        initializer=[bias, scale],
    )
    path = folder / "attention.onnx"
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
        str(path),
        save_as_external_data=True,
        location="attention.onnx.data",
    )
    feeds = folder / "feeds.npz"
    np.savez(
        feeds,
        q=rng.normal(size=(1, heads, tokens, dim)).astype(np.float32),
        kt=rng.normal(size=(1, heads, dim, tokens)).astype(np.float32),
        v=rng.normal(size=(1, heads, tokens, dim)).astype(np.float32),
    )
    return path, feeds


def emulated(path: Path, split: bool) -> Path:
    import omskills.ascend.emulation as emulation

    out = path.with_name(f"attention.emulated-{'split' if split else 'whole'}.onnx")
    prepared = emulation.prepare(path)
    if split:
        emulation.save_emulated(prepared, emulation.precisions_for(prepared, "force_fp16"), out)
    else:
        original = emulation.split_attention_heads
        emulation.split_attention_heads = lambda model: 0  # the graph as it was written before the split
        try:
            emulation.save_emulated(prepared, emulation.precisions_for(prepared, "force_fp16"), out)
        finally:
            emulation.split_attention_heads = original
    return out


def run_child(model: Path, feeds: Path, out: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(model), str(feeds), str(out)], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=5184, help="72 x 72 patches: a 1008-pixel image at patch 14")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=64)
    ns = parser.parse_args()
    scores_gb = ns.heads * ns.tokens * ns.tokens * 4 / 1e9
    print(
        f"one attention layer: {ns.heads} heads x {ns.tokens} tokens, d {ns.dim}; "
        f"one [1, H, L, L] fp32 score tensor: {scores_gb:.2f} GB"
    )
    with tempfile.TemporaryDirectory(prefix="attention-memory-") as tmp:
        folder = Path(tmp)
        path, feeds = attention_graph(folder, ns.tokens, ns.heads, ns.dim)
        variants = {
            "exported fp32 (as verify runs it)": path,
            "emulated force_fp16, whole": emulated(path, split=False),
            "emulated force_fp16, split by heads": emulated(path, split=True),
        }
        results = {}
        for label, model in variants.items():
            results[label] = run_child(model, feeds, folder / f"{model.stem}.out.npy")
            print(f"{label:52s} peak {results[label]['peak_bytes'] / 1e9:6.2f} GB   {results[label]['seconds']:6.2f} s")
        whole = np.load(folder / "attention.emulated-whole.out.npy")
        split = np.load(folder / "attention.emulated-split.out.npy")
        same = bool(np.array_equal(whole, split))
        ratio = (
            results["emulated force_fp16, split by heads"]["peak_bytes"]
            / results["emulated force_fp16, whole"]["peak_bytes"]
        )
        print(f"split / whole peak: {ratio:.2f}; outputs equal bit for bit: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
