"""The host code between deployed graphs: captured from a spliced run, one consumer call at a time.

While the recorder is on, every torch operation that reads a value derived from a graph's outputs
is recorded with what it read (operations on other tensors are not the glue). At each graph call,
the graph whose call came last among those its inputs derive from is the hop's producer; each input
is walked back to the producer's outputs. What it rests on that is not the producer's output is a
slot: a tensor no graph made (a weight, a constant, a user input) or a value computed before the
producer's call (another graph's output, glue on it). A slot whose values are the same in every
call is a constant of the glue; the others are inputs a widened graph is fed.

Each input's recipe has a digest (`contracts.recipes`) over the operations, their Python arguments,
the producer outputs and the slots' dtypes and shapes, so calls whose host code did the same thing
have the same digest whatever the values. Reads of the producer's derived values into Python (an
`.item()`, a `bool()`, a NumPy copy) and operations whose output shape comes from values are noted:
a graph of fixed shapes cannot hold that code. The first call of each hop keeps what it takes to
replay it as a graph of its own (`boundary.glue_graph`).
"""

from __future__ import annotations

import sys
import time
import weakref
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from omskills.contracts.provenance import _shallow_tensors
from omskills.contracts.reads import function_name, reads_values, writes_in_place
from omskills.contracts.recipes import (
    PLAIN_ARGUMENTS,
    canonical,
    deep_recipes,
    op_digest,
    output_digest,
    slot_digest,
    value_digest,
)
from torch.overrides import TorchFunctionMode

# Operations whose result's shape comes from the values: a graph of fixed shapes cannot hold them.
DATA_DEPENDENT_SHAPES = frozenset(
    {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount", "nms", "batched_nms"}
)
# What gives Python a tensor's values: code after it may branch on them.
PYTHON_READS = frozenset(
    {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "numpy", "__array__",
     "equal", "allclose", "is_nonzero", "__contains__", "__hash__"}
)  # fmt: skip
# What a step's derived tensors may hold on to so a hop can be replayed (a value dropped by the host is
# kept alive until the step ends, the oldest let go first beyond this). A hop whose values are gone is
# not replayed, and says so.
KEPT_BYTES = 2 << 30
_HERE = str(Path(__file__).resolve().parents[1])
_TORCH = str(Path(torch.__file__).resolve().parent)

FlagKind = Literal["data-dependent", "python-state"]


@dataclass(frozen=True)
class Ref:
    """A tensor derived from graph outputs, by its node in the recording."""

    node: int


@dataclass(frozen=True)
class Const:
    """A tensor the glue reads that no graph made (a parameter, a constant, state), by its value."""

    value: int


@dataclass
class GlueOp:
    """One recorded torch operation that read a derived tensor."""

    func: Callable[..., Any]
    name: str
    args: Any  # (args, kwargs) with tensors replaced by Ref / Const
    results: list[int]  # the nodes of its tensor results, in flat order (an in-place target last)
    site: str
    ms: float
    touched: int  # bytes read and written
    flag: tuple[FlagKind, str] | None = None  # why no graph can hold it


@dataclass(frozen=True)
class Root:
    """A graph output, as the recording first saw it."""

    graph: str
    output: str
    serial: int  # the producing call's number (over every graph call of the run)


@dataclass
class Slot:
    """Something a consumer's inputs rest on that is not the producer's output."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    value: str | None  # its value digest; None for a value computed before the producer's call
    nbytes: int
    key: tuple[str, int | str]  # ("node", n), ("const", v) or ("input", name): where the replay finds it
    # For a value computed before the producer's call that is an earlier call's output, or what an
    # earlier call was given: "output:<graph>/<name>" or "input:<graph>/<name>" (a chain composing
    # that graph computes it inside).
    source: str | None = None

    @property
    def digest(self) -> str:
        return slot_digest(self.dtype, self.shape)


@dataclass
class Observation:
    """One consumer call: its producer, each input's recipe and slots, and the cost of its glue."""

    step: int | None
    consumer: str
    serial: int  # this call's number
    producer: str | None = None  # the graph called last among those its inputs derive from
    producer_serial: int = 0
    recipes: dict[str, str] = field(default_factory=dict)  # input -> digest (slots by dtype and shape)
    glued: list[str] = field(default_factory=list)  # inputs computed by host code from the producer's outputs
    passed: list[str] = field(default_factory=list)  # inputs that are the producer's outputs, unchanged
    slots: list[Slot] = field(default_factory=list)  # in the recipes' traversal order
    nbytes: dict[str, int] = field(default_factory=dict)
    reads: list[str] = field(default_factory=list)  # the producer's derived values read into Python before it
    flags: list[tuple[FlagKind, str]] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    sites: list[str] = field(default_factory=list)
    ms: float = 0.0
    touched: int = 0
    read_back: list[int] = field(default_factory=list)  # bytes of each producer output its inputs rest on
    program: Program | None = None  # the first call of a hop keeps what it takes to replay it

    @property
    def hop(self) -> bool:
        """Whether host code stands between the producer and this call: an input computed from its
        outputs, or one that is not its output next to one that is (all its outputs unchanged is a
        plain merge)."""
        return bool(self.glued) or 0 < len(self.passed) < len(self.nbytes)


@dataclass
class Program:
    """A hop's glue ready to replay: the ops in order (those since the producer's call), the values
    they read, the producer outputs and slots it starts from, and copies of one call's values."""

    producer: str
    ops: list[GlueOp]
    values: dict[int, torch.Tensor]  # Const index -> a copy
    roots: dict[int, str]  # node -> the producer output it is
    slots: list[Slot]
    outputs: dict[str, int | str]  # consumer input -> its node, or ("input") the slot key's name
    root_samples: dict[str, torch.Tensor]  # producer output -> a copy
    slot_samples: list[torch.Tensor]
    input_samples: dict[str, torch.Tensor]  # consumer input -> a copy


class GlueRecorder(TorchFunctionMode):
    """Records the host operations on graph outputs during a spliced run (see the module docstring).

    The splice tells it of each graph call (`graph_call`) and marks the calls in progress (`inside`):
    what a runtime does to bring outputs back is not glue."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = 0
        self.serial = 0
        self.steps = 0  # steps the driver reported
        self.error: str | None = None  # why the capture stopped before the run's end
        self.calls: dict[str, list[int]] = defaultdict(list)  # graph -> serials of its calls
        self.observations: list[Observation] = []
        self._kept: set[tuple[str, str, tuple]] = set()
        self._tensors: dict[int, tuple[weakref.ref, int]] = {}  # id(tensor) -> (its weak ref, its node)
        self._node_of_op: dict[int, tuple[int, int]] = {}  # node -> (op index, position)
        self._born: dict[int, int] = {}  # node -> the number of graph calls made before it
        self._meta: dict[int, tuple[torch.dtype, tuple[int, ...], int]] = {}
        self._roots: dict[int, Root] = {}
        self._node_calls: dict[int, frozenset[tuple[str, int]]] = {}  # node -> the calls it derives from
        self._given: dict[int, str] = {}  # node -> "input:<graph>/<name>" of the last call given it
        self._ops: list[GlueOp] = []
        self._values: dict[int, torch.Tensor] = {}
        self._value_ids: dict[tuple, tuple[weakref.ref, int]] = {}
        self._value_digests: dict[int, str] = {}
        self._step_tensors: deque[torch.Tensor] = deque()  # this step's derived tensors, kept to replay a hop
        self._kept_bytes = 0
        self._reads: list[tuple[set[tuple[str, int]], str]] = []  # (graph calls read from, what and where)
        self._next_node = 0

    # ------------------------------------------------------------------ events from the splice

    def graph_call(self, graph: str, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor]) -> None:
        """A call of `graph` with these inputs (by name) returned these outputs (by name)."""
        self.serial += 1
        self.calls[graph].append(self.serial)
        if self.error is None:
            try:
                with deep_recipes():
                    self.observations.append(self._observe(graph, inputs))
            except Exception as err:  # noqa: BLE001 - the capture stops; the run and its counts go on
                self.error = f"{graph} call {self.serial}: {type(err).__name__}: {str(err)[:200]}"
        for name, tensor in inputs.items():
            if (node := self._node(tensor)) is not None:
                self._given[node] = f"input:{graph}/{name}"
        for name, tensor in outputs.items():
            if isinstance(tensor, torch.Tensor):
                node = self._new_node(tensor)
                self._roots[node] = Root(graph, name, self.serial)
                self._node_calls[node] = frozenset({(graph, self.serial)})

    def step_done(self, index: int) -> None:
        """Step `index` ended. Its operations are forgotten (a tensor the host keeps across steps is
        a slot from then on); graph outputs stay graph outputs while they live."""
        self.steps += 1
        for observation in self.observations:
            if observation.step is None:
                observation.step = index
        self._tensors = {key: entry for key, entry in self._tensors.items() if entry[1] in self._roots}
        self._given.clear()
        self._node_of_op.clear()
        self._node_calls = {node: calls for node, calls in self._node_calls.items() if node in self._roots}
        self._ops = []
        self._values = {}
        self._value_ids.clear()
        self._value_digests.clear()
        self._step_tensors, self._kept_bytes = deque(), 0
        self._reads.clear()

    # ------------------------------------------------------------------ recording

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.inside:
            return func(*args, **kwargs)
        read = _shallow_tensors((args, kwargs))
        derived = [node for t in read if (node := self._node(t)) is not None]
        if not derived or not reads_values(func):
            return func(*args, **kwargs)
        started = time.perf_counter()
        out = func(*args, **kwargs)
        ms = (time.perf_counter() - started) * 1e3
        name = function_name(func)
        results = _shallow_tensors(out)
        if not results and not writes_in_place(name, kwargs):
            if name in PYTHON_READS:
                self._read_into_python(name, derived)
            return out
        try:
            self._record(func, name, args, kwargs, read, results, ms)
        except Exception as err:  # noqa: BLE001 - a recording must never change the run
            self._ops.append(GlueOp(func, name, None, [], _site(), ms, 0, ("python-state", f"not recorded: {err}")))
        return out

    def _record(
        self,
        func: Any,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        read: list[torch.Tensor],
        results: list[torch.Tensor],
        ms: float,
    ) -> None:
        template = self._template((args, kwargs))
        flag = _flag(name, args, kwargs, template)
        written = []
        if writes_in_place(name, kwargs):
            target = kwargs.get("out") if kwargs.get("out") is not None else (args[0] if args else None)
            written = [t for t in _shallow_tensors(target) if all(t is not r for r in results)]
            if any(t._base is not None for t in [*written, *results[:1]]):
                flag = flag or ("python-state", f"{name} writes in place through a view")
        index = len(self._ops)
        touched = sum(int(t.nbytes) for t in read) + sum(int(t.nbytes) for t in results)
        calls = frozenset().union(*(self._calls_of(ref.node) for ref in _refs(template)))
        nodes = []
        for tensor in [*results, *written]:  # a written tensor is a new value from now on
            node = self._new_node(tensor)
            self._node_of_op[node] = (index, len(nodes))
            self._node_calls[node] = calls
            nodes.append(node)
        self._ops.append(GlueOp(func, name, template, nodes, _site(), ms, touched, flag))

    def _read_into_python(self, name: str, nodes: list[int]) -> None:
        calls = frozenset().union(*(self._calls_of(node) for node in nodes))
        self._reads.append((set(calls), f"{name} at {_site()}"))

    def _template(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            node = self._node(value)
            return Ref(node) if node is not None else Const(self._value_id(value))
        if isinstance(value, (list, tuple)):
            items = [self._template(v) for v in value]
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        if isinstance(value, dict):
            return {k: self._template(v) for k, v in value.items()}
        return value

    def _value_id(self, tensor: torch.Tensor) -> int:
        """A copy of a tensor no graph made, taken once per tensor and version (a weight read by every
        call is copied once)."""
        version = None if tensor.is_inference() else tensor._version
        key = (id(tensor), version)
        found = self._value_ids.get(key)
        if found is not None and found[0]() is tensor:
            return found[1]
        index = len(self._values)
        self._values[index] = tensor.detach().clone()
        if version is not None:
            self._value_ids[key] = (weakref.ref(tensor), index)
        return index

    def _new_node(self, tensor: torch.Tensor) -> int:
        node = self._next_node
        self._next_node += 1
        self._tensors[id(tensor)] = (weakref.ref(tensor), node)
        self._born[node] = self.serial
        self._meta[node] = (tensor.dtype, tuple(tensor.shape), int(tensor.nbytes))
        self._step_tensors.append(tensor)
        self._kept_bytes += int(tensor.nbytes)
        while (
            self._kept_bytes > KEPT_BYTES and self._step_tensors
        ):  # the oldest go first: the next call needs the newest
            self._kept_bytes -= int(self._step_tensors.popleft().nbytes)
        return node

    def _node(self, tensor: torch.Tensor) -> int | None:
        entry = self._tensors.get(id(tensor))
        if entry is None or entry[0]() is not tensor:
            return None
        return entry[1]

    def _calls_of(self, node: int) -> frozenset[tuple[str, int]]:
        """The graph calls (graph, call number) whose outputs `node` was computed from."""
        return self._node_calls.get(node, frozenset())

    # ------------------------------------------------------------------ one consumer call

    def _observe(self, consumer: str, inputs: Mapping[str, torch.Tensor]) -> Observation:
        seen = Observation(step=None, consumer=consumer, serial=self.serial)
        nodes = {name: self._node(tensor) for name, tensor in inputs.items()}
        calls = frozenset().union(*(self._calls_of(node) for node in nodes.values() if node is not None))
        if not calls:
            return seen  # no input derives from a graph's outputs: no hop ends here
        producer, serial = max(calls, key=lambda call: call[1])
        seen.producer, seen.producer_serial = producer, serial
        walk = _HopWalk(self, producer, serial)
        for name in sorted(inputs):
            tensor, node = inputs[name], nodes[name]
            seen.nbytes[name] = int(tensor.nbytes)
            seen.recipes[name] = walk.input_digest(name, tensor, node)
            if node is not None and walk.is_root(node):
                seen.passed.append(name)
            elif node is not None and node not in walk.slot_nodes:
                seen.glued.append(name)
        seen.slots = walk.slots
        seen.read_back = [self._meta[node][2] for node in walk.used_roots]
        for index in sorted(walk.ops):
            op = self._ops[index]
            seen.ops.append(op.name)
            seen.sites.append(op.site)
            seen.ms += op.ms
            seen.touched += op.touched
            if op.flag:
                seen.flags.append((op.flag[0], f"{op.flag[1]} ({op.site})"))
        seen.reads = [what for read, what in self._reads if (producer, serial) in read]
        for index in sorted(walk.late_ops - walk.ops):  # host code after the call the inputs also rest on
            op = self._ops[index]
            if op.flag:
                seen.flags.append((op.flag[0], f"{op.flag[1]} ({op.site}, on values it also reads)"))
        key = (consumer, producer, tuple(sorted(seen.recipes.items())))  # one program per way of computing
        if seen.hop and key not in self._kept:
            self._kept.add(key)
            seen.program = walk.program(seen, inputs)
        return seen


class _HopWalk:
    """The walk back from one consumer call's inputs to its producer's outputs: digests, slots, ops."""

    def __init__(self, recorder: GlueRecorder, producer: str, serial: int) -> None:
        self.rec, self.producer, self.serial = recorder, producer, serial
        self.slots: list[Slot] = []
        self.slot_nodes: dict[int, int] = {}  # node -> slot index
        self.slot_consts: dict[int, int] = {}  # Const index -> slot index
        self.ops: set[int] = set()
        self.used_roots: set[int] = set()
        self.late_ops: set[int] = set()
        self._digests: dict[int, str] = {}
        self._depending: dict[int, bool] = {}

    def is_root(self, node: int) -> bool:
        root = self.rec._roots.get(node)
        return root is not None and (root.graph, root.serial) == (self.producer, self.serial)

    def input_digest(self, name: str, tensor: torch.Tensor, node: int | None) -> str:
        if node is not None:
            return self._node_digest(node)
        index = self._add_slot(tensor.dtype, tuple(tensor.shape), value_digest(tensor), int(tensor.nbytes))
        self.slots[index].key = ("input", name)
        return self.slots[index].digest

    def _node_digest(self, node: int) -> str:
        cached = self._digests.get(node)
        if cached is not None:
            return cached
        made = self.rec._node_of_op.get(node)
        if self.is_root(node):
            self.used_roots.add(node)
            digest = output_digest(self.producer, self.rec._roots[node].output)
        elif not self._depends(node):  # made before the producer's call, or without its outputs
            dtype, shape, nbytes = self.rec._meta[node]
            index = self._add_slot(dtype, shape, None, nbytes)
            self._late(node)
            root = self.rec._roots.get(node)
            self.slots[index].key = ("node", node)
            self.slots[index].source = f"output:{root.graph}/{root.output}" if root else self.rec._given.get(node)
            self.slot_nodes[node] = index
            digest = self.slots[index].digest
        else:
            index, position = made
            self.ops.add(index)
            op = self.rec._ops[index]
            digest = op_digest(op.name, position, canonical(op.args, self._leaf))
        self._digests[node] = digest
        return digest

    def _late(self, node: int) -> None:
        """The ops made after the producer's call on the way to a slot: host code between the calls
        that the inputs rest on, though not on the producer's outputs."""
        todo = [node]
        while todo:
            current = todo.pop()
            made = self.rec._node_of_op.get(current)
            if made is None or made[0] in self.late_ops or self.rec._born[current] < self.serial:
                continue
            self.late_ops.add(made[0])
            todo += [r.node for r in _refs(self.rec._ops[made[0]].args)]

    def _depends(self, node: int) -> bool:
        """Whether `node` was computed from this call of the producer (what the host computes apart
        from it is a slot, whenever it was made)."""
        if node not in self._depending:
            made = self.rec._node_of_op.get(node)
            self._depending[node] = self.is_root(node) or (
                made is not None
                and self.rec._born[node] >= self.serial
                and any(self._depends(r.node) for r in _refs(self.rec._ops[made[0]].args))
            )
        return self._depending[node]

    def _leaf(self, value: Any) -> str | None:
        if isinstance(value, Ref):
            return self._node_digest(value.node)
        if isinstance(value, Const):
            if value.value not in self.slot_consts:
                tensor = self.rec._values[value.value]
                digest = self.rec._value_digests.get(value.value) or value_digest(tensor)
                self.rec._value_digests[value.value] = digest
                index = self._add_slot(tensor.dtype, tuple(tensor.shape), digest, int(tensor.nbytes))
                self.slots[index].key = ("const", value.value)
                self.slot_consts[value.value] = index
            return self.slots[self.slot_consts[value.value]].digest
        return None

    def _add_slot(self, dtype: torch.dtype, shape: tuple[int, ...], value: str | None, nbytes: int) -> int:
        self.slots.append(Slot(dtype, shape, value, nbytes, ("", 0), None))
        return len(self.slots) - 1

    def program(self, seen: Observation, inputs: Mapping[str, torch.Tensor]) -> Program | None:
        live = {node: t for ref, node in self.rec._tensors.values() if (t := ref()) is not None}
        live |= {node: t for t in self.rec._step_tensors if (node := self.rec._node(t)) is not None}
        roots = {n: self.rec._roots[n].output for n in self.used_roots}
        samples: list[torch.Tensor] = []
        for slot in self.slots:
            kind, key = slot.key
            tensor = live.get(key) if kind == "node" else self.rec._values.get(key) if kind == "const" else inputs[key]
            if tensor is None:
                return None  # a value it starts from is gone: nothing to replay
            samples.append(tensor.detach().clone())
        outputs: dict[str, int | str] = {}
        for name in inputs:
            node = self.rec._node(inputs[name])
            outputs[name] = node if node is not None else name
        return Program(
            producer=self.producer,
            ops=[self.rec._ops[i] for i in sorted(self.ops)],
            values={i: v for i, v in self.rec._values.items()},
            roots=roots,
            slots=list(self.slots),
            outputs=outputs,
            root_samples={name: live[n].detach().clone() for n, name in roots.items() if n in live},
            slot_samples=samples,
            input_samples={name: t.detach().clone() for name, t in inputs.items()},
        )


def _refs(value: Any) -> list[Ref]:
    if isinstance(value, Ref):
        return [value]
    if isinstance(value, (list, tuple)):
        return [r for v in value for r in _refs(v)]
    if isinstance(value, dict):
        return [r for v in value.values() for r in _refs(v)]
    return []


def _flag(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], template: Any) -> tuple[FlagKind, str] | None:
    """Why no graph of fixed shapes can hold this op, or None."""
    if name in DATA_DEPENDENT_SHAPES or (name == "where" and len(args) == 1 and not kwargs):
        return "data-dependent", f"{name} makes a shape from values"
    if name in ("__getitem__", "__setitem__", "index_select", "index"):
        index = args[1] if len(args) > 1 else None
        if any(t.dtype == torch.bool for t in _shallow_tensors(index)):
            return "data-dependent", f"{name} with a boolean mask makes a shape from values"
    odd = _odd_arguments(template)
    return ("python-state", f"{name} takes a {odd}") if odd else None


def _odd_arguments(value: Any) -> str | None:
    if isinstance(value, (Ref, Const, slice, *PLAIN_ARGUMENTS)) or value is Ellipsis:
        return None
    if isinstance(value, (list, tuple)):
        return next((odd for v in value if (odd := _odd_arguments(v))), None)
    if isinstance(value, dict):
        return next((odd for v in value.values() if (odd := _odd_arguments(v))), None)
    if callable(value):
        return None  # a function argument is code, replayed as it is
    return type(value).__qualname__


def _site() -> str:
    """The innermost frame outside torch and this package: the host code that ran the op."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith((_TORCH, _HERE)) and not filename.startswith("<"):
            return f"{Path(filename).name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"
