"""Children for memory-hungry calls: what they hold goes back to the system."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest
from omskills.isolation import CHILD_MMAP_THRESHOLD_BYTES, run_in_child

MIB = 1 << 20


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def mapped_blocks_after_a_freed_large_block() -> int:
    """How many blocks glibc maps on their own for a 2 MiB allocation made after a 16 MiB one was
    freed (by default that free raises glibc's threshold, and the 2 MiB block comes from the heap)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = _MallInfo2
    libc.free(libc.malloc(16 * MIB))
    before = libc.mallinfo2().hblks
    block = libc.malloc(2 * MIB)
    mapped = libc.mallinfo2().hblks - before
    libc.free(block)
    return mapped


@pytest.mark.skipif(not hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "mallinfo2"), reason="needs glibc >= 2.33")
def test_a_child_maps_large_blocks_on_their_own_so_freeing_them_returns_the_memory():
    assert CHILD_MMAP_THRESHOLD_BYTES <= 2 * MIB
    assert run_in_child(mapped_blocks_after_a_freed_large_block) == 1
    assert mapped_blocks_after_a_freed_large_block() == 0  # this process keeps glibc's default: from the heap
