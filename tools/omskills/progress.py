"""Progress reporting and cooperative cancellation that the engine calls and the front end drives.

The engine calls `progress.report(...)`/`progress.track(...)` (and, in long loops without
reports, `progress.check_cancelled()`); the CLI shows tqdm bars on stderr; the MCP server
installs a reporter that sends progress notifications and a cancel flag that its clients set
(`notifications/cancelled`, `cancel_job`, a disconnect). Context variables keep concurrent
tool calls apart: each worker thread sees only its own reporter and flag.

Cancellation is cooperative: the next `report`/`track`/`check_cancelled` in the cancelled
call raises `Cancelled` in that call's thread. `Cancelled` is a BaseException (like
KeyboardInterrupt) so that the engine's `except Exception` blocks, which record a
candidate's failure and go on, do not swallow it; a running step is then marked failed,
never done, and a rerun redoes it.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")
Reporter = Callable[[float, float | None, str], None]

_reporter: contextvars.ContextVar[Reporter | None] = contextvars.ContextVar("omskills_reporter", default=None)
_cancel_flag: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar("omskills_cancel", default=None)


class Cancelled(BaseException):
    """The caller cancelled the work; raised inside the worker at its next progress point."""


@contextlib.contextmanager
def reporting_to(reporter: Reporter | None) -> Iterator[None]:
    token = _reporter.set(reporter)
    try:
        yield
    finally:
        _reporter.reset(token)


@contextlib.contextmanager
def cancellable(flag: threading.Event) -> Iterator[None]:
    """Within the block, `flag.set()` (from any thread) makes the next progress point raise `Cancelled`."""
    token = _cancel_flag.set(flag)
    try:
        yield
    finally:
        _cancel_flag.reset(token)


def check_cancelled() -> None:
    """Raise `Cancelled` if the current call was cancelled; call it in long loops that report nothing."""
    flag = _cancel_flag.get()
    if flag is not None and flag.is_set():
        raise Cancelled("cancelled by the client")


def report(done: float, total: float | None, message: str) -> None:
    check_cancelled()
    reporter = _reporter.get()
    if reporter is not None:
        reporter(done, total, message)


def track(items: Iterable[T], total: int | None, desc: str) -> Iterator[T]:
    """Iterate with a tqdm bar on stderr (CLI) and progress reports (MCP)."""
    bar = tqdm(items, total=total, desc=desc, file=sys.stderr, leave=False, disable=None, dynamic_ncols=True)
    for i, item in enumerate(bar):
        report(i, total, desc)
        yield item
    report(total or 0, total, f"{desc}: done")


# --------------------------------------------------------------------------- progress lines of the MCP server
# The MCP server words its progress messages here and the orchestrator reads them back here:
# one format in one place. Each message carries the elapsed time for clients that show only
# the message; the progress value itself is the elapsed time too.

_ELAPSED_SUFFIX = re.compile(r" \[\d+ s\]$")
_HEARTBEAT = re.compile(r"^\S+: running for \d+ s; last: ")


def phase_line(tool: str, phase: str, elapsed: float) -> str:
    """A new phase of a tool: "<tool>: <phase> [<elapsed> s]"."""
    return f"{tool}: {phase} [{elapsed:.0f} s]"


def heartbeat_line(tool: str, elapsed: float, last_phase: str) -> str:
    """A tool still at work with nothing new to say: "<tool>: running for <elapsed> s; last: <phase>"."""
    return f"{tool}: running for {elapsed:.0f} s; last: {last_phase}"


def is_heartbeat(message: str) -> bool:
    return _HEARTBEAT.match(message) is not None


def without_elapsed(message: str) -> str:
    """A phase line without its elapsed time (for a display that shows the elapsed time itself)."""
    return _ELAPSED_SUFFIX.sub("", message)
