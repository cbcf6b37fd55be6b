"""Who runs a step: the process that marked it `running`, and whether it still does.

A step marked `running` records its process: pid, that process's start time and the host name.
Whether the step still runs is decided here, in one place, for every reader of the record (the
record's loader asks `settle_interrupted`): a step whose process is gone reads as failed,
interrupted, with the command that redoes it, never as running. The start time guards against a
pid the system gave to a later process; a step run on another host (a run folder on a shared disk)
is not judged, as its process cannot be seen from here.

Inside one process (the MCP server runs steps in worker threads) the pid is the same for every
step, so the steps this process is running now are kept in a set (`running_here`): a step with
this process's pid that is not in it was lost (a thread cut off, a full disk on the final save).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path

import psutil
from omskills.records.stage_order import rerun_command
from omskills.records.stages import StageResult

HOST = socket.gethostname()
# Two readings of one process's start time agree unless the wall clock was stepped in between (it is
# counted from the boot time, which moves with the clock): slack for that. A later process given the
# same pid starts long after (the pid must have gone round every other pid first).
START_TOLERANCE_S = 1.0

# (resolved record path, step) of the steps this process is running now.
_ACTIVE: set[tuple[str, str]] = set()


def process_started(pid: int) -> float | None:
    """When the process `pid` started (seconds since the epoch); None when there is no such live process."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:  # ended, not yet reaped: it runs nothing
            return None
        return proc.create_time()
    except psutil.NoSuchProcess:
        return None
    except psutil.AccessDenied:  # another user's live process: alive, start time unknown
        return 0.0


def this_process() -> dict[str, object]:
    """The fields of a `StageResult` that name this process as the step's owner."""
    return {"pid": os.getpid(), "pid_started": process_started(os.getpid()), "host": HOST}


def no_owner() -> dict[str, object]:
    """The owner fields of a step that has ended."""
    return {"pid": None, "pid_started": None, "host": None}


def key(record_path: str | Path, step: str) -> tuple[str, str]:
    return (str(Path(record_path).resolve()), step)


@contextlib.contextmanager
def running_here(record_path: str | Path, step: str) -> Iterator[None]:
    """While the body runs, this process runs `step` of the record at `record_path`."""
    entry = key(record_path, step)
    _ACTIVE.add(entry)
    try:
        yield
    finally:
        _ACTIVE.discard(entry)


def active_steps() -> list[tuple[str, str]]:
    """(resolved record path, step) of the steps this process is running now."""
    return sorted(_ACTIVE)


def owner_gone(result: StageResult, record_path: str | Path, step: str) -> bool:
    """A `running` step whose process is provably not running it: gone, a later process with its
    pid, or this process not running it. False when it may still run (or runs on another host)."""
    if result.status != "running":
        return False
    if result.pid is None:  # written by an omskills that recorded no pid: nothing can be running it
        return True
    if result.host is not None and result.host != HOST:
        return False
    started = process_started(result.pid)
    if started is None:
        return True
    if result.pid_started is not None and started and abs(started - result.pid_started) > START_TOLERANCE_S:
        return True  # the pid now belongs to a later process
    return result.pid == os.getpid() and key(record_path, step) not in _ACTIVE


def interrupted_reason(step: str, task: str | Path, how: str) -> str:
    """The error a step interrupted `how` records: says so, and the command that redoes it."""
    return f"interrupted: {how}; rerun {_rerun(step, task)} to redo it"


def _rerun(step: str, task: str | Path) -> str:
    command = rerun_command(step, str(task))
    return f"`{command}` (or `omskills adapt`)" if command else "its tool (or `omskills adapt`)"


def settle_interrupted(stages: Mapping[str, StageResult], record_path: str | Path) -> list[str]:
    """The `running` steps whose process is gone marked failed, interrupted, with the command that
    redoes each; their names."""
    settled = []
    for step, result in stages.items():
        if not owner_gone(result, record_path, step):
            continue
        owner = f"pid {result.pid}" if result.pid is not None else "an earlier omskills"
        how = f"the process that ran it ({owner}) stopped before it finished (killed, cancelled, or out of disk)"
        result.status, result.error = "failed", interrupted_reason(step, record_path, how)
        result.pid, result.pid_started, result.host = None, None, None
        settled.append(step)
    return settled
