"""Benchmark: what one emulated pass of a graph costs beside the plain graph, in the same process.

For each graph of an adapted run (its exported ONNX and its first recorded sample, cut to its first
batch chunk where ONNX Runtime takes the batch in chunks), prints the
plain graph's session load and run, then calibration's observed emulated graph (force_fp16, every
float tensor's magnitude read, overflow counted): the split of its attention by heads, the graph's
build, its session load and its run, with the ratio of the emulated run to the plain one.

    .venv/bin/python benchmarks/emulation_cost.py RUN [GRAPH ...]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import onnxruntime as ort
from omskills.ascend.calibration import shaped_tensors
from omskills.ascend.emulation import emulated_model, precisions_for, prepared_light, session_beside, split_by_heads
from omskills.convert.optimize import FirstChunk, sample_arrays
from omskills.records.task import load_record
from omskills.records.toolchain import BatchSplit


def measure(run: Path, graph: str, sample: str, split: BatchSplit | None) -> str:
    path = run / "onnx" / graph / f"{graph}.onnx"
    # The first chunk where ONNX Runtime takes the batch in chunks, as the emulation step runs it.
    data, _ = sample_arrays(FirstChunk(run / sample, split) if split else run / sample)
    with prepared_light(path) as prepared:
        feeds = {i.name: data[i.name] for i in prepared.graph.input if i.name in data}
        clock = time.perf_counter()
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        loaded = time.perf_counter()
        session.run(None, feeds)
        plain_load, plain_run = loaded - clock, time.perf_counter() - loaded
        del session
        clock = time.perf_counter()
        precisions = precisions_for(prepared, "force_fp16")
        split, precisions = split_by_heads(prepared, precisions) or (prepared, precisions)
        split_s = time.perf_counter() - clock
        clock = time.perf_counter()
        model = emulated_model(split, precisions, count_overflow=True, observe=shaped_tensors(split.model))
        build_s = time.perf_counter() - clock
        with session_beside(prepared.path, model) as emulated:
            loaded = time.perf_counter()
            emulated.run(None, feeds)
            run_s = time.perf_counter() - loaded
        load_s = loaded - clock - build_s
    return (
        f"{graph:40s} plain: load {plain_load:6.1f} s run {plain_run:6.1f} s ({len(prepared.graph.node)} nodes) | "
        f"emulated: split {split_s:4.1f} s build {build_s:5.1f} s load {load_s:6.1f} s run {run_s:6.1f} s "
        f"({len(model.graph.node)} nodes) | run ratio {run_s / max(plain_run, 1e-9):.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="an adapted run folder (its task.yaml, onnx/, samples/)")
    parser.add_argument("graphs", nargs="*", help="graphs to measure (default: every exported one)")
    args = parser.parse_args()
    record = load_record(args.run / "task.yaml")
    for graph in args.graphs or list(record.exports):
        samples = record.contract(graph).samples
        split = record.batch_split_of(graph)
        print(measure(args.run, graph, samples[0], split) if samples else f"{graph}: no recorded sample", flush=True)


if __name__ == "__main__":
    main()
