"""Where the spliced pipeline's time goes, next to eager PyTorch, measured in one process.

    .venv/bin/python benchmarks/splice_overhead.py RUN/task.yaml [--repeats 7] [--calls 5]

RUN is an adaptation's run folder (`omskills adapt ... --out RUN`) whose graphs were probed. The
model and the graphs' sessions are opened once, as verify_main_path opens them, in two variants:
`spliced` (as verify runs it) and `fused-attention` (the same with the ONNX Runtime backend's
opt-in `fuse_attention=True`). Then:

- per step: the main path runs eager and in each variant, in turn (rotating which goes first),
  `--repeats` times each; printed: the median seconds per step and the ratio to eager, and the
  median CPU seconds of the whole run (setup and steps) with its ratio.
- per call: the first call each spliced module answered is kept; the candidate's original PyTorch
  module and each variant's spliced module are called on a fresh copy of it in turn, `--calls`
  times each; printed: the median ms per call and the ratio to eager.

The machine may be shared: everything alternates so that each variant sees the same load; compare
the ratios rather than the seconds, and the CPU-time ratio when the wall times scatter.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import statistics
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from omskills.contracts.pytree import flatten_call
from omskills.records.task import TaskRecord, load_record
from omskills.runtime import open_backend, serving
from omskills.splicing.splice import SplicedModule, splice
from omskills.stages.model import open_model
from omskills.stages.spliced_runs import open_spliced, spliceable


def _step_seconds(run: Any) -> float:
    return sum(step.seconds for step in run.steps) / max(len(run.steps), 1)


def _median_ms(timings: list[float]) -> float:
    return 1000 * statistics.median(timings)


class FirstCalls:
    """Keeps the first call's arguments of each spliced module (for timing it alone later)."""

    def __init__(self, modules: dict[str, SplicedModule]) -> None:
        self.calls: dict[str, tuple[SplicedModule, tuple, dict]] = {}
        self._wrapped: list[tuple[SplicedModule, Any]] = []
        for _name, module in modules.items():
            if module in [m for m, _ in self._wrapped]:
                continue
            inner = module._contract_call
            self._wrapped.append((module, inner))

            def keep(*args: Any, _module=module, _inner=inner, **kwargs: Any) -> Any:
                for route in _module.routes:
                    if (
                        route.contract.candidate not in self.calls
                        and route.violation(flatten_call(args, kwargs)) is None
                    ):
                        # A copy: the model may change the tensors and lists it passed after the call.
                        self.calls[route.contract.candidate] = (_module, copy.deepcopy(args), copy.deepcopy(kwargs))
                return _inner(*args, **kwargs)

            object.__setattr__(module, "_contract_call", keep)
            if module.method != "forward":
                object.__setattr__(module, module.method, keep)

    def restore(self) -> None:
        for module, inner in self._wrapped:
            del module.__dict__["_contract_call"]  # the class's method again
            if module.method != "forward":
                object.__setattr__(module, module.method, inner)


def time_calls(name: str, args: tuple, kwargs: dict, modules: dict[str, dict[str, SplicedModule]], calls: int) -> None:
    """The candidate's original module and each variant's spliced module on one call, alternately."""
    first = next(iter(modules.values()))[name]
    targets = {"eager": first._original_call()}
    for variant, by_name in modules.items():
        module = by_name[name]
        targets[variant] = getattr(module, module.method) if module.method != "forward" else module
    timings: dict[str, list[float]] = {label: [] for label in targets}
    with torch.inference_mode():
        for _ in range(calls):
            for label, target in targets.items():
                # A fresh copy per call: a module may change the lists it is given.
                call_args, call_kwargs = copy.deepcopy(args), copy.deepcopy(kwargs)
                started = time.perf_counter()
                target(*call_args, **call_kwargs)
                timings[label].append(time.perf_counter() - started)
    eager = _median_ms(timings["eager"])
    parts = [
        f"{label} {_median_ms(t):8.1f} ({_median_ms(t) / eager:4.2f})"
        for label, t in timings.items()
        if label != "eager"
    ]
    print(f"  {name:38s} eager {eager:8.1f}  " + "  ".join(parts))


def _open_all(record: TaskRecord, workdir: Path, names: list[str], fuse: bool) -> list[tuple[Any, Any]]:
    """Each graph's backend as verify opens it; `fuse`: with attention fused (an opt-in of the
    ONNX Runtime backend that verify does not take today)."""
    opener = functools.partial(open_backend, fuse_attention=True) if fuse else open_backend
    with mock.patch.object(serving, "open_backend", opener):
        return [(record.contracts[n], open_spliced(record, workdir, n, "onnxruntime")) for n in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", type=Path)
    parser.add_argument("--repeats", type=int, default=5, help="main-path runs per variant")
    parser.add_argument("--calls", type=int, default=5, help="calls per candidate and variant")
    parser.add_argument("--skip-steps", action="store_true", help="per-call figures only")
    args = parser.parse_args()
    record = load_record(args.task)
    workdir = TaskRecord.workdir(args.task)
    names, _ = spliceable(record)
    model = open_model(record, workdir)
    strategies = {n: record.boundaries[n].shape_strategy for n in names if record.boundaries[n].shape_strategy}
    variants = {
        "spliced": _open_all(record, workdir, names, fuse=False),
        "fused-attention": _open_all(record, workdir, names, fuse=True),
    }
    fused = {
        n: getattr(getattr(b, "backend", b), "fused_attention_blocks", 0)
        for n, (_, b) in zip(names, variants["fused-attention"])
    }
    print(f"{len(names)} graphs (attention blocks fused): {', '.join(f'{n} ({fused[n]})' for n in names)}")
    print(
        "variants: spliced = as verify runs it; fused-attention = the same with OnnxRuntimeBackend(fuse_attention=True)"
    )

    # Warm-up: one run each (first session runs and the first eager run pay one-off costs);
    # the spliced one keeps each candidate's first call for the per-call figures.
    model.run()
    modules: dict[str, dict[str, SplicedModule]] = {}
    for variant, replacements in variants.items():
        with splice(model.loaded.root, replacements, strategies=strategies) as handle:
            modules[variant] = handle.modules
            if variant == "spliced":
                keeper = FirstCalls(handle.modules)
                model.run()
                keeper.restore()
            else:
                model.run()

    if not args.skip_steps:
        seconds: dict[str, list[float]] = {"eager": [], **{v: [] for v in variants}}
        cpu: dict[str, list[float]] = {label: [] for label in seconds}
        for repeat in range(args.repeats):
            order = list(seconds)
            order = order[repeat % len(order) :] + order[: repeat % len(order)]  # rotate: each goes first in turn
            for label in order:
                with contextlib.ExitStack() as stack:
                    if label != "eager":
                        stack.enter_context(splice(model.loaded.root, variants[label], strategies=strategies))
                    started = time.process_time()
                    run = model.run()
                    cpu[label].append(time.process_time() - started)
                seconds[label].append(_step_seconds(run))
        eager = statistics.median(seconds["eager"])
        print(
            f"per step, s (median of {args.repeats}): eager {eager:.3f}  "
            + "  ".join(
                f"{v} {statistics.median(seconds[v]):.3f} (ratio {statistics.median(seconds[v]) / eager:.3f})"
                for v in variants
            )
        )
        # CPU seconds of the whole run (setup and steps) by this process: less sensitive to other
        # processes on a shared machine than wall time.
        print(
            "whole run, CPU s (median): "
            + "  ".join(
                f"{label} {statistics.median(v):.2f}"
                + ("" if label == "eager" else f" (ratio {statistics.median(v) / statistics.median(cpu['eager']):.3f})")
                for label, v in cpu.items()
            )
        )
        for label, values in seconds.items():
            ratios = (
                "" if label == "eager" else f"  ratios {[round(b / a, 3) for a, b in zip(seconds['eager'], values)]}"
            )
            print(f"  {label:20s} {[round(x, 3) for x in values]}{ratios}")

    print(f"per call, ms (median of {args.calls}; ratio to eager):")
    for name in names:
        if name in keeper.calls:
            _, call_args, call_kwargs = keeper.calls[name]
            time_calls(name, call_args, call_kwargs, modules, args.calls)


if __name__ == "__main__":
    main()
