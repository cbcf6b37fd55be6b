"""A chain of graphs composed with the host code between them (widened boundaries), run as one call.

The composed graph computes the first member, the glue of each widened link and every later member.
Its call can only be made when the last member is called: the glue's slots (values the host made
before, user inputs) exist by then. So the first member's call launches nothing: it keeps its feeds
and gives placeholders for its outputs, and a `GlueWindow` defers the host's operations on them
(`splicing.unfetched`). Each later member's call whose inputs are the recipes the capture saw, its
constant slots holding their values, is answered with placeholders too, until the last member's call
launches the composed graph: one call, fed the first member's inputs and the slots not computed
inside, every output left on the device until the host reads it.

A call that does not match, or a placeholder the host reads before the launch, breaks the chain for
that step: each member called so far then runs its own graph on its own inputs (computed on the host
from the outputs before it), so what the host sees is the same values either way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from omskills.contracts.layout import torch_dtype
from omskills.contracts.recipes import value_digest
from omskills.records.glue import SlotUse, composed_prefix, glue_name
from omskills.splicing.unfetched import GlueWindow, Unfetched

if TYPE_CHECKING:
    from omskills.splicing.splice import SpliceBackend, _Route
    from omskills.splicing.traffic import TrafficMeter

logger = logging.getLogger(__name__)


class RouteChain:
    """The routes of graphs composed into one, in call order."""

    def __init__(self, routes: Sequence[_Route]) -> None:
        self.routes = list(routes)

    @property
    def first(self) -> _Route:
        return self.routes[0]

    def member(self, route: _Route) -> int:
        return next(k for k, r in enumerate(self.routes) if r is route)


class DeferredChain(RouteChain):
    """Serves the members of one composed chain with widened links (see the module docstring)."""

    deferred = True
    glued = True

    def __init__(
        self,
        routes: Sequence[_Route],
        backend: SpliceBackend,
        io_maps: Sequence[Mapping[str, str]],
        recipes: Sequence[Mapping[str, str] | None],
        slots: Sequence[Sequence[SlotUse]],
        traffic: TrafficMeter,
    ) -> None:
        super().__init__(routes)
        self.names = [r.contract.candidate for r in self.routes]
        self.backend = backend
        self.io_maps = [dict(m) for m in io_maps]
        self.recipes = [dict(r) if r else None for r in recipes]
        self.slots = [list(s) for s in slots] + [[] for _ in range(len(io_maps) - len(slots))]
        self.traffic = traffic
        self.answered = [0] * len(self.routes)
        self._pending: _Pending | None = None
        # (member, its inputs' shapes) -> its outputs' shapes: a call not launched gives placeholders
        # of these. From the calls the study saw; each call run adds its own.
        self.shapes: dict[tuple[int, tuple], list[tuple[int, ...]]] = {
            (k, _key(call.inputs)): [tuple(o) for o in call.outputs]
            for k, route in enumerate(self.routes)
            for call in route.contract.call_shapes
        }

    def forget(self) -> None:
        self._pending = None

    def call(
        self, route: _Route, by_name: Mapping[str, torch.Tensor], device: torch.device
    ) -> list[torch.Tensor] | None:
        """The outputs of this call of `route` (placeholders until the launch), or None: it runs its own graph."""
        k = self.member(route)
        if k == 0:
            self._pending = None
            if self.output_shapes(0, by_name) is None:
                return None  # sizes never seen: it runs its own graph, and the chain waits for the next call
            self._pending = _Pending(self, by_name, device)
            return self._pending.placeholders_of(0)
        pending = self._pending
        if pending is None or pending.next != k or self.output_shapes(k, by_name) is None:
            return None
        fed = pending.matched(k, by_name)
        if fed is None:
            pending.next = None
            return None
        return pending.virtual_call(k, by_name, fed)

    def output_shapes(self, k: int, by_name: Mapping[str, torch.Tensor]) -> list[tuple[int, ...]] | None:
        """Member k's output shapes for a call given these inputs, when a call of these sizes was seen."""
        return self.shapes.get((k, self._input_key(k, by_name)))

    def saw(self, k: int, by_name: Mapping[str, torch.Tensor], outputs: Mapping[str, Any]) -> None:
        """A call of member k that ran: its sizes, for the next deferred one."""
        specs = self.routes[k].contract.outputs
        if all(spec.name in outputs for spec in specs):
            self.shapes[(k, self._input_key(k, by_name))] = [tuple(outputs[spec.name].shape) for spec in specs]

    def _input_key(self, k: int, by_name: Mapping[str, torch.Tensor]) -> tuple:
        return _key(
            [tuple(by_name[spec.name].shape) for spec in self.routes[k].contract.inputs if spec.name in by_name]
        )

    def fed_name(self, k: int, index: int) -> str:
        """The composed graph's input for slot `index` of link k (member k+1's recipes)."""
        return composed_prefix(glue_name(self.names[k], self.names[k + 1])) + f"slot_{index}"


class _Pending:
    """One run of the chain, from its first member's call on."""

    def __init__(self, chain: DeferredChain, by_name: Mapping[str, torch.Tensor], device: torch.device) -> None:
        self.chain, self.device = chain, device
        first = chain.first
        self.inputs = {n: by_name[n] for n in first.feed_names}
        self.feeds = {n: np.require(t.detach().cpu().numpy(), requirements="C") for n, t in self.inputs.items()}
        self.given: dict[int, Mapping[str, torch.Tensor]] = {0: by_name}
        self.fed: dict[str, torch.Tensor] = {}
        self.placeholders: dict[tuple[int, str], torch.Tensor] = {}
        self.produced: dict[str, Any] | None = None
        self.own: dict[int, dict[str, np.ndarray]] = {}  # members run on their own graphs (a broken chain)
        self.next: int | None = 1
        self.window: GlueWindow | None = None
        self.windows: list[GlueWindow] = []

    # ------------------------------------------------------------------ calls

    def placeholders_of(self, k: int) -> list[torch.Tensor]:
        route = self.chain.routes[k]
        shapes = self.chain.output_shapes(k, self.given[k]) or [tuple(spec.shape) for spec in route.contract.outputs]
        made = []
        for spec, shape in zip(route.contract.outputs, shapes):
            tensor = Unfetched(
                shape, torch_dtype(spec.dtype), self.device, self._copy_back(k, spec.name), self._read(k)
            )
            self.placeholders[(k, spec.name)] = tensor
            made.append(tensor)
        if k + 1 < len(self.chain.routes) and self.chain.recipes[k] is not None:
            self.window = GlueWindow(route.contract.candidate)
            self.windows.append(self.window)
            for spec, tensor in zip(route.contract.outputs, made):
                self.window.add_root(tensor, spec.name)  # type: ignore[arg-type]
        return made

    def matched(self, k: int, by_name: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """The slots to feed for member k's call when its inputs are what the composed graph computes."""
        recipes, window, self.window = self.chain.recipes[k - 1], self.window, None
        if recipes is None:  # a direct link: the member before's outputs, as they were given
            io_map = self.chain.io_maps[k - 1]
            same = all(by_name.get(i) is self.placeholders.get((k - 1, o)) for i, o in io_map.items())
            return {} if same else None
        if window is None:
            return None
        window.open = False  # from now on the host computes what it reads
        found = window.match(recipes, {n: by_name[n] for n in recipes if n in by_name})
        if found is None or len(found) != len(self.chain.slots[k - 1]):
            return self._unmatched(k, "its inputs are not the recipes the widened graph computes")
        fed = {}
        for index, (tensor, slot) in enumerate(zip(found, self.chain.slots[k - 1])):
            inside = slot.chained(self.chain.names[:k])
            if inside is not None:
                kind, graph, name = inside
                j = self.chain.names.index(graph)
                expected = self.placeholders.get((j, name)) if kind == "output" else self.given.get(j, {}).get(name)
                if tensor is not expected:
                    return self._unmatched(k, f"slot {index} is not {graph}'s {kind} {name} of this run")
            elif slot.constant:
                if value_digest(tensor) != slot.value:
                    return self._unmatched(k, f"slot {index} does not hold the constant the widened graph holds")
            elif self._made_here(tensor):
                return self._unmatched(k, f"slot {index} is computed from this run's outputs but given to no member")
            else:
                fed[self.chain.fed_name(k - 1, index)] = tensor
        return fed

    def _made_here(self, tensor: torch.Tensor) -> bool:
        """Whether feeding `tensor` would need an output of this run before the launch."""
        return isinstance(tensor, Unfetched) and (
            tensor._window in self.windows or any(tensor is p for p in self.placeholders.values())
        )

    def _unmatched(self, k: int, why: str) -> None:
        logger.info("%s: %s; it runs its own graph", self.chain.names[k], why)
        return None

    def virtual_call(
        self, k: int, by_name: Mapping[str, torch.Tensor], fed: dict[str, torch.Tensor]
    ) -> list[torch.Tensor]:
        self.given[k] = by_name
        self.fed |= fed
        if k + 1 < len(self.chain.routes):
            self.next = k + 1
            return self.placeholders_of(k)
        self.next = None
        self._launch()
        return self.placeholders_of(k)

    # ------------------------------------------------------------------ running

    def _launch(self) -> None:
        """The composed graph's one call: every output held until read."""
        chain = self.chain
        slot_feeds = {n: np.require(t.detach().cpu().numpy(), requirements="C") for n, t in self.fed.items()}
        feeds = {**self.feeds, **slot_feeds}
        started = time.perf_counter()
        if getattr(chain.backend, "holds_values", False):
            self.produced = dict(chain.backend.run_values(feeds, fetch=[]))  # type: ignore[attr-defined]
        else:
            self.produced = dict(chain.backend.run(feeds))
        chain.first.backend_seconds.append(time.perf_counter() - started)
        inputs = [*self.inputs.values(), *self.fed.values()]
        crossed = {n: v for n, v in self.produced.items() if isinstance(v, np.ndarray)}
        out = [torch.from_numpy(np.require(v, requirements="C")) for v in crossed.values()]
        chain.traffic.record(chain.names[0], inputs, feeds, out, None, [], list(crossed))
        for k, route in enumerate(chain.routes):
            prefix = "" if k == 0 else composed_prefix(route.contract.candidate)
            chain.saw(
                k, self.given[k], {spec.name: self.produced[prefix + spec.name] for spec in route.contract.outputs}
            )
        for k, name in enumerate(chain.names[1:], start=1):
            chain.answered[k] += 1
            chain.traffic.record_merged(name, chain.names[0], [], [])

    def value(self, k: int, name: str) -> np.ndarray:
        """Output `name` of member k: from the composed call, or from its own graph's run."""
        if self.produced is not None:
            key = name if k == 0 else composed_prefix(self.chain.names[k]) + name
            held = self.produced[key]
            return held if isinstance(held, np.ndarray) else np.asarray(held.copy_back())
        if self.next is not None:
            logger.info(
                "%s output %s read before the composed call: the chain runs apart for this step",
                self.chain.names[k],
                name,
                stack_info=logger.isEnabledFor(logging.DEBUG),
            )
        self.next = None  # read before the launch: the chain runs apart for this step
        return self._own(k)[name]

    def _own(self, k: int) -> dict[str, np.ndarray]:
        if k not in self.own:
            route = self.chain.routes[k]
            given = self.given[k]
            feeds = {n: np.require(given[n].detach().cpu().numpy(), requirements="C") for n in route.feed_names}
            started = time.perf_counter()
            produced = dict(route.backend.run(feeds))
            route.backend_seconds.append(time.perf_counter() - started)
            self.own[k] = {n: np.asarray(v) for n, v in produced.items()}
            self.chain.saw(k, given, self.own[k])
            outputs = [torch.from_numpy(np.require(v, requirements="C")) for v in self.own[k].values()]
            self.chain.traffic.record(
                route.contract.candidate,
                [given[n] for n in route.feed_names],
                feeds,
                outputs,
                None,
                [],
                list(self.own[k]),
            )
        return self.own[k]

    def _copy_back(self, k: int, name: str):  # type: ignore[no-untyped-def]
        return lambda: self.value(k, name)

    def _read(self, k: int):  # type: ignore[no-untyped-def]
        def read(tensor: torch.Tensor) -> None:
            if self.produced is not None:  # a member run on its own counted its outputs with its call
                self.chain.traffic.record_late_copy(self.chain.names[k], tensor)

        return read


def _key(shapes: Sequence[Sequence[int]]) -> tuple:
    return tuple(tuple(int(d) for d in shape) for shape in shapes)
