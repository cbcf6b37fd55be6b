"""Running the steps of a stage: the set-up every stage function opens (`StepStart`), status in
the task record, input fingerprint, resume, and the loop that runs a per-graph step on every graph
of the batch (`for_each_graph`).

A step that finished with the same inputs is skipped on a rerun, unless the record or the
disk says its result cannot be trusted: the results it wrote are missing from the record, or a
file it wrote is gone or changed (size and mtime first, then sha256). Either way a line on
stderr says why the step runs again. A step that raises is recorded as failed with its error
(the record stays valid) and the error propagates; one interrupted (Ctrl-C, SIGTERM, a cancel)
is recorded as failed, interrupted, with the command that redoes it.

Every write goes through `updating` (the record's lock held across load, change and save), and
a step's changes are closures applied to the record as it is at the end of the step, so
writers of other steps in the meantime keep their results.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import signal
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omskills import progress
from omskills.errors import Interrupted, OmskillsError, StageError, one_line
from omskills.records.results import CandidateBatch, CandidateFailure, ResultT
from omskills.records.stage_order import AdaptationStep
from omskills.records.stage_order import step as step_declared
from omskills.records.stages import Artifact, StageResult
from omskills.records.step_owner import interrupted_reason, no_owner, running_here, this_process
from omskills.records.task import TaskRecord, load_record, now_iso, updating
from omskills.run_folder import RunFolder
from pydantic import BaseModel

logger = logging.getLogger(__name__)


def fingerprint(*parts: Any) -> str:
    def default(obj: Any) -> Any:
        if isinstance(obj, BaseModel):
            return obj.model_dump(mode="json")
        if isinstance(obj, Path):
            return str(obj)
        raise TypeError(type(obj))

    text = json.dumps(parts, sort_keys=True, default=default)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def is_done(record: TaskRecord, step: str, inputs_hash: str, workdir: Path | None = None) -> bool:
    """The step finished with these inputs, its results are in the record and (given the run
    folder) the files it wrote are as it wrote them."""
    result = record.stages.get(step)
    if result is None or result.status != "done" or result.inputs_hash != inputs_hash:
        return False
    missing = record.missing_results(step)
    if missing:
        logger.warning("stage %s says done but its results are missing (%s); redoing it", step, "; ".join(missing))
        return False
    problems = changed_artifacts(result, workdir) if workdir is not None else []
    if problems:
        logger.warning("stage %s: %s; redoing it", step, "; ".join(problems))
        return False
    return True


def changed_artifacts(result: StageResult, workdir: Path) -> list[str]:
    return [problem for artifact in result.artifacts if (problem := artifact.problem(workdir))]


def require_intact(record: TaskRecord, workdir: Path, reads: Mapping[str, Collection[str] | None], tool: str) -> None:
    """The files earlier steps wrote and this step reads are as they were written; else stop
    before a result is reused or computed from them (the step that wrote them must run again).
    `reads` maps each earlier step to the files of it that this step reads (None: all it wrote):
    the study writes every graph's samples, and a step of one graph reads only its own."""
    for step, files in reads.items():
        result = record.stages.get(step)
        if result is None:
            continue
        problems = [
            problem
            for artifact in result.artifacts
            if (files is None or artifact.path in files) and (problem := artifact.problem(workdir))
        ]
        if problems:
            raise StageError(
                f"{'; '.join(problems)}: written by step {step}, which must run again "
                f"({tool}, or rerun `omskills adapt`)"
            )


def artifacts_of(paths: list[Path], workdir: Path) -> list[Artifact]:
    """The files a step wrote (those that exist), hashed, with paths relative to the run folder."""
    return [Artifact.of(path, workdir) for path in paths if path.is_file()]


class Step:
    """What a running step hands back: its result and the record changes to apply when it ends."""

    def __init__(self, result: StageResult):
        self.result = result
        self._updates: list[Callable[[TaskRecord], None]] = []

    def update(self, change: Callable[[TaskRecord], None]) -> None:
        self._updates.append(change)

    def apply(self, record: TaskRecord) -> None:
        for change in self._updates:
            change(record)


@contextlib.contextmanager
def running_step(task_path: Path, step: str, inputs_hash: str) -> Iterator[Step]:
    """Mark `step` running (owned by this process: `records.step_owner`); on success apply the
    step's record changes and mark it done in one locked, atomic save; on error, cancel or
    interrupt (SIGINT, and SIGTERM in a process that has no handler of its own) mark it failed with
    why (earlier results stay as they were). The step's changes are applied to the record as it is
    then, so other writers keep theirs. Steps left `running` by a process that is gone read as
    failed, interrupted, whoever loads the record (`load_record`)."""
    with running_here(task_path, step), _sigterm_interrupts():
        with updating(task_path) as record:
            record.stages[step] = StageResult(
                status="running", inputs_hash=inputs_hash, started=now_iso(), **this_process()
            )
            handle = Step(record.stages[step].model_copy())
        start = time.perf_counter()
        try:
            yield handle
        except BaseException as err:
            handle.result.status = "failed"
            handle.result.error = _why_stopped(err, step, task_path)
            _close(task_path, step, handle.result, start, None)
            raise
        if handle.result.status == "running":
            handle.result.status = "done"
        _close(task_path, step, handle.result, start, handle)


def _why_stopped(err: BaseException, step: str, task_path: Path) -> str:
    """The error a step that raised `err` records: an interrupt or a cancel says so, with the command
    that redoes the step."""
    if isinstance(err, Interrupted):
        how = f"by {err}"
    elif isinstance(err, KeyboardInterrupt):
        how = "by SIGINT (Ctrl-C)"
    elif isinstance(err, SystemExit) or type(err).__name__ == "Cancelled":
        how = f"cancelled ({type(err).__name__}{f': {err}' if str(err) else ''})"
    else:
        return f"{type(err).__name__}: {err}"[:2000]
    return interrupted_reason(step, task_path, how)


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises `Interrupted` in the step, as SIGINT raises KeyboardInterrupt, so a step
    stopped that way records why before the process ends. Only in the main thread (where Python
    runs signal handlers) and only where SIGTERM would otherwise end the process on the spot: a
    handler the process set (a job runner's cancel flag, a server's shutdown) is kept."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _raise_interrupted(signum: int, _frame: object) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM held back while the step's end is saved, so a second Ctrl-C cannot cut the
    save that records the first (they are delivered once it is written)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _close(task_path: Path, step: str, result: StageResult, start: float, handle: Step | None) -> None:
    result.seconds = round(time.perf_counter() - start, 3)
    for name, value in no_owner().items():  # they tell a live step from a dead one, and this one has ended
        setattr(result, name, value)
    with _signals_held(), updating(task_path) as record:
        if handle is not None:
            handle.apply(record)
        # Written after the results it summarises (and saved after them: `stages` ends the file).
        record.stages[step] = result


# -- the set-up every step shares -------------------------------------------------------------


@dataclass(frozen=True)
class StepStart:
    """A step about to run: the record as it is now, the run folder, and the step's key. A stage
    function opens one, returns the recorded result when `done`, and runs inside `running`."""

    task_path: Path
    key: str
    record: TaskRecord

    @classmethod
    def of(cls, task_path: Path, key: str) -> StepStart:
        return cls(Path(task_path), key, load_record(task_path))

    @property
    def workdir(self) -> Path:
        return TaskRecord.workdir(self.task_path)

    @property
    def run(self) -> RunFolder:
        return RunFolder(self.workdir)

    def done(self, inputs_hash: str) -> bool:
        """Finished with these inputs, its results and files intact (`is_done`): nothing to redo."""
        return is_done(self.record, self.key, inputs_hash, self.workdir)

    def require_intact(self, reads: Mapping[str, Collection[str] | None], tool: str) -> None:
        require_intact(self.record, self.workdir, reads, tool)

    def running(self, inputs_hash: str) -> contextlib.AbstractContextManager[Step]:
        return running_step(self.task_path, self.key, inputs_hash)


# -- the per-graph loop ------------------------------------------------------------------------


def for_each_graph(
    step_key: str,
    task_path: Path,
    candidate: str | None,
    batch: CandidateBatch[ResultT],
    run: Callable[[str], ResultT],
) -> CandidateBatch[ResultT]:
    """Run the per-graph step declared under `step_key` (`records.stage_order`) on each graph of
    the batch, or on the one candidate named. A graph that fails is handled as the declaration's
    `on_failure` says and the rest go on; a step that `needs_export` skips the graphs whose export
    failed (listed in `skipped` with why) rather than failing on each of them again.

    Asked for one candidate, its error is raised instead, so a caller sees the message.
    """
    declared = step_declared(step_key)
    record = load_record(task_path)
    names = record.graphs(candidate)
    done = 0
    while done < len(names):
        name = names[done]
        progress.report(done, len(names), f"{declared.tool}: {name}")
        blocked = _export_failed(record, name) if declared.needs_export and candidate is None else None
        if blocked is not None:
            batch.skipped[name] = blocked
            done += 1
            continue
        try:
            batch.results[name] = run(name)
        except OmskillsError as err:
            if candidate is not None:
                raise
            batch.failed.append(CandidateFailure(candidate=name, error=str(err)))
            names += _record_failure(task_path, name, declared, err)
        done += 1
    progress.report(done, len(names), f"{declared.tool}: done")
    return batch


def _export_failed(record: TaskRecord, name: str) -> str | None:
    """Why a graph has no export to work on, when its export step failed."""
    step = record.stages.get(step_declared("export").step_key(name))
    if name in record.exports or step is None or step.status != "failed":
        return None
    return f"its export failed ({one_line(step.error or 'failed', 300)})"


def _record_failure(task_path: Path, name: str, declared: AdaptationStep, err: Exception) -> list[str]:
    """Record a graph's failed step; returns the graphs promoted to take the step in its place."""
    tool = declared.tool
    with updating(task_path) as rec:
        if declared.on_failure == "advisory":
            rec.decide(tool, f"{name}: {tool} failed", str(err))
            return []
        rec.set_status(name, "failed", f"{tool}: {err}")
        promoted = (
            rec.promote_inside(rec.contract(name).plan_candidate) if declared.on_failure == "promote_inner" else []
        )
        for cand in promoted:
            rec.decide(tool, f"{cand}: selected", f"{name} failed ({err}); {cand} runs inside it")
        return [c.candidate for cand in promoted for c in rec.contracts_of(cand)]
