"""Run one memory-hungry call in a fresh child process.

ONNX Runtime sessions and onnxslim passes over a 2 GB model take many GB that a long-lived
process (the MCP tool server) would keep; in a child, that memory goes back to the system when
it ends, and if the OOM killer takes the child, the caller gets `ChildDied` instead of dying.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from omskills import progress
from omskills.errors import OmskillsError
from omskills.stdio import stdout_to_stderr_for_good

# Models this big are probed and optimised in a child process.
ISOLATE_MIN_BYTES = 512 * 2**20
# How often the caller, waiting for its child, looks whether its call was cancelled.
_CANCEL_CHECK_SECONDS = 1.0
# In a child, blocks from this size up are mapped on their own (glibc's M_MMAP_THRESHOLD) and
# go back to the system when freed. Under glibc's default the threshold climbs to 32 MB as
# blocks are freed, so an ONNX Runtime run's activations (no arena) come from the heap, where
# the small tensors that outlive them keep it from being reused or shrunk: emulating a full-scale
# video model's 2 GB vision backbone took 12.6 GB that way and 4.4 GB with this threshold, in the same time.
CHILD_MMAP_THRESHOLD_BYTES = 1 << 20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)

T = TypeVar("T")


def model_bytes(path: Path) -> int:
    """Size of an ONNX model with its external weights (`<name>.data`)."""
    data = path.with_name(path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.is_file() else 0)


class ChildDied(OmskillsError):
    """The child process ended without an answer (killed, most likely out of memory)."""


def run_in_child(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a spawned process (fn and args must pickle); its stdout goes to stderr.

    A cancel of the calling tool (`progress.Cancelled`) ends the child within a second, rather
    than after it finished its work.
    """
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context, initializer=_start_child) as pool:
        try:
            future = pool.submit(fn, *args)
            while True:
                try:
                    return future.result(timeout=_CANCEL_CHECK_SECONDS)
                except concurrent.futures.TimeoutError:
                    progress.check_cancelled()
        except progress.Cancelled:
            _end_children(pool)
            raise
        except concurrent.futures.process.BrokenProcessPool as err:
            raise ChildDied(f"{err}; out of memory?") from err


def _start_child() -> None:
    stdout_to_stderr_for_good()
    map_large_blocks()


def map_large_blocks(threshold: int = CHILD_MMAP_THRESHOLD_BYTES) -> bool:
    """Make glibc map every block of `threshold` bytes or more on its own (see
    CHILD_MMAP_THRESHOLD_BYTES); False where the C library offers no `mallopt`."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))


def _libc():
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def _end_children(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    # The executor has no public way to stop a running call before Python 3.14's terminate_workers();
    # its worker processes are what we must end (the pool then shuts down as broken).
    for child in list((getattr(pool, "_processes", None) or {}).values()):
        child.terminate()


def return_freed_memory() -> None:
    """Collect garbage, then give freed heap pages back to the system (`trim_heap`).

    After a full-scale model is dropped the process still shows ~10 GB RSS: torch's and
    protobuf's big buffers came from the heap, and glibc only returns its top. A child process
    that needs that memory next (optimising the 2 GB backbone) would be OOM-killed.
    """
    import gc

    gc.collect()
    trim_heap()


def trim_heap() -> None:
    """Give the heap's free pages back to the system: glibc keeps them for reuse, and a heap that
    held a parsed 2 GB graph or a run's activations stays that big in RSS otherwise. Tens of
    milliseconds for a heap of GBs."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):  # glibc only; elsewhere nothing to do
        libc.malloc_trim(0)
