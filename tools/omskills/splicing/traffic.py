"""What the spliced graphs move between host and device: per step and per graph, the calls, the
bytes of their inputs and outputs, and which input bytes were another graph's output passed on
unchanged (a hand-off that could stay on the device).

On an Ascend host every graph call copies its inputs to the device and its outputs back, so
these counts, not the graphs' own time, are what merging graphs and keeping hand-offs on the
device would save. An output the study saw no host code read stays on the device
(`splicing.unfetched`): it is counted only if it is read after all, when it is copied back.
The meter only counts; `records.traffic` turns the counts into a predicted link time.
"""

from __future__ import annotations

import logging
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from omskills.errors import one_line
from omskills.records.traffic import GraphTraffic, LinkCost, MergeProposal, StepTraffic, TrafficReport

logger = logging.getLogger(__name__)


@dataclass
class _Counts:
    calls: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    copies: int = 0
    handed_copies: int = 0
    resident_copies: int = 0
    resident_in: int = 0
    handed_from: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    input_sources: dict[str, str] = field(default_factory=dict)
    merged_calls: int = 0
    merged_into: str | None = None

    def source_seen(self, name: str, source: str) -> None:
        """One call's source of input `name` ('' for host code): kept while every call agrees."""
        self.input_sources[name] = source if self.input_sources.get(name, source) == source else ""

    def add(self, other: _Counts | GraphTraffic) -> None:
        self.calls += other.calls
        self.bytes_in += other.bytes_in
        self.bytes_out += other.bytes_out
        self.copies += other.copies
        self.handed_copies += other.handed_copies
        self.resident_copies += other.resident_copies
        self.resident_in += other.resident_in
        for source, nbytes in other.handed_from.items():
            self.handed_from[source] += nbytes
        for name, source in other.input_sources.items():
            self.source_seen(name, source)
        self.merged_calls += other.merged_calls
        self.merged_into = self.merged_into or other.merged_into

    def as_record(self, graph: str) -> GraphTraffic:
        return GraphTraffic(
            graph=graph,
            calls=self.calls,
            bytes_in=self.bytes_in,
            bytes_out=self.bytes_out,
            copies=self.copies,
            handed_in=sum(self.handed_from.values()),
            handed_copies=self.handed_copies,
            handed_from=dict(self.handed_from),
            resident_copies=self.resident_copies,
            resident_in=self.resident_in,
            input_sources=dict(self.input_sources),
            merged_calls=self.merged_calls,
            merged_into=self.merged_into,
        )


@dataclass(frozen=True)
class _Produced:
    graph: str
    output: str  # its name among the graph's outputs
    tensor: weakref.ref
    nbytes: int
    version: int | None  # None for an inference tensor, which keeps no version counter
    probe: bytes  # a sample of its values: what shows an in-place write when there is no counter
    value: Any = None  # the runtime's own value of it (an OrtValue), to hand on as it is


PROBE_VALUES = 64


def _probe(tensor: torch.Tensor) -> bytes:
    flat = tensor.reshape(-1)
    count = min(PROBE_VALUES, flat.numel())
    # Integer steps: a float linspace rounds the last index of a 21-million-element tensor past its end.
    picks = torch.arange(count, dtype=torch.int64) * (flat.numel() - 1) // max(count - 1, 1)
    return flat[picks].cpu().numpy().tobytes()


def _version(tensor: torch.Tensor) -> int | None:
    return None if tensor.is_inference() else tensor._version


class GraphCallObserver(Protocol):
    """Something that watches the host code between graph calls (`boundary.glue.GlueRecorder`)."""

    inside: int  # above 0 while a graph call is in progress: what it does is not host code

    def graph_call(
        self, graph: str, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor]
    ) -> None: ...

    def step_done(self, index: int) -> None: ...


class TrafficMeter:
    """Counts every backend call of a splice. Calls are counted toward the step the driver reports
    next (`step_done`); calls after the last report (teardown) toward a step of their own."""

    def __init__(self, keep_values: bool = True) -> None:
        self.error: str | None = None  # why counting stopped: a measurement never changes a call's outcome
        # Keep each output's runtime value while its tensor lives, so a graph reading it unchanged
        # is given that value (a device-resident hand-off) rather than a host array.
        self.keep_values = keep_values
        self._steps: dict[int | None, dict[str, _Counts]] = {}
        self._pending: dict[str, _Counts] = defaultdict(_Counts)
        # An output tensor of a graph, by the address of its data, while the tensor lives: an input
        # at that address with the same version counter is that output, unchanged since.
        self._produced: dict[int, _Produced] = {}
        self.observer: GraphCallObserver | None = None

    @contextmanager
    def graph_call(self) -> Iterator[None]:
        """A graph call (or its fallback) in progress: an observer sees its inputs and outputs, not
        the tensors the splice makes to move them."""
        if self.observer is not None:
            self.observer.inside += 1
        try:
            yield
        finally:
            if self.observer is not None:
                self.observer.inside -= 1

    def observe(self, graph: str, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor]) -> None:
        """Tell the observer, if any, of a call of `graph`."""
        if self.observer is not None:
            self.observer.graph_call(graph, inputs, outputs)  # it keeps its own errors: counting goes on

    def record(
        self,
        graph: str,
        inputs: Sequence[torch.Tensor],
        feeds: Mapping[str, np.ndarray],
        outputs: Sequence[torch.Tensor],
        values: Sequence[Any] | None = None,
        resident: Sequence[str] = (),
        output_names: Sequence[str] = (),
    ) -> None:
        """One backend call: `inputs`, the tensors of `feeds` in the same order; `values`, the
        runtime's own value of each output (to hand on); `resident`, the feeds that were given as
        such values instead of host arrays; `output_names`, the outputs' names in the graph."""
        self._guarded(
            graph,
            lambda: self._count(
                graph, inputs, feeds, outputs, values if self.keep_values else None, resident, output_names
            ),
        )

    def record_merged(
        self, graph: str, into: str, outputs: Sequence[torch.Tensor], output_names: Sequence[str]
    ) -> None:
        """A call of `graph` answered inside a call of `into` (a merged graph): no launch and no
        input copied; its outputs still come back to the host."""

        def count() -> None:
            counts = self._pending[graph]
            counts.merged_calls += 1
            counts.merged_into = into
            counts.bytes_out += sum(int(t.nbytes) for t in outputs)
            counts.copies += len(outputs)
            self._forget_dead()
            self._produced_by(graph, outputs, None, output_names)

        self._guarded(graph, count)

    def record_late_copy(self, graph: str, tensor: torch.Tensor) -> None:
        """An output `graph` left on the device, copied back when the host read it after all: counted
        toward the step in which it was read."""

        def count() -> None:
            counts = self._pending[graph]
            counts.bytes_out += int(tensor.nbytes)
            counts.copies += 1

        self._guarded(graph, count)

    def _guarded(self, graph: str, count: Callable[[], None]) -> None:
        if self.error is not None:
            return
        try:
            count()
        except Exception as err:  # noqa: BLE001 - the call itself succeeded; only its count is lost
            self.error = f"{graph}: {one_line(err, 200)}"
            logger.warning("host-device traffic no longer counted (%s)", self.error)

    def _count(
        self,
        graph: str,
        inputs: Sequence[torch.Tensor],
        feeds: Mapping[str, np.ndarray],
        outputs: Sequence[torch.Tensor],
        values: Sequence[Any] | None,
        resident: Sequence[str],
        output_names: Sequence[str],
    ) -> None:
        counts = self._pending[graph]
        counts.calls += 1
        counts.bytes_in += sum(int(array.nbytes) for array in feeds.values())
        counts.bytes_out += sum(int(t.nbytes) for t in outputs)
        counts.copies += len(feeds) + len(outputs)
        counts.resident_copies += len(resident)
        counts.resident_in += sum(int(feeds[name].nbytes) for name in resident)
        self._forget_dead()
        for name, tensor in zip(feeds, inputs):
            produced = self.handed_output(tensor)
            counts.source_seen(name, f"{produced.graph}/{produced.output}" if produced else "")
            if produced is not None:  # its own earlier output too: a recurrent state can stay on the device
                counts.handed_from[produced.graph] += int(tensor.nbytes)
                counts.handed_copies += 1
        self._produced_by(graph, outputs, values, output_names)

    def _produced_by(
        self, graph: str, outputs: Sequence[torch.Tensor], values: Sequence[Any] | None, output_names: Sequence[str]
    ) -> None:
        names = list(output_names) or [str(k) for k in range(len(outputs))]
        for k, tensor in enumerate(outputs):
            if tensor.nbytes:
                self._produced[tensor.data_ptr()] = _Produced(
                    graph,
                    names[k],
                    weakref.ref(tensor),
                    int(tensor.nbytes),
                    _version(tensor),
                    _probe(tensor),
                    values[k] if values is not None else None,
                )

    def resident_value(self, tensor: torch.Tensor) -> Any:
        """The runtime value of a graph output `tensor` still is, unchanged since, or None."""
        if self.error is not None or not self.keep_values:
            return None
        try:
            if self.handed_output(tensor) is None:
                return None
            return self._produced[tensor.data_ptr()].value
        except Exception:  # noqa: BLE001 - the host array is always a correct feed
            return None

    def step_done(self, index: int) -> None:
        """The driver finished step `index`: the calls since the last report were its calls."""
        self._merge(index)
        if self.observer is not None:
            self.observer.step_done(index)
        self._forget_dead()  # a kept runtime value holds its buffer: none outlives its tensor by a step

    def _forget_dead(self) -> None:
        self._produced = {a: p for a, p in self._produced.items() if p.tensor() is not None}

    def steps(self) -> list[StepTraffic]:
        """Every step's counts, in step order (calls after the last step last, with step None)."""
        if self._pending:
            self._merge(None)
        ordered = sorted(self._steps, key=lambda s: (s is None, s or 0))
        return [StepTraffic(step=s, graphs=[c.as_record(g) for g, c in self._steps[s].items()]) for s in ordered]

    def _merge(self, step: int | None) -> None:
        into = self._steps.setdefault(step, {})
        for graph, counts in self._pending.items():
            into.setdefault(graph, _Counts()).add(counts)
        self._pending = defaultdict(_Counts)

    def handed_output(self, tensor: torch.Tensor) -> _Produced | None:
        """The graph output `tensor` still is, unchanged since that call, or None."""
        if tensor.device.type == "meta" or not tensor.is_contiguous():
            return None  # a strided view is copied into a new buffer on its way in
        produced = self._produced.get(tensor.data_ptr())
        if produced is None or produced.tensor() is None:
            return None
        if int(tensor.nbytes) != produced.nbytes:
            return None
        # Views share their base's version counter, so an in-place write through any of them shows;
        # an inference tensor has none, and a sample of its values must do.
        if produced.version is not None:
            return produced if _version(tensor) == produced.version else None
        return produced if _probe(tensor) == produced.probe else None


def traffic_report(steps: list[StepTraffic], link: LinkCost) -> TrafficReport:
    """The run's counts per step and per graph, and the link time they predict on `link`."""
    totals: dict[str, _Counts] = defaultdict(_Counts)
    for step in steps:
        for graph in step.graphs:
            totals[graph.graph].add(graph)
    counted = [s for s in steps if s.step is not None] or steps
    n = max(len(counted), 1)
    calls = sum(s.calls for s in counted) / n
    copies = sum(s.copies for s in counted) / n
    handed_copies = sum(s.handed_copies for s in counted) / n
    crossing = sum(s.bytes_crossing for s in counted) / n
    handed = sum(s.handed_in for s in counted) / n
    return TrafficReport(
        per_step=steps,
        per_graph=[c.as_record(g) for g, c in totals.items()],
        link=link,
        calls_per_step=round(calls, 3),
        copies_per_step=round(copies, 3),
        bytes_per_step=round(crossing, 1),
        handed_in_per_step=round(handed, 1),
        predicted_link_s_per_step=_link_seconds(calls + copies, crossing, link),
        predicted_link_s_per_step_handed_off=_link_seconds(calls + copies - handed_copies, crossing - handed, link),
        resident_copies_per_step=round(sum(s.resident_copies for s in counted) / n, 3),
        merges=merge_proposals(totals, n),
    )


def merge_proposals(totals: Mapping[str, GraphTraffic | _Counts], steps: int) -> list[MergeProposal]:
    """For each called graph: could one call of the graph feeding it also compute it? Only when
    every input byte it reads is that graph's output unchanged (no host code between them) and
    the two are called as often; otherwise the reason, from the counts."""
    proposals = []
    for graph, counts in totals.items():
        sources = dict(sorted(((s, n) for s, n in counts.handed_from.items() if s != graph), key=lambda kv: -kv[1]))
        upstream = next(iter(sources), None)
        from_host = counts.bytes_in - sum(counts.handed_from.values())
        mergeable, io_map = False, None
        if counts.merged_calls and not counts.calls:
            reason = f"runs inside {counts.merged_into}'s calls: merged"
        elif upstream is None:
            reason = (
                "no input is another graph's output: "
                + ("it reads its own earlier outputs unchanged, the rest " if graph in counts.handed_from else "")
                + "from host code (user inputs or tensors computed between the calls)"
            )
        elif from_host > 0:
            reason = (
                f"{_mb(from_host / steps)} per step of its inputs come from host code, not unchanged from "
                f"{upstream}: a merge would have to take that code into the graph"
            )
        elif len(sources) > 1:
            reason = f"fed by several graphs ({', '.join(sources)}): a merge would take them all into one call"
        elif (feeding := totals.get(upstream)) is None or feeding.calls != counts.calls:
            reason = f"called {counts.calls} times against {feeding.calls if feeding else 0} calls of {upstream}"
        elif (io_map := _io_map(counts, upstream)) is None:
            reason = f"its inputs are not the same outputs of {upstream} in every call"
        else:
            mergeable = True
            reason = f"every input is {upstream}'s output, unchanged: one call of both would do"
        proposals.append(
            MergeProposal(
                graph=graph,
                upstream=upstream,
                mergeable=mergeable,
                reason=reason,
                calls_saved_per_step=round(counts.calls / steps, 3) if mergeable else 0.0,
                bytes_saved_per_step=round(counts.bytes_in / steps, 1) if mergeable else 0.0,
                io_map=io_map or {},
            )
        )
    return proposals


def _io_map(counts: GraphTraffic | _Counts, upstream: str) -> dict[str, str] | None:
    """Each input -> the output of `upstream` that fed it in every call, or None if one was not."""
    sources = {name: source.partition("/") for name, source in counts.input_sources.items()}
    if not sources or any(graph != upstream for graph, _, _ in sources.values()):
        return None
    return {name: output for name, (_, _, output) in sources.items()}


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f} MB"


def _link_seconds(round_trips: float, nbytes: float, link: LinkCost) -> float:
    copying = nbytes / (link.bandwidth_gb_s * 1e9) if link.bandwidth_gb_s else 0.0
    return round(round_trips * link.round_trip_us * 1e-6 + copying, 6)
