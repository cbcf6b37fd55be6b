"""One loaded model per process, reused across tools (the MCP server keeps it between calls).

Loading a full-scale model takes tens of seconds and several GB; the stages of one
adaptation all use the same model, so it is built once per model spec (driver, source,
builder, scale, checkpoint, seed, device). Only one model is kept, to bound memory.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from omskills.contracts.pytree import register_struct
from omskills.isolation import return_freed_memory
from omskills.models.api import LoadedModel, ModelDriver, driver_checks
from omskills.models.registry import driver_for, resolved_spec
from omskills.models.weights import load_labelled
from omskills.records.intake import ModelSpec

_lock = threading.Lock()
_cached: tuple[str, LoadedModel, float] | None = None


def load_model(spec: ModelSpec, base_dir: Path | None = None) -> tuple[ModelDriver, LoadedModel, float]:
    """The driver, the loaded model and the seconds its (first) build took; `base_dir` is the task
    record's folder (a driver named by a relative path is found from there)."""
    global _cached
    spec = resolved_spec(spec, base_dir)
    driver = driver_for(spec, base_dir)
    key = f"{id(driver)}:{base_dir}:{spec.model_dump_json()}"  # base_dir: the weights label names files from it
    with _lock:
        if _cached is not None and _cached[0] == key:
            return driver, _cached[1], _cached[2]
        _cached = None  # free the previous model before building the next
        start = time.perf_counter()
        with driver_checks(driver, "load"):
            loaded = load_labelled(driver, spec, base_dir)
        for cls in driver.pytree_types(loaded):
            register_struct(cls)
        _cached = (key, loaded, time.perf_counter() - start)
        return driver, loaded, _cached[2]


def release() -> None:
    """Drop the cached model (stages that do not need it, like optimising a 2 GB ONNX, want the RAM)."""
    global _cached
    with _lock:
        _cached = None
    return_freed_memory()
