"""The profile that seed candidates are read from, for a model whose driver names none.

One pass of a model that runs in milliseconds is mostly one-off cost (kernel selection,
first allocations, lazy initialisation) and scheduler noise, so its shares are not the
model's: a 64x64 ResNet-18 showed layer2 at 1 % in one run and 17 % in the next. A first pass
shorter than COLD_PASS_LIMIT_SECONDS is therefore set aside and warm passes are profiled, each
on its own, at least MIN_WARM_PASSES of them and until they add up to MIN_TIMED_SECONDS (at
most MAX_PASSES). Each figure of the profile is the median over those passes: on a machine
another process loads, one pass in five can take a small head at 1.5 % or at 8 % of the
whole (a Faster R-CNN RPN head, 3.7 % when idle), while the median stayed within 3-8 %. A
model slower than COLD_PASS_LIMIT_SECONDS is profiled once: its first pass is the measurement.

Warm passes run on one intra-op thread. When other processes hold the cores, an operator split
over threads waits at its barrier for whichever thread the scheduler set aside, so whole
milliseconds land on whichever module was running: with two threads on two busy cores a
ResNet-18's layer3 measured 3 % of the model (20 % idle) and no median repaired it. On one
thread a lost time slice delays only the work in hand, and the median of the same passes kept
every layer within 13-31 %. Shares are what the seeds need; speed is measured elsewhere.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
from omskills.profiling.profiler import ModuleProfiler
from omskills.records.profile import ModuleProfile, ProfileReport
from torch import nn

MIN_TIMED_SECONDS = 1.0
MIN_WARM_PASSES = 5
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
    warm: list[ProfileReport] = []
    with one_intra_op_thread():
        while len(warm) < MAX_PASSES and (
            len(warm) < MIN_WARM_PASSES or sum(r.total_seconds for r in warm) < MIN_TIMED_SECONDS
        ):
            one = ModuleProfiler(root)
            with one:
                run_pass(one)
            warm.append(one.report())
    note = (
        f"median of {len(warm)} warm passes on one thread after a first pass of {profiler.total_seconds * 1000:.0f} ms"
    )
    return median_profile(warm, note), first


@contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """torch's operators on one thread inside the block; the process's setting again after it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def median_profile(passes: list[ProfileReport], note: str) -> ProfileReport:
    """One profile whose times and shares are each the median over `passes` (the same main path
    run again); a node a pass dropped as too small counts as zero there."""
    median = statistics.median
    by_path: dict[str, list[ModuleProfile]] = {}
    for report in passes:
        for node in report.nodes:
            by_path.setdefault(node.path, []).append(node)
    missing = [0.0] * len(passes)

    def med(nodes: list[ModuleProfile], field: str) -> float:
        return median([getattr(n, field) for n in nodes] + missing[len(nodes) :])

    nodes = [
        seen[0].model_copy(update={f: med(seen, f) for f in ("inclusive_s", "exclusive_s", "share", "exclusive_share")})
        for seen in by_path.values()
    ]
    first = passes[0]
    return first.model_copy(
        update={
            "total_seconds": median(r.total_seconds for r in passes),
            "module_seconds": median(r.module_seconds for r in passes),
            "nodes": nodes,
            "notes": [note],
        }
    )
