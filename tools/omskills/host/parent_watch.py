"""The MCP server ends with the process that started it, and takes its own children along.

A stdio server whose client is gone has no one to answer, yet a tool it is running would go on
exporting and writing the task record for minutes: a second writer beside the rerun the user
starts. Three ways the parent's death reaches us:

- Linux's parent-death signal (`prctl(PR_SET_PDEATHSIG, SIGTERM)`): the kernel signals us the
  moment the parent exits, however it died (`kill -9` included);
- a watcher thread that polls the parent pid (other systems, or a parent that double-forked);
- stdin closing (the SDK's stdio transport ends its loop; `serve` then shuts down the same way).

Shutting down records the steps in progress as interrupted, cancels the running jobs, ends every
descendant process (isolated ONNX Runtime children, ATC) and exits without waiting for worker
threads: record saves are atomic, so a job cut off mid-step leaves the record as it was before
that step's save, with the step marked interrupted.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

import psutil

PR_SET_PDEATHSIG = 1
# Set by omskills' own client (omskills.orchestrator.mcp_client) to its pid when it starts a server.
PARENT_PID_ENV = "OMSKILLS_PARENT_PID"
# How often the fallback watcher looks at the parent pid.
POLL_SECONDS = 1.0
# How long descendants get after SIGTERM before SIGKILL.
CHILD_GRACE_SECONDS = 1.0


def end_descendants(grace: float = CHILD_GRACE_SECONDS) -> None:
    """SIGTERM every descendant process, then SIGKILL those still alive after `grace` seconds."""
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        try:
            child.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(children, timeout=grace)
    for child in alive:
        try:
            child.kill()
        except psutil.Error:
            pass


def _set_parent_death_signal(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def exit_with_parent(before_exit: Callable[[str], object] | None = None) -> None:
    """From now on, end this process (and its descendants) when its parent dies.

    `before_exit(why)` runs first (the server records its steps interrupted and cancels its jobs
    there); it must be quick.
    """
    parent = os.getppid()
    # The client may name itself: if it is not our parent any more, it died before we got here.
    expected = os.environ.get(PARENT_PID_ENV, "")
    gone_already = expected.isdigit() and int(expected) != parent

    def shut_down(reason: str) -> None:
        # Straight to fd 2: this may run in a signal handler, where the logging lock may be held.
        os.write(2, f"omskills serve: {reason}: shutting down\n".encode())
        try:
            if before_exit is not None:
                before_exit(reason)
        finally:
            end_descendants()
            # Not sys.exit: worker threads may be deep in a tool, and nothing waits for them.
            os._exit(0)

    def on_term(signum: int, _frame: FrameType | None) -> None:
        shut_down(f"signal {signal.Signals(signum).name}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_term)
        _set_parent_death_signal(signal.SIGTERM)

    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(POLL_SECONDS):
            if os.getppid() != parent:
                shut_down(f"parent process {parent} is gone")

    threading.Thread(target=watch, name="omskills parent watch", daemon=True).start()
    # The parent may have died before the signal was armed.
    if gone_already or os.getppid() != parent:
        shut_down(f"parent process {expected or parent} is gone")
