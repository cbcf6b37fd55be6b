"""One registry style for drivers, runtime backends, comparators and tools."""

from __future__ import annotations

import pytest
from omskills.registry import Registry, RegistryError
from omskills.runtime import BACKENDS, OnnxRuntimeBackend


def test_entries_registered_by_reference_are_imported_on_first_use():
    registry: Registry[object] = Registry("thing")
    registry.register("join", "os.path:join")
    registry.register("direct", len)
    assert registry.names() == ["direct", "join"]
    import os.path

    assert registry.get("join") is os.path.join and registry.get("direct") is len
    assert [e.origin for e in registry.entries()] == ["registered in code", "registered in code"]


def test_an_unknown_name_lists_what_is_there():
    registry: Registry[object] = Registry("gadget")
    registry.register("a", len)
    with pytest.raises(RegistryError, match=r"no gadget named 'b'; installed: a"):
        registry.get("b")


def test_a_reference_that_does_not_import_says_which_part_is_wrong():
    registry: Registry[object] = Registry("thing")
    registry.register("bad", "os.path:no_such_function")
    with pytest.raises(RegistryError, match=r"thing 'bad': 'os.path' has no 'no_such_function'"):
        registry.get("bad")
    registry.register("worse", "no.such.module:X")
    with pytest.raises(RegistryError, match=r"cannot import 'no.such.module'"):
        registry.get("worse")


def test_runtime_backends_come_from_the_entry_point_group_like_drivers():
    entries = {e.name: e for e in BACKENDS.entries()}
    assert entries["onnxruntime"].origin == "entry point of omskills"
    assert BACKENDS.get("onnxruntime") is OnnxRuntimeBackend
