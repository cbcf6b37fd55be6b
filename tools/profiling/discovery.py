"""The profile that seed candidates are read from, for a model whose driver names none.

One pass of a model that runs in milliseconds is mostly one-off cost (kernel selection,
first allocations, lazy initialisation) and scheduler noise, so its shares are not the
model's: a 64x64 ResNet-18 showed layer2 at 1 % in one run and 17 % in the next. A first pass
shorter than COLD_PASS_LIMIT_SECONDS is therefore set aside, and the seeds come from warm
passes summed until they add up to MIN_TIMED_SECONDS (at least one, at most MAX_PASSES). A
model slower than that is profiled once: its first pass is the measurement.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch import nn

from omskills.profiling.profiler import ModuleProfiler
from omskills.records.profile import ProfileReport

MIN_TIMED_SECONDS = 1.0
# A first pass this short may be mostly one-off cost on a loaded machine; a second costs as little.
COLD_PASS_LIMIT_SECONDS = 10.0
MAX_PASSES = 100

Run = TypeVar("Run")


def discovery_profile(root: nn.Module, run_pass: Callable[[ModuleProfiler], Run]) -> tuple[ProfileReport, Run]:
    """Profile `run_pass` (one main-path pass that marks its steps on the profiler it is given);
    returns the profile to read seeds from and the first pass's result."""
    profiler = ModuleProfiler(root)
    with profiler:
        first = run_pass(profiler)
    if profiler.total_seconds >= COLD_PASS_LIMIT_SECONDS:
        return profiler.report(), first
    warm = ModuleProfiler(root)
    with warm:
        passes = 0
        while passes < MAX_PASSES and (passes == 0 or warm.total_seconds < MIN_TIMED_SECONDS):
            run_pass(warm)
            passes += 1
    return warm.report(notes=[f"{passes} warm passes after a first pass of {profiler.total_seconds * 1000:.0f} ms"]), first
