"""The memory each `omskills fleet` task asks Ray for, and why.

In order: what a previous run of it measured (its whole process tree), else twice its study's
measured peak, else `--memory-gb`, else what its driver says: a figure it declares for the scale
(`ModelDriver.adaptation_memory_gb`), or the model built in a fresh process and measured
(`driver_memory`, `profiling.memory_estimate.AdaptationMemory`), with a margin; else the scale's
default, when building the model failed.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

from omskills.profiling.memory_estimate import AdaptationMemory, adaptation_memory
from omskills.records.base import Record
from pydantic import BaseModel, Field

GB = 1e9
# Without a measurement or a model to build: what an adaptation of each scale may take (a tiny zoo
# model peaked at 1.5-2.7 GB of process tree; a full-scale one at about 10 GB).
SCALE_MEMORY_GB = {"tiny": 3.0, "full": 12.0}
MEASURED_MARGIN = 1.25  # over a previous run's measured peak: inputs and load differ between runs
# The study's peak is one process's; the adaptation runs the model again beside ONNX Runtime in its
# tools' processes (export, probe, verify): twice that, as a rule of thumb.
STUDY_FACTOR = 2.0
# Over the estimate from the built model, for what it leaves out (the main path's activations, the
# exporter's and ONNX Runtime's working memory): the 26 zoo models' measured tree peaks were 1.03x
# to 1.76x their estimates (benchmarks/RESULTS.md, the zoo through `omskills fleet`).
ESTIMATE_MARGIN = 1.8
PEAK_FILE = "peak-{number}.json"  # in a run folder's fleet folder: one attempt's measured tree peak
# What the tool server has imported when it holds the model beside ONNX Runtime (verify, a probe).
SERVER_MODULES = (
    "omskills.host.mcp_server",
    "omskills.stages.study",
    "omskills.stages.toolchain",
    "omskills.stages.verify",
)


class DriverMemory(Record):
    """The memory a record's driver gives for its adaptation: a figure it declares, or its model measured."""

    family: str = Field(description="The driver's family.")
    scale: str = Field(description="The scale asked.")
    declared_gb: float | None = Field(None, description="The driver's adaptation_memory_gb at that scale.")
    estimate: AdaptationMemory | None = Field(None, description="The model built and measured (none when declared).")


class MemoryRequest(BaseModel):
    gb: float = Field(description="What the task asks Ray for, GB.")
    why: str = Field(description="Where that figure comes from, in words.")
    estimate: AdaptationMemory | None = Field(
        None, description="The driver's model measured, when the figure is from it."
    )


def measured_request(run: Path, unmeasured_gb: float | None = None) -> MemoryRequest | None:
    """What the run folder's measurements (or `unmeasured_gb`, the user's figure) say to ask for;
    None: nothing measured nor given, the driver is to be asked (`driver_request`)."""
    peaks = [json.loads(p.read_text()) for p in sorted((run / "fleet").glob(PEAK_FILE.format(number="*")))]
    # An attempt that failed early measured only a part of the run: a peak counts once one finished
    # (files without an exit code predate the field and count).
    if any(p.get("exit_code", 0) == 0 and p["peak_tree_gb"] for p in peaks):
        peak = max(p["peak_tree_gb"] for p in peaks)
        return MemoryRequest(gb=round(peak * MEASURED_MARGIN, 2), why=f"measured peak {peak:.2f} GB of a previous run")
    study = _study_peak_gb(run)
    if study:
        return MemoryRequest(gb=round(study * STUDY_FACTOR, 2), why=f"twice the study's measured peak ({study:.2f} GB)")
    if unmeasured_gb:
        return MemoryRequest(gb=unmeasured_gb, why="--memory-gb")
    return None


def _study_peak_gb(run: Path) -> float | None:
    task = run / "task.yaml"
    if not task.is_file():
        return None
    from omskills.records.main_path import MainPathReport
    from omskills.records.task import load_record

    study = load_record(task).study
    report = run / study.main_path_json if study else None
    if report is None or not report.is_file():
        return None
    return MainPathReport.model_validate_json(report.read_text()).peak_rss_mb / 1024


def driver_request(record: Path, scale: str | None) -> MemoryRequest:
    """The driver's figure for the record at `scale`, found in a fresh child (the model's imports and
    weights go with it); the scale's default, saying why, when the driver fails to build the model."""
    from omskills.errors import one_line
    from omskills.isolation import run_in_child

    try:
        given = run_in_child(driver_memory, record, scale)
    except Exception as err:  # noqa: BLE001 - the driver's code may raise anything; the adaptation will say it again
        chosen = scale or _record_scale(record)
        why = f"default for scale {chosen} (no estimate: {one_line(err, 200)})"
        return MemoryRequest(gb=SCALE_MEMORY_GB[chosen], why=why)
    if given.declared_gb:
        return MemoryRequest(gb=given.declared_gb, why=f"the {given.family} driver's estimate for scale {given.scale}")
    estimate = given.estimate
    assert estimate is not None  # a driver that declares nothing is measured
    gb = round(estimate.need_bytes * ESTIMATE_MARGIN / GB, 2)
    why = f"the {given.family} model measured: {described(estimate)}, x{ESTIMATE_MARGIN} for what that leaves out"
    return MemoryRequest(gb=gb, why=why, estimate=estimate)


def described(estimate: AdaptationMemory) -> str:
    """The estimate in Ray's GB (1e9 bytes, as the request)."""
    parts = [
        f"client {estimate.imports_bytes / GB:.2f}",
        f"server with the model {estimate.loaded_bytes / GB:.2f}",
        f"ONNX Runtime sessions {estimate.sessions_bytes / GB:.2f}",
    ]
    return f"{estimate.need_bytes / GB:.2f} GB predicted at scale {estimate.scale} ({' + '.join(parts)} GB)"


def _record_scale(record: Path) -> str:
    from omskills.records.task import load_record

    return load_record(record).intake.model.scale


# --------------------------------------------------------------------------- in the fresh child


def driver_memory(record: Path, scale: str | None = None) -> DriverMemory:
    """The driver's declared figure for the record at `scale` (the record's own when None), else its
    model built as the adaptation builds it and measured. Run in a fresh process (the RSS it reads
    is the process's): `driver_request`."""
    import importlib

    from omskills.models.api import driver_checks
    from omskills.models.registry import driver_for, resolved_spec

    with _quiet():  # a model's import and build may print or warn: the fleet's stderr is its progress
        spec, base = _model_spec(record, scale)
        driver = driver_for(spec, base)
        declared = driver.adaptation_memory_gb.get(spec.scale)
        if declared:
            return DriverMemory(family=driver.family, scale=spec.scale, declared_gb=declared)
        client = _rss_bytes()  # what `adapt` holds: it imports the driver to check the record
        for module in SERVER_MODULES:
            importlib.import_module(module)
        with driver_checks(driver, "load"):
            loaded = driver.load(resolved_spec(spec, base))
        tensors = [*loaded.root.parameters(), *loaded.root.buffers()]
        weights = sum(t.numel() * t.element_size() for t in tensors)
        estimate = adaptation_memory(spec.scale, client, _peak_rss_bytes(), weights)
        return DriverMemory(family=driver.family, scale=spec.scale, estimate=estimate)


def _model_spec(record: Path, scale: str | None):
    """The record's model as `omskills adapt` overrides it (the scale asked, the driver's source
    variable), and the folder its relative paths start from."""
    from omskills.models.registry import driver_for
    from omskills.records.task import load_record

    spec = load_record(record).intake.model
    base = record.resolve().parent
    source_env = driver_for(spec, base).source_env
    update = {"scale": scale} if scale else {}
    if source_env and os.environ.get(source_env):
        update["source"] = os.environ[source_env]
    return spec.model_copy(update=update), base


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """File descriptors 1 and 2 to /dev/null, warnings off; all restored after."""
    saved = [os.dup(fd) for fd in (1, 2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            os.dup2(null, fd)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        sys.stdout.flush()  # what the model printed goes to /dev/null too
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        os.close(null)
