"""Splice compiled candidates back into the live model, and take them out again.

`splice(root, [(contract, backend), ...])` puts a `SplicedModule` at each candidate's
replacement point (the attribute on its parent). On every call the spliced module flattens the
arguments as the contract did, checks them against the contract (structure, constants, dtypes,
shapes), runs the backend on numpy feeds and rebuilds the output structure the caller expects,
with the contract's dtypes on the caller's device. A call outside the contract runs the original
PyTorch module instead — counted, with its reason, and logged as a warning: never silent.
`unsplice()` puts the original module objects back. With `strict=True` a call outside the
contract raises `ContractViolation` instead (a deployment that must never run PyTorch silently).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from omskills.contracts.batch_axes import batch_axes
from omskills.contracts.layout import TreeLayout, dtype_name, torch_dtype
from omskills.contracts.pytree import FlatTree, flatten_call, spec_from_str, unflatten
from omskills.errors import OmskillsError, one_line
from omskills.files import portable_class_name
from omskills.records.contracts import ContractSpec, NonTensorArg, ShapeStrategy, TensorSpec
from omskills.records.export import FallbackEvent, FallbackKind, SpliceStats
from omskills.records.glue import SlotUse
from omskills.splicing.deferred_chain import DeferredChain, RouteChain
from omskills.splicing.memo import OutputMemo, memoisable
from omskills.splicing.traffic import TrafficMeter
from omskills.splicing.unfetched import Unfetched
from torch import nn

logger = logging.getLogger(__name__)


class SpliceError(OmskillsError):
    """A candidate cannot be spliced, or its backend returned something the contract does not allow."""


class ContractViolation(SpliceError):
    """Strict mode: a call lies outside every contract of its spliced module (no fallback allowed)."""


class IOName(Protocol):
    name: str
    dtype: str


class SpliceBackend(Protocol):
    """What a spliced module needs from a runtime backend (omskills.runtime.Runner has it)."""

    kind: str
    device: str

    def describe(self) -> str: ...

    @property
    def inputs(self) -> Sequence[IOName]: ...

    @property
    def outputs(self) -> Sequence[IOName]: ...

    def run(self, feeds: Mapping[str, np.ndarray], fetch: Collection[str] | None = None) -> Mapping[str, Any]: ...


# What a backend returns for an output the splice did not ask it to fetch, when it can leave the
# output on its device (`runtime.base.HeldOutput`): its `shape`, and `copy_back()`.
def _is_held(value: Any) -> bool:
    return hasattr(value, "copy_back") and hasattr(value, "shape") and not isinstance(value, np.ndarray)


# --------------------------------------------------------------------------- contract checks


@dataclass(frozen=True)
class Violation:
    kind: FallbackKind
    reason: str


@dataclass(frozen=True)
class _DynamicDim:
    input: str
    dim: int
    size: int
    rank: int


class ShapeRule:
    """Which input shapes a backend accepts: the contract's, or the shape strategy's when given.

    Without a strategy, a static dim must equal the shape seen at capture and a dim that varied
    may take any of the sizes observed then. With one, its -1 dims are the dynamic ones and their
    values must form one of its gears (tiled when several inputs share them, as a batch does) or
    lie within its ranges. `any_batch`: inputs whose dim 0 takes any size, because the backend
    serves other sizes as gear-sized calls. `unsplit`: why a batch outside the gears cannot be
    served that way, told with the call that falls back.
    """

    def __init__(
        self,
        inputs: list[TensorSpec],
        strategy: ShapeStrategy | None,
        any_batch: frozenset[str] = frozenset(),
        unsplit: str | None = None,
    ) -> None:
        self.inputs = inputs
        self.strategy = strategy
        self.any_batch = any_batch
        self.unsplit = unsplit

    def violation(self, tensors: Sequence[torch.Tensor]) -> str | None:
        if self.strategy is None:
            return self._against_contract(tensors)
        return self._against_strategy(tensors, self.strategy)

    def _against_contract(self, tensors: Sequence[torch.Tensor]) -> str | None:
        for spec, tensor in zip(self.inputs, tensors):
            if tensor.dim() != len(spec.shape):
                return f"input {spec.name} has shape {list(tensor.shape)}, the contract's rank is {len(spec.shape)}"
            for dim, (size, seen) in enumerate(zip(tensor.shape, spec.shape)):
                allowed = spec.dynamic_dims.get(str(dim), [seen])
                if size not in allowed:
                    return f"input {spec.name} dim {dim} is {size}, the contract allows {allowed}"
        return None

    def _against_strategy(self, tensors: Sequence[torch.Tensor], strategy: ShapeStrategy) -> str | None:
        dynamic: list[_DynamicDim] = []  # every -1 dim, in input order
        for spec, tensor in zip(self.inputs, tensors):
            declared = strategy.input_shapes.get(spec.name, spec.shape)
            if tensor.dim() != len(declared):
                return f"input {spec.name} has shape {list(tensor.shape)}, the strategy's is {declared}"
            for dim, (size, want) in enumerate(zip(tensor.shape, declared)):
                if want == -1 and dim == 0 and spec.name in self.any_batch:
                    continue
                if want == -1:
                    dynamic.append(_DynamicDim(spec.name, dim, int(size), len(declared)))
                elif size != want:
                    return f"input {spec.name} dim {dim} is {size}, the {strategy.kind} strategy fixes it at {want}"
        if not dynamic or strategy.kind == "static":
            return None
        if strategy.kind == "dynamic_shape":
            return _outside_ranges(dynamic, strategy)
        values = [entry.size for entry in dynamic]
        if any(_tiled(gear, len(values)) == values for gear in strategy.gears):
            return None
        why = f"dynamic dims {_named(dynamic)} match no {strategy.kind} gear of {strategy.gears}"
        if strategy.kind == "dynamic_batch_size" and self.unsplit:
            why += f"; the batch cannot run as gear-sized calls: {self.unsplit}"
        return why


def _tiled(gear: list[int], length: int) -> list[int] | None:
    if not gear or length % len(gear):
        return None
    return gear * (length // len(gear))


def _named(dynamic: list[_DynamicDim]) -> str:
    return ", ".join(f"{entry.input}[{entry.dim}]={entry.size}" for entry in dynamic)


def _outside_ranges(dynamic: list[_DynamicDim], strategy: ShapeStrategy) -> str | None:
    """ranges[input] holds one [min, max] per dim of the input, or one per -1 dim, in order."""
    per_input: dict[str, list[_DynamicDim]] = {}
    for entry in dynamic:
        per_input.setdefault(entry.input, []).append(entry)
    for name, dims in per_input.items():
        ranges = strategy.ranges.get(name)
        if ranges is None:
            return f"input {name} has dynamic dims but the dynamic_shape strategy gives it no ranges"
        for k, entry in enumerate(dims):
            index = entry.dim if len(ranges) == entry.rank else k
            if index >= len(ranges):
                return f"input {name} dim {entry.dim}: the dynamic_shape strategy gives no range"
            low, high = ranges[index]
            if not low <= entry.size <= high:
                return f"input {name} dim {entry.dim} is {entry.size}, outside the strategy's range [{low}, {high}]"
    return None


def _unsplit(contract: ContractSpec, strategy: ShapeStrategy | None, backend: object) -> str | None:
    """Why this graph's batch cannot be split into gear-sized calls, or None when it can: what the
    backend found when it was opened (`Runner.unsplit`: its batch items interact, say), else its shapes."""
    found = getattr(backend, "unsplit", None)
    if found:
        return found
    axes = batch_axes(contract, strategy)
    return axes if isinstance(axes, str) else None


def _same_constant(value: Any, arg: NonTensorArg, bound: Any) -> bool:
    if bound is None:
        return repr(value) == arg.value_repr
    # bool is an int in Python: True must not pass for 1.
    return type(value) is type(bound) and value == bound


# --------------------------------------------------------------------------- spliced module


def spliced_class(original_class: type) -> type:
    """A SplicedModule that also passes `isinstance(x, OriginalClass)`.

    Model code branches on the class of its submodules (a tracker calls its memory encoder
    differently unless `isinstance(self.maskmem_backbone, SimpleMaskEncoder)`), so a
    replacement that fails that test would change the model's behaviour.
    """
    if issubclass(original_class, SplicedModule):
        return original_class
    cached = _SPLICED_CLASSES.get(original_class)
    if cached is None:
        cached = type(f"Spliced{original_class.__name__}", (SplicedModule, original_class), {})
        _SPLICED_CLASSES[original_class] = cached
    return cached


_SPLICED_CLASSES: dict[type, type] = {}


class _Route:
    """One compiled graph a spliced module can send a call to: its contract, backend and checks."""

    def __init__(
        self, contract: ContractSpec, backend: SpliceBackend, strategy: ShapeStrategy | None, traffic: TrafficMeter
    ) -> None:
        self.contract = contract
        self.backend = backend
        self.traffic = traffic
        self.memo = OutputMemo() if memoisable(contract) else None
        self.call_layout = TreeLayout.of_call(contract)
        self.output_layout = TreeLayout.of_output(contract)
        self.in_spec = spec_from_str(contract.in_spec)
        self.out_spec = spec_from_str(contract.out_spec)
        any_batch = getattr(backend, "any_size_inputs", frozenset())
        self.shape_rule = ShapeRule(contract.inputs, strategy, any_batch, _unsplit(contract, strategy, backend))
        self.bound_constants = self._bound_constants(contract)
        self.output_constants = self._output_constants(contract)
        self.feed_names = self._feed_names(contract, backend)
        self._holds_values: bool | None = None  # asked at the first call: asking loads the backend
        self.calls = 0  # calls this graph answered or, when none could, was held to account for
        self.backend_seconds: list[float] = []
        self.fallback_events: list[FallbackEvent] = []
        self.merged: MergedChain | DeferredChain | None = None  # set on every graph of a merge
        # The outputs to copy back: all but those the study saw no host code read. A graph whose
        # calls are remembered keeps every output: the memory answers later calls with them.
        unread = [spec.name for spec in contract.outputs if spec.unread]
        self.fetch = [s.name for s in contract.outputs if not s.unread] if unread and self.memo is None else None
        self.held_read: list[str] = []  # held outputs read after all, one entry per copy back

    @staticmethod
    def _bound_constants(contract: ContractSpec) -> list[Any]:
        """The value each non-tensor argument must have; None: only its repr is known."""
        varying = [arg.tree_path for arg in contract.non_tensor_args if not arg.constant and arg.derived is None]
        if varying:
            raise SpliceError(
                f"{contract.candidate}: non-tensor arguments {varying} vary across calls; "
                "a compiled graph cannot take them"
            )
        return [arg.value for arg in contract.non_tensor_args]

    @staticmethod
    def _output_constants(contract: ContractSpec) -> list[Any]:
        unusable = [
            arg.tree_path
            for arg in contract.non_tensor_outputs
            if not arg.constant or (arg.value is None and arg.value_repr != "None")
        ]
        if unusable:
            raise SpliceError(
                f"{contract.candidate}: non-tensor outputs {unusable} vary or have no recorded value; "
                "the output cannot be rebuilt from the backend's tensors"
            )
        return [arg.value for arg in contract.non_tensor_outputs]

    @staticmethod
    def _feed_names(contract: ContractSpec, backend: SpliceBackend) -> list[str]:
        """The contract inputs the backend takes (an exporter may drop unused ones), with checks."""
        inputs = {spec.name: spec for spec in contract.inputs}
        outputs = {spec.name: spec for spec in contract.outputs}
        where = f"{contract.candidate}: backend {backend.kind}"
        for io in backend.inputs:
            if io.name not in inputs:
                raise SpliceError(f"{where} takes input {io.name!r}, which the contract does not have")
            if io.dtype != inputs[io.name].dtype:
                raise SpliceError(f"{where} input {io.name!r} is {io.dtype}, the contract's is {inputs[io.name].dtype}")
        missing = sorted(set(outputs) - {io.name for io in backend.outputs})
        if missing:
            raise SpliceError(f"{where} has no output(s) {missing} of the contract")
        return [io.name for io in backend.inputs]

    def violation(self, flat: FlatTree) -> Violation | None:
        if flat.spec != self.in_spec:
            return Violation("structure", "the call's argument structure differs from the contract's in_spec")
        for leaf, role, path in zip(flat.leaves, self.call_layout.roles, self.call_layout.paths):
            if role.is_tensor != isinstance(leaf, torch.Tensor):
                expected = "a tensor" if role.is_tensor else "a non-tensor constant"
                return Violation("structure", f"{path} is {type(leaf).__name__}, the contract has {expected}")
        others = self.call_layout.others_of(flat.leaves)
        tensors = self.call_layout.tensors_of(flat.leaves)
        expected = self.contract.call_values(self.bound_constants, tensors)
        for value, arg, bound in zip(others, self.contract.non_tensor_args, expected):
            if arg.derived is not None and value != bound:
                return Violation(
                    "constant",
                    f"{arg.tree_path} is {value!r}, not {arg.derived.formula()} = {bound} as the graph computes it",
                )
            if arg.derived is None and not _same_constant(value, arg, bound):
                return Violation("constant", f"{arg.tree_path} is {value!r}, the contract binds {arg.value_repr}")
        for spec, tensor in zip(self.contract.inputs, tensors):
            if dtype_name(tensor.dtype) != spec.dtype:
                found = dtype_name(tensor.dtype)
                return Violation("dtype", f"input {spec.name} is {found}, the contract's is {spec.dtype}")
        shape_problem = self.shape_rule.violation(tensors)
        if shape_problem is not None:
            return Violation("shape", shape_problem)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return Violation("autograd", "an input requires grad; the backend cannot backpropagate")
        return None

    def run(self, flat: FlatTree) -> Any:
        self.calls += 1
        tensors = self.call_layout.tensors_of(flat.leaves)
        started = time.perf_counter()
        by_name = {spec.name: tensor for spec, tensor in zip(self.contract.inputs, tensors)}
        # Outputs go where the caller's tensors are (the contract's device is the capture's).
        device = tensors[0].device if tensors else torch.device(self.contract.outputs[0].device)
        names = [spec.name for spec in self.contract.outputs]
        merged = self.merged
        if isinstance(merged, DeferredChain):
            deferred = merged.call(self, by_name, device)
            if deferred is not None:
                return self._returned(by_name, deferred)
            merged = None  # this call runs its own graph
        if merged is not None and merged.first is not self:
            k = merged.member(self)
            answered = merged.answer(k, by_name)  # before the feeds: a deferred input is never computed
            if answered is not None:  # computed inside the first graph's last call
                outputs = [self._output_tensor(spec, answered, device, quiet=True) for spec in self.contract.outputs]
                merged.answered_with(k, dict(zip(names, outputs)))
                crossed = [k for k, t in enumerate(outputs) if not isinstance(t, Unfetched)]  # held: counted when read
                self.traffic.record_merged(
                    self.contract.candidate,
                    merged.first.contract.candidate,
                    [outputs[k] for k in crossed],
                    [names[k] for k in crossed],
                )
                return self._returned(by_name, outputs)
        # np.require, not np.ascontiguousarray: that one makes a 0-d value (a timestep) 1-d.
        feeds = {name: np.require(by_name[name].detach().cpu().numpy(), requirements="C") for name in self.feed_names}
        runs_merged = merged is not None and merged.first is self
        key = self.memo.key(feeds) if self.memo is not None else None
        produced = self.memo.get(key) if key is not None else None
        ran, values, resident = produced is None, None, []
        if runs_merged:
            merged.forget()  # a call answered from memory computes nothing for the later graphs
        if produced is None:
            produced, values, resident = self._launch(merged.backend if runs_merged else self.backend, by_name, feeds)
            if key is not None:
                self.memo.put(key, {name: produced[name] for name in names})
        outputs = [self._output_tensor(spec, produced, device) for spec in self.contract.outputs]
        if ran:  # a call answered from memory ran nothing and moved nothing
            self.backend_seconds.append(time.perf_counter() - started)
            if runs_merged:
                merged.keep(produced, dict(zip(names, outputs)))
            self._count(by_name, feeds, outputs, values, resident)
        return self._returned(by_name, outputs)

    def _returned(self, by_name: Mapping[str, torch.Tensor], outputs: list[torch.Tensor]) -> Any:
        """The call's result as the caller expects it (an observer of the host code is told of it)."""
        names = [spec.name for spec in self.contract.outputs]
        self.traffic.observe(
            self.contract.candidate, {n: by_name[n] for n in self.feed_names}, dict(zip(names, outputs))
        )
        return unflatten(self.output_layout.merge(outputs, self.output_constants), self.out_spec)

    def _launch(
        self, backend: SpliceBackend, by_name: Mapping[str, torch.Tensor], feeds: Mapping[str, np.ndarray]
    ) -> tuple[dict[str, Any], dict[str, Any] | None, list[str]]:
        """One backend call: (outputs as host arrays or held values, the runtime's own values when
        kept, the feeds given as such values). A merged graph's call fetches every output: the
        later members are answered from them."""
        fetch = self.fetch if backend is self.backend else None
        if self.holds_values and getattr(backend, "holds_values", False):
            values, resident = self._run_values(backend, by_name, feeds, fetch)
            return {name: _host_view(value) for name, value in values.items()}, values, resident
        return dict(backend.run(feeds, **_fetching(backend.run, fetch))), None, []

    def _count(
        self,
        by_name: Mapping[str, torch.Tensor],
        feeds: Mapping[str, np.ndarray],
        outputs: list[torch.Tensor],
        values: Mapping[str, Any] | None,
        resident: list[str],
    ) -> None:
        """The call's traffic: every feed in, and back only the outputs copied back (not those held)."""
        names = [spec.name for spec in self.contract.outputs]
        crossed = [k for k, tensor in enumerate(outputs) if not isinstance(tensor, Unfetched)]
        self.traffic.record(
            self.contract.candidate,
            [by_name[name] for name in self.feed_names],
            feeds,
            [outputs[k] for k in crossed],
            [_held(values[names[k]]) for k in crossed] if values is not None else None,
            resident,
            [names[k] for k in crossed],
        )

    @property
    def holds_values(self) -> bool:
        """Whether outputs are kept as the runtime's own values, handed on as they are to a graph
        that reads them unchanged (a backend offering `run_values`)."""
        if self._holds_values is None:
            self._holds_values = self.traffic.keep_values and bool(getattr(self.backend, "holds_values", False))
        return self._holds_values

    def _run_values(
        self,
        backend: SpliceBackend,
        by_name: Mapping[str, torch.Tensor],
        feeds: Mapping[str, np.ndarray],
        fetch: list[str] | None,
    ) -> tuple[dict[str, Any], list[str]]:
        """The call with each input that is another graph's output, unchanged, given as that graph's
        own runtime value (a device-resident hand-off); the outputs as the runtime's values."""
        bound: dict[str, Any] = dict(feeds)
        for name, array in feeds.items():
            value = self.traffic.resident_value(by_name[name])
            if value is not None and _same_buffer(value, array):
                bound[name] = value
        resident = [name for name in feeds if bound[name] is not feeds[name]]
        run_values = backend.run_values  # type: ignore[attr-defined]
        return run_values(bound, **_fetching(run_values, fetch)), resident

    def _output_tensor(
        self, spec: TensorSpec, produced: Mapping[str, Any], device: torch.device, quiet: bool = False
    ) -> torch.Tensor:
        """An output as the host sees it; a held one as an `Unfetched` placeholder (`quiet`: held by a
        widened graph's call, which holds every output, so a read is expected and only counted)."""
        if spec.name not in produced:
            raise SpliceError(
                f"{self.contract.candidate}: backend {self.backend.kind} returned no output {spec.name!r}"
            )
        value = produced[spec.name]
        if _is_held(value):
            return Unfetched(
                tuple(value.shape), torch_dtype(spec.dtype), device, value.copy_back, self._read_held(spec.name, quiet)
            )
        array = np.require(value, requirements="C")
        return torch.from_numpy(array).to(device=device, dtype=torch_dtype(spec.dtype))

    def _read_held(self, name: str, quiet: bool = False) -> Callable[[torch.Tensor], None]:
        """What happens when the host reads an output the study saw it never read: it was copied back
        then; said once per output, counted every time."""

        def read(tensor: torch.Tensor) -> None:
            self.traffic.record_late_copy(self.contract.candidate, tensor)
            if quiet:
                return
            if name not in self.held_read:
                logger.warning(
                    "%s output %s, left on the device as the study saw no host code read it, was read: "
                    "copied back now (the study's main path misses this read)",
                    self.contract.candidate,
                    name,
                )
            self.held_read.append(name)

        return read

    def stats(self) -> SpliceStats:
        kinds = Counter(event.kind for event in self.fallback_events)
        total = sum(self.backend_seconds)
        return SpliceStats(
            candidate=self.contract.candidate,
            module_path=self.contract.module_path,
            backend_kind=self.backend.kind,
            backend_device=self.backend.device,
            calls=self.calls,
            backend_calls=len(self.backend_seconds),
            fallbacks=len(self.fallback_events),
            memo_hits=self.memo.hits if self.memo is not None else 0,
            merged_hits=self.merged.answered[self.merged.member(self)] if self.merged is not None else 0,
            held_outputs_read=len(self.held_read),
            fallback_kinds=dict(kinds),
            fallback_reasons=list(dict.fromkeys(event.reason for event in self.fallback_events)),
            total_backend_seconds=total,
            mean_backend_seconds=total / len(self.backend_seconds) if self.backend_seconds else None,
        )


class MergedChain(RouteChain):
    """Graphs composed into one (`convert.compose`), each fed by the one before it: a call of the
    first runs the composed graph, and the calls of the others that follow, each given exactly
    the outputs the member before it gave (unchanged since), are answered from that call without
    a launch. A call that is not such a call runs its own graph, as before the merge."""

    def __init__(
        self,
        routes: Sequence[_Route],
        backend: SpliceBackend,
        io_maps: Sequence[Mapping[str, str]],
        prefixes: Sequence[str],
        traffic: TrafficMeter,
    ) -> None:
        super().__init__(routes)
        self.backend = backend
        self.io_maps = [dict(m) for m in io_maps]  # member k+1's input -> member k's output
        self.prefixes = list(prefixes)  # of members 1..
        self.traffic = traffic
        self.answered = [0] * len(self.routes)
        self.forget()

    def forget(self) -> None:
        self._pending: list[dict[str, np.ndarray]] = []
        self._next = 0  # the member whose call may be answered next
        self._given: dict[str, torch.Tensor] = {}

    def keep(self, produced: Mapping[str, np.ndarray], outputs: Mapping[str, torch.Tensor]) -> None:
        """The composed graph's call: every later member's outputs, waiting for its call."""
        self._pending = [
            {name[len(prefix) :]: value for name, value in produced.items() if name.startswith(prefix)}
            for prefix in self.prefixes
        ]
        self._next = 1
        self._given_by(0, outputs)

    def answer(self, k: int, by_name: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray] | None:
        """Member k's outputs if this call is the one the composed call computed them for."""
        if k != self._next or not self._pending:
            return None
        for name, given in self._given.items():
            tensor = by_name.get(name)
            produced = self.traffic.handed_output(tensor) if tensor is not None else None
            if tensor is not given or produced is None or produced.graph != self.routes[k - 1].contract.candidate:
                return None
        self.answered[k] += 1
        return self._pending[k - 1]

    def answered_with(self, k: int, outputs: Mapping[str, torch.Tensor]) -> None:
        """Member k answered with these tensors: the next member's call must be given them."""
        self._next = k + 1 if k + 1 < len(self.routes) else 0
        self._given_by(k, outputs)

    def _given_by(self, k: int, outputs: Mapping[str, torch.Tensor]) -> None:
        self._given = (
            {name: outputs[output] for name, output in self.io_maps[k].items()} if k < len(self.io_maps) else {}
        )


class SplicedModule(nn.Module):
    """Stands where the candidate stood; runs a backend for calls inside one of its contracts.

    A candidate dispatched on a non-tensor argument has one contract and backend per value (its
    routes); each call goes to the route whose contract it satisfies.
    """

    def __init__(
        self,
        original: nn.Module,
        contract: ContractSpec,
        backend: SpliceBackend,
        strategy: ShapeStrategy | None = None,
        strict: bool = False,
        traffic: TrafficMeter | None = None,
    ) -> None:
        nn.Module.__init__(self)  # not super(): in a spliced_class the next base is the model class
        self.original = original  # registered: parameters and .to() still reach it for fallbacks
        self.method = contract.method
        self.strict = strict
        self.traffic = traffic or TrafficMeter()
        self.routes: list[_Route] = [_Route(contract, backend, strategy, self.traffic)]
        self.calls = 0
        if contract.method != "forward":
            # The caller calls parent.<attribute>.<method>(...): answer that name.
            object.__setattr__(self, contract.method, self._contract_call)

    @property
    def contract(self) -> ContractSpec:
        return self.routes[0].contract

    def add_route(self, contract: ContractSpec, backend: SpliceBackend, strategy: ShapeStrategy | None = None) -> None:
        """Another graph of the same candidate, for the calls whose dispatch values it serves."""
        first = self.contract
        if (contract.module_path, contract.method) != (first.module_path, first.method):
            raise SpliceError(
                f"{contract.candidate}: {contract.module_path}.{contract.method} is not where "
                f"{first.candidate} is spliced ({first.module_path}.{first.method})"
            )
        self.routes.append(_Route(contract, backend, strategy, self.traffic))

    def __getattr__(self, name: str) -> Any:
        # Attributes the caller reads on the candidate (config, submodules) come from the original.
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if "original" not in modules:
                raise
            return getattr(modules["original"], name)

    # -- calls -----------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.method != "forward":
            self.calls += 1
            self._fall_back(self.routes[0], Violation("method", f"forward called; the contract covers {self.method}"))
            return self.original(*args, **kwargs)
        return self._contract_call(*args, **kwargs)

    def _contract_call(self, *args: Any, **kwargs: Any) -> Any:
        with self.traffic.graph_call():
            return self._served_call(*args, **kwargs)

    def _served_call(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        flat = flatten_call(args, kwargs)
        violations = [(route, route.violation(flat)) for route in self.routes]
        served = next((route for route, violation in violations if violation is None), None)
        if served is not None:
            try:
                return served.run(flat)
            except Exception as err:  # noqa: BLE001 - whatever the runtime raises, PyTorch still answers
                self._fall_back(
                    served, Violation("backend", f"the {served.backend.kind} backend failed: {one_line(err, 300)}")
                )
                return self._original_call()(*args, **kwargs)
        # The route whose dispatch values the call has explains best why none could serve it.
        route, violation = next(((r, v) for r, v in violations if v.kind != "constant"), violations[0])
        route.calls += 1
        self._fall_back(route, violation)  # type: ignore[arg-type]
        return self._original_call()(*args, **kwargs)

    def _original_call(self) -> Any:
        if self.method == "forward":
            return self.original  # through __call__, so its hooks run as usual
        return getattr(self.original, self.method)

    def _fall_back(self, route: _Route, violation: Violation) -> None:
        if self.strict:
            raise ContractViolation(
                f"{route.contract.candidate} call {self.calls} is outside its contract "
                f"({violation.kind}): {violation.reason}"
            )
        event = FallbackEvent(
            candidate=route.contract.candidate, call=self.calls, kind=violation.kind, reason=violation.reason
        )
        route.fallback_events.append(event)
        logger.warning(
            "%s call %d runs in PyTorch (fallback, %s): %s", event.candidate, event.call, event.kind, event.reason
        )

    @property
    def fallback_events(self) -> list[FallbackEvent]:
        return sorted((e for route in self.routes for e in route.fallback_events), key=lambda e: e.call)

    # -- reporting -------------------------------------------------------------------------

    def stats(self) -> list[SpliceStats]:
        return [route.stats() for route in self.routes]


# --------------------------------------------------------------------------- splice / unsplice


@dataclass
class _Replaced:
    parent: nn.Module
    attribute: str
    original: nn.Module
    spliced: SplicedModule


class SpliceHandle:
    """The splices made in one model; `unsplice()` (or leaving the `with` block) undoes them."""

    def __init__(self, root: nn.Module, strict: bool = False, resident: bool = True) -> None:
        self.root = root
        self.strict = strict
        self._replaced: list[_Replaced] = []  # in place now
        self._spliced: list[SplicedModule] = []  # every splice made, kept for stats after unsplice
        # Every backend call of every splice, by step: give `traffic.step_done` to the run's hooks.
        self.traffic = TrafficMeter(keep_values=resident)

    @property
    def modules(self) -> dict[str, SplicedModule]:
        """Graph name -> the spliced module serving it (dispatched graphs share one)."""
        return {route.contract.candidate: spliced for spliced in self._spliced for route in spliced.routes}

    def stats(self) -> list[SpliceStats]:
        return [stats for spliced in self._spliced for stats in spliced.stats()]

    def fallbacks(self) -> list[FallbackEvent]:
        return [event for spliced in self._spliced for event in spliced.fallback_events]

    def add(
        self, contract: ContractSpec, backend: SpliceBackend, strategy: ShapeStrategy | None = None
    ) -> SplicedModule:
        parent = _submodule(self.root, contract.parent_path, contract)
        original = getattr(parent, contract.attribute, None)
        where = f"{contract.candidate}: {contract.parent_path or '<root>'}.{contract.attribute}"
        if isinstance(original, SplicedModule):
            # Another graph of a candidate dispatched on a non-tensor argument joins its splice.
            same = (
                contract.dispatch
                and original.contract.dispatch
                and original.contract.plan_candidate == contract.plan_candidate
            )
            if not same or original not in self._spliced:
                raise SpliceError(f"{where} is already spliced")
            original.add_route(contract, backend, strategy)
            return original
        if not isinstance(original, nn.Module):
            raise SpliceError(f"{where} is not a module (found {type(original).__name__})")
        if not _is_class(original, contract.module_class):
            found = type(original).__qualname__
            raise SpliceError(f"{where} is a {found}, the contract is for {contract.module_class}")
        spliced = spliced_class(type(original))(original, contract, backend, strategy, self.strict, self.traffic)
        setattr(parent, contract.attribute, spliced)
        self._replaced.append(_Replaced(parent, contract.attribute, original, spliced))
        self._spliced.append(spliced)
        return spliced

    def merge(
        self,
        graphs: Sequence[str],
        backend: SpliceBackend,
        io_maps: Sequence[Mapping[str, str]],
        prefixes: Sequence[str],
        recipes: Sequence[Mapping[str, str] | None] = (),
        slots: Sequence[Sequence[SlotUse]] = (),
    ) -> None:
        """Serve `graphs`, in that order, by one call of `backend`, their composition: its outputs
        are the first graph's, then each later one's with its prefix (`prefixes`, one per later
        graph); `io_maps[k]`: graph k+1's input -> graph k's output. For a widened boundary,
        `recipes[k]`: graph k+1's input -> the digest of the host code computing it, and `slots[k]`
        what those recipes rest on (`splicing.deferred_chain`)."""
        routes = {route.contract.candidate: route for spliced in self._spliced for route in spliced.routes}
        where = f"merge {' + '.join(graphs)}"
        if missing := [name for name in graphs if name not in routes]:
            raise SpliceError(f"{where}: {', '.join(missing)} not spliced")
        if len(graphs) < 2 or len(io_maps) != len(graphs) - 1 or len(prefixes) != len(graphs) - 1:
            raise SpliceError(f"{where}: two graphs or more, with a map and a prefix for each after the first")
        chain = [routes[name] for name in graphs]
        if taken := [r.contract.candidate for r in chain if r.merged is not None]:
            raise SpliceError(f"{where}: {', '.join(taken)} already in a merge (a graph takes part in one at most)")
        produced = {io.name for io in backend.outputs}
        wanted = [spec.name for spec in chain[0].contract.outputs]
        wanted += [prefix + spec.name for prefix, route in zip(prefixes, chain[1:]) for spec in route.contract.outputs]
        if missing := [name for name in wanted if name not in produced]:
            raise SpliceError(f"{where}: backend {backend.kind} has no output(s) {missing}")
        if recipes and len(recipes) != len(io_maps):
            raise SpliceError(f"{where}: a recipe map (or None) for each link, or none at all")
        if any(recipes):
            merged = DeferredChain(chain, backend, io_maps, recipes, slots, self.traffic)
        else:
            merged = MergedChain(chain, backend, io_maps, prefixes, self.traffic)
        for route in chain:
            route.merged = merged

    def unsplice(self) -> None:
        """Put every original module object back, last splice first."""
        while self._replaced:
            replaced = self._replaced.pop()
            setattr(replaced.parent, replaced.attribute, replaced.original)

    def __enter__(self) -> SpliceHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.unsplice()


def _fetching(run: Callable[..., Any], fetch: list[str] | None) -> dict[str, Any]:
    """`fetch` as the keyword `run` takes, when there is a subset to ask for and `run` takes it: a
    runner written before `fetch` existed copies every output back, and is counted so."""
    if fetch is None:
        return {}
    try:
        parameters = inspect.signature(run).parameters.values()
    except (TypeError, ValueError):
        return {}
    takes = any(p.name == "fetch" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    return {"fetch": fetch} if takes else {}


def _host_view(value: Any) -> Any:
    """A runtime value as the host array viewing it (no copy); an array (a call joined from
    chunks on the host) or an output held on the device as it is."""
    return value if isinstance(value, np.ndarray) or _is_held(value) else value.numpy()


def _held(value: Any) -> Any:
    """The runtime's own value to hand on, or None for a host array (nothing held in the runtime)."""
    return None if isinstance(value, np.ndarray) or _is_held(value) else value


def _same_buffer(value: Any, array: np.ndarray) -> bool:
    """Whether a runtime value holds exactly `array`: the same memory, dtype and shape."""
    view = value.numpy()
    return view.dtype == array.dtype and view.shape == array.shape and view.ctypes.data == array.ctypes.data


def _submodule(root: nn.Module, path: str, contract: ContractSpec) -> nn.Module:
    try:
        return root.get_submodule(path)
    except AttributeError:
        raise SpliceError(
            f"{contract.candidate}: parent_path {path!r} is not a submodule of {type(root).__name__}"
        ) from None


def _is_class(module: nn.Module, module_class: str) -> bool:
    cls = type(module)
    full = f"{cls.__module__}.{cls.__qualname__}"
    return module_class in (full, cls.__qualname__, cls.__name__) or portable_class_name(module_class) == (
        portable_class_name(full)
    )


def splice(
    root: nn.Module,
    replacements: Sequence[tuple[ContractSpec, SpliceBackend]],
    *,
    strategies: Mapping[str, ShapeStrategy] | None = None,
    strict: bool = False,
    resident: bool = True,
) -> SpliceHandle:
    """Replace each contract's candidate in `root` by a module running its backend.

    strategies: candidate -> the shape strategy its artifact was built for (optional); without one
    the contract's observed shapes are the ones allowed. All or nothing: if one splice fails,
    those already made are undone before the error is raised. `strict`: a call outside the contracts
    raises ContractViolation instead of running the original module. `resident`: a graph output
    another graph reads unchanged is handed on as the runtime's own value where the backends
    offer it (`run_values`), not as a host array.
    """
    strategies = strategies or {}
    handle = SpliceHandle(root, strict, resident)
    try:
        for contract, backend in replacements:
            handle.add(contract, backend, strategies.get(contract.candidate))
    except BaseException:
        handle.unsplice()
        raise
    return handle
