"""Ascend precision before an NPU (stage 3): every precision mode emulated on the preferred
variant of each candidate, the keep lists proposed, and the mode ATC is to convert with.

Emulation and comparison run in a child process unless the graph's predicted need is small: an
emulated graph holds fp16 copies of its activations and a comparison two runs side by side, so
their memory follows the activations, not the file (a 38 MB attention graph at full scale takes
gigabytes); in a child, the server stays small, every byte returns at exit, and a run out of
memory fails that one step. A small graph runs here: a child's start-up (about 2 s of imports)
is more than its whole emulation."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from omskills.ascend.emulation import EMULATION_REVISION, compare_layers, precisions_for, prepare, prepared_light
from omskills.ascend.module_outputs import module_observations
from omskills.ascend.npu_dumps import read_dump
from omskills.ascend.observed import DEFAULT_BUDGET_BYTES, compare_observed
from omskills.ascend.precision_fix import precision_on_sample
from omskills.ascend.precision_modes import DEFAULT_MODES, EMULATED_MODES
from omskills.convert.export import ContractWrapper
from omskills.convert.optimize import first_chunk_arrays
from omskills.errors import InputError, OmskillsError, StageError
from omskills.isolation import model_bytes, run_in_child
from omskills.models import cache as model_cache
from omskills.profiling.memory_estimate import MIB, GraphMemory
from omskills.records.choices import CompareAgainst
from omskills.records.contracts import ContractSpec
from omskills.records.precision import LayerComparison, PrecisionReport
from omskills.records.stage_order import step_key
from omskills.records.task import TaskRecord, load_record
from omskills.run_folder import RunFolder
from omskills.stages.model import open_model
from omskills.stages.steps import StepStart, fingerprint

T = TypeVar("T")

# Emulations predicted to need less than this run in this process (see the module doc).
IN_PROCESS_MAX_BYTES = 256 * MIB
# Activation bytes an emulation or a layer comparison holds per byte of one fp32 run: the fp16-rounded
# copy beside each fp32 activation, and in a comparison the reference run's beside the emulated one.
EMULATION_ACTIVATION_FACTOR = 4


def emulation_runner(model: Path, feeds: dict[str, np.ndarray]) -> Callable[..., Any]:
    """`run_in_child`, or a plain call when the graph is small and its emulation on `feeds` is
    predicted (from the graph's shapes, `GraphMemory`) to need under IN_PROCESS_MAX_BYTES."""
    if model_bytes(model) >= IN_PROCESS_MAX_BYTES:
        return run_in_child
    try:
        graph = GraphMemory(model)
        estimate = graph.estimate({k: feeds[k].shape for k in graph.input_names if k in feeds})
    except Exception:  # noqa: BLE001 - the prediction only advises: without one, the safe place
        return run_in_child
    need = estimate.weights_bytes + estimate.folded_bytes + EMULATION_ACTIVATION_FACTOR * estimate.activation_bytes
    if estimate.unknown_shapes or need >= IN_PROCESS_MAX_BYTES:
        return run_in_child
    return _call_here


def _call_here(fn: Callable[..., T], *args: Any) -> T:
    return fn(*args)


def _checked_modes(modes: list[str] | None) -> list[str]:
    chosen = list(modes or DEFAULT_MODES)
    unknown = [m for m in chosen if m not in EMULATED_MODES]
    if unknown:
        raise InputError(f"modes: {unknown} are not emulated; choose from {sorted(EMULATED_MODES)}")
    return chosen


def first_feeds(record: TaskRecord, workdir: Path, name: str) -> tuple[dict[str, np.ndarray], str]:
    """The first captured sample's inputs, cut to the batch ONNX Runtime can hold here."""
    samples = record.contract(name).samples
    if not samples:
        raise StageError(f"candidate {name!r} has no captured samples")
    feeds, _ = first_chunk_arrays(workdir / samples[0], record.batch_split_of(name))
    return feeds, samples[0]


def emulate_candidate(task_path: Path, name: str, modes: list[str] | None = None) -> PrecisionReport:
    start = StepStart.of(task_path, step_key("precision", name))
    record, workdir = start.record, start.workdir
    chosen = _checked_modes(modes)
    model = record.preferred_model(workdir, name)
    start.require_intact(
        {"study": record.contract(name).samples[:1], step_key("export", name): None, step_key("optimize", name): None},
        "export_onnx / optimize_onnx",
    )
    inputs_hash = fingerprint(
        record.exports[name].sha256,
        RunFolder(workdir).stored(model),
        chosen,
        record.contract(name).samples[:1],
        EMULATION_REVISION,
    )
    existing = record.toolchain_of(name).precision
    if start.done(inputs_hash) and existing is not None:
        return existing
    feeds, sample = first_feeds(record, workdir, name)
    model_cache.release()  # emulation needs no PyTorch model
    with start.running(inputs_hash) as handle:
        try:
            report = emulation_runner(model, feeds)(
                precision_on_sample, model, feeds, workdir / sample, sample, chosen, record.batch_split_of(name)
            )
        except OmskillsError:
            raise
        except Exception as exc:  # onnx / ONNX Runtime raise their own types
            raise StageError(f"{name}: precision emulation failed: {type(exc).__name__}: {exc}") from exc
        report = report.model_copy(update={"model": RunFolder(workdir).stored(model)})

        def store(rec: TaskRecord) -> None:
            rec.toolchain_entry(name).precision = report
            table = "; ".join(
                f"{m.mode} {'pass' if (m.with_keep or m.result).passed else 'fail'} "
                f"(cos {(m.with_keep or m.result).cosine:.5f}{f', keep {len(m.keep)}' if m.keep else ''})"
                for m in report.modes
            )
            rec.decide(
                "emulate_precision",
                f"{name}: convert with {report.chosen_mode}",
                f"{report.why}; emulated on CPU: {table}",
            )

        handle.update(store)
    return report


def compare_candidate_layers(
    task_path: Path,
    name: str,
    mode: str = "force_fp16",
    keep: list[str] | None = None,
    against: CompareAgainst = "emulated",
    dump_dir: Path | None = None,
    om_json: Path | None = None,
) -> LayerComparison:
    """One candidate's graph in fp32, node by node, on its first sample, against `mode`
    emulated (with `keep` kept), an OM's dump from an NPU, or the PyTorch module's outputs."""
    record = load_record(task_path)
    workdir = TaskRecord.workdir(task_path)
    feeds, _ = first_feeds(record, workdir, name)
    if against == "pytorch":
        return _compare_with_module(record, workdir, name, feeds)
    model = record.preferred_model(workdir, name)
    if against == "npu_dump":
        inputs = write_npu_inputs(workdir / "precision" / name / "npu_inputs", record.contract(name), feeds)
        if dump_dir is None:
            raise InputError(
                f"dump_dir: give the folder the OM's dump went to; on the NPU run "
                f"`{npu_dump_command(_om_file(record, name), inputs)}` (the inputs are this candidate's first sample)"
            )
        model_cache.release()
        comparison = run_in_child(_compare_dump, model, Path(dump_dir), om_json and Path(om_json), feeds)
    else:
        _checked_modes([mode])
        model_cache.release()
        comparison = emulation_runner(model, feeds)(_compare_file, model, mode, list(keep or []), feeds)
    return comparison.model_copy(update={"model": RunFolder(workdir).stored(model)})


def _compare_file(model: Path, mode: str, keep: list[str], feeds: dict[str, np.ndarray]) -> LayerComparison:
    with prepared_light(model) as prepared:
        unknown = sorted(set(keep) - {n.name for n in prepared.graph.node})
        if unknown:
            raise InputError(f"keep: no node named {unknown[:5]} in {model.name}")
        suffix = f" keeping {len(keep)} node(s)" if keep else ""
        return compare_layers(
            prepared, precisions_for(prepared, mode, keep), feeds, candidate=f"{mode} emulated{suffix}"
        )


def _compare_dump(model: Path, dump_dir: Path, om_json: Path | None, feeds: dict[str, np.ndarray]) -> LayerComparison:
    prepared = prepare(model)
    dump = read_dump(dump_dir, prepared, om_json)
    notes = [
        *dump.notes,
        f"compared with the first run of each op ({dump.repeats} later file(s) left out); "
        f"{dump.skipped} file(s) of ops ATC adds skipped; assumes the OM ran on this candidate's "
        f"first sample (precision/<candidate>/npu_inputs)",
    ]
    return compare_observed(
        prepared,
        dump.observed,
        feeds,
        reference="onnxruntime fp32",
        candidate=f"NPU dump {dump_dir}",
        backend="OM on an Ascend NPU (dumped there, read here)",
        notes=notes,
    )


def _compare_with_module(record: TaskRecord, workdir: Path, name: str, feeds: dict[str, np.ndarray]) -> LayerComparison:
    """The PyTorch submodules' outputs against the export as the exporter wrote it (the variants
    omskills optimises lose the exporter's module scopes)."""
    export = record.exports.get(name)
    if export is None:
        raise StageError(f"candidate {name!r} has no export: run export_onnx first")
    path = workdir / export.path
    contract = record.contract(name)
    loaded = open_model(record, workdir).loaded
    wrapper = ContractWrapper(loaded.root.get_submodule(contract.module_path), contract)
    prepared = prepare(path)
    observed, notes = module_observations(
        wrapper, [torch.from_numpy(feeds[s.name]) for s in contract.inputs], prepared, DEFAULT_BUDGET_BYTES
    )
    if not observed:
        raise StageError(
            f"{name}: no submodule output could be matched to a node of {path.name} "
            "(the exporter wrote no module scopes)"
        )
    comparison = compare_observed(
        prepared,
        observed,
        feeds,
        reference="onnxruntime fp32 (the export)",
        candidate=f"PyTorch module {contract.module_path}",
        backend="pytorch eager (CPU)",
        notes=notes,
    )
    return comparison.model_copy(update={"model": RunFolder(workdir).stored(path)})


def write_npu_inputs(folder: Path, contract: ContractSpec, feeds: dict[str, np.ndarray]) -> list[Path]:
    """The sample's inputs as raw .bin files in the graph's input order, as ais_bench reads them."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, spec in enumerate(contract.inputs):
        path = folder / f"input_{k}_{spec.name}.bin"
        np.ascontiguousarray(feeds[spec.name]).tofile(path)
        paths.append(path)
    return paths


def _om_file(record: TaskRecord, name: str) -> str:
    """The OM convert_atc's command writes (ATC adds `.om` to --output)."""
    atc = record.toolchain_of(name).atc
    output = next((a.split("=", 1)[1] for a in (atc.command if atc else []) if a.startswith("--output=")), None)
    return f"{output}.om" if output else f"<{name}>.om"


def npu_dump_command(om: str, inputs: list[Path]) -> str:
    return (
        f"msit benchmark --om-model {om} --input {','.join(str(p) for p in inputs)} "
        f"--output <dump_dir> --dump 1 --dump-npy 1"
    )
