"""Progress reporting that the engine calls and the front end decides how to show.

The engine calls `progress.step(...)`/`progress.track(...)`; the CLI shows tqdm bars on
stderr; the MCP server installs a reporter that sends progress notifications. A context
variable keeps concurrent tool calls apart.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from typing import Callable, Iterable, Iterator, TypeVar

from tqdm import tqdm

T = TypeVar("T")
Reporter = Callable[[float, float | None, str], None]

_reporter: contextvars.ContextVar[Reporter | None] = contextvars.ContextVar("omskills_reporter", default=None)


@contextlib.contextmanager
def reporting_to(reporter: Reporter | None) -> Iterator[None]:
    token = _reporter.set(reporter)
    try:
        yield
    finally:
        _reporter.reset(token)


def report(done: float, total: float | None, message: str) -> None:
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
