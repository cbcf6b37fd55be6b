"""Ascend precision before an NPU (stage 3): every precision mode emulated on the preferred
variant of each candidate, the keep lists proposed, and the mode ATC is to convert with."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from omskills.ascend.emulation import compare_layers, precisions_for, prepare
from omskills.ascend.precision_fix import precision_report
from omskills.ascend.precision_modes import DEFAULT_MODES, EMULATED_MODES
from omskills.convert.optimize import sample_arrays
from omskills.errors import InputError, OmskillsError, StageError
from omskills.isolation import run_isolated_if_big
from omskills.models import cache as model_cache
from omskills.records.precision import LayerComparison, PrecisionReport
from omskills.records.task import TaskRecord, load_record
from omskills.records.toolchain import BatchSplit
from omskills.stages.steps import fingerprint, is_done, running_step


def _checked_modes(modes: list[str] | None) -> list[str]:
    chosen = list(modes or DEFAULT_MODES)
    unknown = [m for m in chosen if m not in EMULATED_MODES]
    if unknown:
        raise InputError(f"modes: {unknown} are not emulated; choose from {sorted(EMULATED_MODES)}")
    return chosen


def _first_feeds(record: TaskRecord, workdir: Path, name: str) -> tuple[dict[str, np.ndarray], str]:
    """The first captured sample's inputs, cut to the batch ONNX Runtime can hold here."""
    samples = record.contract(name).samples
    if not samples:
        raise StageError(f"candidate {name!r} has no captured samples")
    feeds, _ = sample_arrays(workdir / samples[0])
    return _first_chunk(feeds, record.batch_split_of(name)), samples[0]


def _first_chunk(feeds: dict[str, np.ndarray], split: BatchSplit | None) -> dict[str, np.ndarray]:
    if split is None:
        return feeds
    return {k: (np.take(v, range(min(split.max_batch, v.shape[axis])), axis=axis) if (axis := split.input_axes.get(k)) is not None else v)
            for k, v in feeds.items()}


def emulate_candidate(task_path: Path, name: str, modes: list[str] | None = None) -> PrecisionReport:
    record = load_record(task_path)
    workdir = TaskRecord.workdir(task_path)
    chosen = _checked_modes(modes)
    model = record.preferred_model(workdir, name)
    inputs_hash = fingerprint(record.exports[name].sha256, str(model.relative_to(workdir)), chosen,
                              record.contract(name).samples[:1])
    step = f"precision:{name}"
    existing = record.toolchain_of(name).precision
    if is_done(record, step, inputs_hash) and existing is not None:
        return existing
    feeds, sample = _first_feeds(record, workdir, name)
    model_cache.release()  # emulation needs no PyTorch model
    with running_step(task_path, step, inputs_hash) as handle:
        try:
            report = run_isolated_if_big(model, precision_report, model, feeds, sample, chosen)
        except OmskillsError:
            raise
        except Exception as exc:  # onnx / ONNX Runtime raise their own types
            raise StageError(f"{name}: precision emulation failed: {type(exc).__name__}: {exc}") from exc
        report = report.model_copy(update={"model": str(model.relative_to(workdir))})

        def store(rec: TaskRecord) -> None:
            rec.chain(name).precision = report
            table = "; ".join(f"{m.mode} {'pass' if m.result.passed else 'fail'} (cos {m.result.cosine:.5f}"
                              f"{f', keep {len(m.keep)}' if m.keep else ''})" for m in report.modes)
            rec.decide("emulate_precision", f"{name}: convert with {report.chosen_mode}", f"{report.why}; emulated on CPU: {table}")

        handle.update(store)
    return report


def compare_candidate_layers(task_path: Path, name: str, mode: str = "force_fp16", keep: list[str] | None = None) -> LayerComparison:
    """fp32 against `mode` emulated (with `keep` kept), node by node, on the first sample."""
    record = load_record(task_path)
    workdir = TaskRecord.workdir(task_path)
    _checked_modes([mode])
    model = record.preferred_model(workdir, name)
    feeds, _ = _first_feeds(record, workdir, name)
    model_cache.release()
    comparison = run_isolated_if_big(model, _compare_file, model, mode, list(keep or []), feeds)
    return comparison.model_copy(update={"model": str(model.relative_to(workdir))})


def _compare_file(model: Path, mode: str, keep: list[str], feeds: dict[str, np.ndarray]) -> LayerComparison:
    prepared = prepare(model)
    unknown = sorted(set(keep) - {n.name for n in prepared.graph.node})
    if unknown:
        raise InputError(f"keep: no node named {unknown[:5]} in {model.name}")
    suffix = f" keeping {len(keep)} node(s)" if keep else ""
    return compare_layers(prepared, precisions_for(prepared, mode, keep), feeds, candidate=f"{mode} emulated{suffix}")

