"""Running one step of a stage: status in the task record, input fingerprint, resume.

A step that finished with the same inputs is skipped on a rerun. A step that raises is
recorded as failed with its error (the record stays valid) and the error propagates.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from omskills.records.stages import StageResult
from omskills.records.task import TaskRecord, load_record, now_iso, save_record
from pydantic import BaseModel


def fingerprint(*parts: Any) -> str:
    def default(obj: Any) -> Any:
        if isinstance(obj, BaseModel):
            return obj.model_dump(mode="json")
        if isinstance(obj, Path):
            return str(obj)
        raise TypeError(type(obj))

    text = json.dumps(parts, sort_keys=True, default=default)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def is_done(record: TaskRecord, step: str, inputs_hash: str) -> bool:
    result = record.stages.get(step)
    return result is not None and result.status == "done" and result.inputs_hash == inputs_hash


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
    """Mark `step` running; on success apply the step's record changes and mark it done in one
    atomic save; on error mark it failed with the error (earlier results stay as they were)."""
    record = load_record(task_path)
    record.stages[step] = StageResult(status="running", inputs_hash=inputs_hash, started=now_iso())
    save_record(record, task_path)
    handle = Step(record.stages[step].model_copy())
    start = time.perf_counter()
    try:
        yield handle
    except BaseException as err:
        record = load_record(task_path)
        handle.result.status = "failed"
        handle.result.error = f"{type(err).__name__}: {err}"[:2000]
        _close(task_path, record, step, handle.result, start)
        raise
    record = load_record(task_path)
    handle.apply(record)
    if handle.result.status == "running":
        handle.result.status = "done"
    _close(task_path, record, step, handle.result, start)


def _close(task_path: Path, record: TaskRecord, step: str, result: StageResult, start: float) -> None:
    result.finished = now_iso()
    result.seconds = round(time.perf_counter() - start, 3)
    record.stages[step] = result
    save_record(record, task_path)
