"""Dense layers on ONNX Runtime's CPU kernels against PyTorch's, on one machine, in one process.

    .venv/bin/python benchmarks/linear_layers.py [--tokens 5184] [--width 1024] [--repeats 5]

A transformer backbone spends most of its CPU time in its linear layers: four per block (the
fused query-key-value projection, the output projection and the two MLP layers). These shapes,
as the exporter writes them, run here as single-node graphs on ONNX Runtime (`Gemm` with a
transposed weight, as exported, and `MatMul` + `Add`) and as `torch.nn.functional.linear`, in
turns, with the threads each runtime uses by default. Printed: the median ms per call and the
ratio to PyTorch. A spliced pipeline cannot run faster than eager where its graph's time is in
kernels slower than PyTorch's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper


def _session(
    nodes: list[onnx.NodeProto], weights: list[onnx.TensorProto], rows: int, width: int, out_width: int
) -> ort.InferenceSession:
    graph = helper.make_graph(
        nodes,
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, out_width])],
        weights,
    )
    options = ort.SessionOptions()
    options.enable_cpu_mem_arena = False  # as the ONNX Runtime backend runs
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _median_ms(call, repeats: int) -> float:
    call()  # warm-up: ORT packs the weight on its first run
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def measure(rows: int, width: int, out_width: int, repeats: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((out_width, width)) * 0.02).astype(np.float32)
    bias = rng.standard_normal(out_width).astype(np.float32)
    x = rng.standard_normal((rows, width)).astype(np.float32)
    gemm = _session(
        [helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)],
        [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "b")],
        rows,
        width,
        out_width,
    )
    matmul = _session(
        [helper.make_node("MatMul", ["x", "wt"], ["t"]), helper.make_node("Add", ["t", "b"], ["y"])],
        [numpy_helper.from_array(np.ascontiguousarray(weight.T), "wt"), numpy_helper.from_array(bias, "b")],
        rows,
        width,
        out_width,
    )
    tx, tw, tb = torch.from_numpy(x), torch.from_numpy(weight), torch.from_numpy(bias)

    def linear() -> None:
        with torch.no_grad():
            torch.nn.functional.linear(tx, tw, tb)

    reference = torch.nn.functional.linear(tx, tw, tb).numpy()
    for session in (gemm, matmul):
        np.testing.assert_allclose(session.run(None, {"x": x})[0], reference, rtol=1e-3, atol=1e-3)
    calls = {
        "ort Gemm": lambda: gemm.run(None, {"x": x}),
        "ort MatMul+Add": lambda: matmul.run(None, {"x": x}),
        "torch linear": linear,
    }
    rounds = {name: [] for name in calls}
    for _ in range(3):  # in turns, so that each sees the same load
        for name, call in calls.items():
            rounds[name].append(_median_ms(call, repeats))
    return {name: statistics.median(values) for name, values in rounds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=5184, help="rows: tokens of one image (72x72 by default)")
    parser.add_argument("--width", type=int, default=1024, help="the model's width")
    parser.add_argument("--mlp-ratio", type=float, default=4.625, help="MLP width / model width")
    parser.add_argument("--repeats", type=int, default=5)
    ns = parser.parse_args()
    mlp = int(ns.width * ns.mlp_ratio)
    shapes = {
        "qkv projection": (ns.width, 3 * ns.width),
        "output projection": (ns.width, ns.width),
        "MLP up": (ns.width, mlp),
        "MLP down": (mlp, ns.width),
    }
    print(
        f"onnxruntime {ort.__version__} ({ort.get_device()}), torch {torch.__version__} "
        f"({torch.get_num_threads()} threads); {ns.tokens} tokens, median ms per call"
    )
    print(f"{'layer':18s} {'shape':>18s} {'ort Gemm':>9s} {'ort MatMul':>10s} {'torch':>7s} {'Gemm/torch':>10s}")
    totals = {"ort Gemm": 0.0, "ort MatMul+Add": 0.0, "torch linear": 0.0}
    for layer, (width, out_width) in shapes.items():
        ms = measure(ns.tokens, width, out_width, ns.repeats)
        for name in totals:
            totals[name] += ms[name]
        print(
            f"{layer:18s} {f'{width}->{out_width}':>18s} {ms['ort Gemm']:9.0f} {ms['ort MatMul+Add']:10.0f} "
            f"{ms['torch linear']:7.0f} {ms['ort Gemm'] / ms['torch linear']:10.2f}"
        )
    print(
        f"{'one block':18s} {'':>18s} {totals['ort Gemm']:9.0f} {totals['ort MatMul+Add']:10.0f} "
        f"{totals['torch linear']:7.0f} {totals['ort Gemm'] / totals['torch linear']:10.2f}"
    )


if __name__ == "__main__":
    main()
