"""Keeping stdout clean: it may be the MCP stdio transport or a tool's JSON result.

`stdout_to_stderr()` sends both Python-level and file-descriptor-level writes (C libraries,
child processes) to stderr for the duration of a block; `stdout_to_stderr_for_good()` does it
for the rest of a process (a spawned child inherits the parent's stdout).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Not thread-safe: fd 1 is the process's. Used around library calls that print."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def stdout_to_stderr_for_good() -> None:
    os.dup2(2, 1)
    sys.stdout = sys.stderr
