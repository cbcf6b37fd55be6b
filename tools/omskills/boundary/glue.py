"""The host code between deployed graphs: captured from a spliced run, one hop at a time.

A hop is a pair of graphs where host code takes the first one's outputs (the producer) and computes
some of the next one's inputs (the consumer) from them: a reshape, a scale, a concatenation with a
constant. While the recorder is on, every torch operation that reads a value derived from a graph's
outputs is recorded with what it read; operations on other tensors are not (they are not the
glue). At a graph call, each input's recipe is walked back to the graph outputs it came from. The
recipe has a digest (operations, their Python arguments and the values of the tensors they read
that no graph made), so calls whose host code did the same thing have the same digest.

Per hop the capture decides whether the glue can go into a graph: only torch operations on the
producer's outputs and constants, the same in every call, with no value read into Python (an
`.item()`, a `bool()`, a shape made from values) between the producer's call and the consumer's.
The first call's recipe is kept, with the values it read, to be replayed as a graph of its own
(`convert.glue_graph`).
"""

from __future__ import annotations

import sys
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omskills.contracts.provenance import _shallow_tensors, _writes_in_place
from omskills.contracts.reads import function_name, reads_values
from omskills.contracts.recipes import PLAIN_ARGUMENTS, canonical, op_digest, output_digest, value_digest
from torch.overrides import TorchFunctionMode

# Operations whose result's shape comes from the values: a graph of fixed shapes cannot hold them.
DATA_DEPENDENT_SHAPES = frozenset(
    {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount", "nms", "batched_nms"}
)
# Printing reads values but decides nothing.
_PRINTING = frozenset({"__repr__", "__str__", "__format__"})
_HERE = str(Path(__file__).resolve().parents[1])
_TORCH = str(Path(torch.__file__).resolve().parent)


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
    results: list[int]  # the nodes of its tensor results, in flat order
    site: str
    ms: float
    touched: int  # bytes read and written
    flag: str | None = None  # why no graph can hold it


@dataclass
class Root:
    """A graph output, as the recording first saw it."""

    graph: str
    output: str
    serial: int  # the producing call's number (over every graph call of the run)


@dataclass
class Recipe:
    """How the host made one consumer input from graph outputs: its node and what it rests on."""

    node: int
    digest: str
    ops: list[int]  # indices of the ops it takes, in order
    roots: list[Root]


@dataclass
class Observation:
    """One consumer call: each input's origin, the glue that computed it, and its cost."""

    step: int | None
    consumer: str
    serial: int  # this call's number
    passed: dict[str, Root] = field(default_factory=dict)  # inputs that are a graph output unchanged
    glued: dict[str, Recipe] = field(default_factory=dict)
    host: dict[str, str] = field(default_factory=dict)  # inputs no graph output made -> their value digest
    nbytes: dict[str, int] = field(default_factory=dict)
    reads: list[str] = field(default_factory=list)  # values of graph outputs read into Python before the call
    flags: list[str] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    sites: list[str] = field(default_factory=list)
    ms: float = 0.0
    touched: int = 0
    program: Program | None = None  # the first observation of a hop keeps what it takes to replay it


@dataclass
class Program:
    """What a consumer's glue computes, ready to replay: the ops in order, the values they read, and
    a copy of the graph outputs it read and of the inputs it made (to export and check a graph)."""

    ops: list[GlueOp]
    values: dict[int, torch.Tensor]
    roots: dict[int, Root]  # node -> the graph output it is
    outputs: dict[str, int | torch.Tensor]  # consumer input -> its node, or a constant value
    root_samples: dict[str, torch.Tensor]  # "<graph>/<output>" -> a copy
    input_samples: dict[str, torch.Tensor]  # consumer input -> a copy


class GlueRecorder(TorchFunctionMode):
    """Records the host operations on graph outputs during a spliced run (see the module docstring).

    The splice tells it about each graph call (`graph_call`) and marks the calls themselves
    (`inside_graph`): what a runtime does to bring outputs back is not glue."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = 0
        self.step: int | None = None
        self.serial = 0
        self.calls: dict[str, list[int]] = defaultdict(list)  # graph -> serials of its calls
        self.observations: list[Observation] = []
        self._kept: set[tuple[str, frozenset[str]]] = set()
        self._tensors: dict[int, tuple[weakref.ref, int]] = {}  # id(tensor) -> (its weak ref, its node)
        self._node_of_op: dict[int, tuple[int, int]] = {}  # node -> (op index, position)
        self._roots: dict[int, Root] = {}
        self._ops: list[GlueOp] = []
        self._values: dict[int, torch.Tensor] = {}
        self._value_ids: dict[tuple, tuple[weakref.ref, int]] = {}
        self._digests: dict[int, str] = {}
        self._value_digests: dict[int, str] = {}
        self._reads: list[tuple[int, set[int], str]] = []  # (serial, root serials, what and where)
        self._next_node = 0

    # ------------------------------------------------------------------ events from the splice

    def graph_call(self, graph: str, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor]) -> None:
        """A call of `graph` with these inputs (by name) returned these outputs (by name)."""
        self.serial += 1
        self.calls[graph].append(self.serial)
        self.observations.append(self._observe(graph, inputs))
        for name, tensor in outputs.items():
            if isinstance(tensor, torch.Tensor):
                node = self._new_node(tensor)
                self._roots[node] = Root(graph, name, self.serial)

    def step_done(self, index: int) -> None:
        """Step `index` ended. Its operations are forgotten (a tensor the host keeps across steps is
        state from then on); graph outputs stay graph outputs while they live."""
        for observation in self.observations:
            if observation.step is None:
                observation.step = index
        self._tensors = {key: entry for key, entry in self._tensors.items() if entry[1] in self._roots}
        self._node_of_op.clear()
        self._ops = []
        self._values = {}
        self._value_ids.clear()
        self._digests = {node: d for node, d in self._digests.items() if node in self._roots}
        self._value_digests.clear()
        self._reads.clear()

    # ------------------------------------------------------------------ recording

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.inside:
            return func(*args, **kwargs)
        read = _shallow_tensors((args, kwargs))
        derived = [self._node(t) for t in read]
        if not any(node is not None for node in derived) or not reads_values(func):
            return func(*args, **kwargs)
        started = time.perf_counter()
        out = func(*args, **kwargs)
        ms = (time.perf_counter() - started) * 1e3
        name = function_name(func)
        results = _shallow_tensors(out)
        if not results and not _writes_in_place(name, kwargs):
            if name not in _PRINTING:
                self._read_into_python(name, [n for n in derived if n is not None])
            return out
        try:
            self._record(func, name, args, kwargs, read, results, ms)
        except Exception as err:  # noqa: BLE001 - a recording must never change the run
            self._ops.append(GlueOp(func, name, None, [], _site(), ms, 0, f"not recorded: {err}"))
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
        if _writes_in_place(name, kwargs):
            target = kwargs.get("out") if kwargs.get("out") is not None else (args[0] if args else None)
            written = _shallow_tensors(target)
            if any(t._base is not None for t in written):
                flag = flag or f"{name} writes in place through a view"
        index = len(self._ops)
        touched = sum(int(t.nbytes) for t in read) + sum(int(t.nbytes) for t in results)
        nodes = []
        for position, tensor in enumerate(results):
            node = self._new_node(tensor)
            self._node_of_op[node] = (index, position)
            nodes.append(node)
        for tensor in written:  # the written tensor is a new value from now on
            if all(tensor is not r for r in results):
                node = self._new_node(tensor)
                self._node_of_op[node] = (index, len(nodes))
                nodes.append(node)
        self._ops.append(GlueOp(func, name, template, nodes, _site(), ms, touched, flag))

    def _read_into_python(self, name: str, nodes: list[int]) -> None:
        roots = {root.serial for node in nodes for root in self._roots_of(node)}
        self._reads.append((self.serial, roots, f"{name} at {_site()}"))

    def _template(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            node = self._node(value)
            return Ref(node) if node is not None else Const(self._value_id(value))
        if isinstance(value, (list, tuple)):
            items = [self._template(v) for v in value]
            return type(value)(items) if not hasattr(value, "_fields") else type(value)(*items)
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
        return node

    def _node(self, tensor: torch.Tensor) -> int | None:
        entry = self._tensors.get(id(tensor))
        if entry is None or entry[0]() is not tensor:
            return None
        return entry[1]

    # ------------------------------------------------------------------ what a consumer's inputs rest on

    def _observe(self, consumer: str, inputs: Mapping[str, torch.Tensor]) -> Observation:
        seen = Observation(step=None, consumer=consumer, serial=self.serial)
        ops: set[int] = set()
        nodes = {name: self._node(tensor) for name, tensor in inputs.items()}
        for name, tensor in inputs.items():
            seen.nbytes[name] = int(tensor.nbytes)
            node = nodes[name]
            if node is None:
                if any(n is not None for n in nodes.values()):  # only a hop's consumer needs them
                    seen.host[name] = value_digest(tensor)
            elif node in self._roots:
                seen.passed[name] = self._roots[node]
            else:
                taken = self._slice(node)
                seen.glued[name] = Recipe(node, self._digest(node), sorted(taken), self._roots_of(node))
                ops |= taken
        for index in sorted(ops):
            op = self._ops[index]
            seen.ops.append(op.name)
            seen.sites.append(op.site)
            seen.ms += op.ms
            seen.touched += op.touched
            if op.flag:
                seen.flags.append(f"{op.flag} ({op.site})")
        earliest = min((r.serial for recipe in seen.glued.values() for r in recipe.roots), default=self.serial + 1)
        seen.reads = [what for serial, roots, what in self._reads if serial >= earliest and roots]
        key = (consumer, frozenset(r.graph for recipe in seen.glued.values() for r in recipe.roots))
        if seen.glued and key not in self._kept:
            self._kept.add(key)
            seen.program = self._program(seen, inputs, sorted(ops))
        return seen

    def _slice(self, node: int) -> set[int]:
        """The ops on the way from graph outputs to `node`."""
        taken: set[int] = set()
        todo = [node]
        while todo:
            current = todo.pop()
            made = self._node_of_op.get(current)
            if made is None or made[0] in taken:
                continue
            taken.add(made[0])
            todo += [ref.node for ref in _refs(self._ops[made[0]].args)]
        return taken

    def _roots_of(self, node: int) -> list[Root]:
        found: dict[int, Root] = {}
        todo, seen = [node], set()
        while todo:
            current = todo.pop()
            if current in seen:
                continue
            seen.add(current)
            if current in self._roots:
                found[current] = self._roots[current]
            elif (made := self._node_of_op.get(current)) is not None:
                todo += [ref.node for ref in _refs(self._ops[made[0]].args)]
        return list(found.values())

    def _digest(self, node: int) -> str:
        """What computed `node`: the same digest for the same ops, arguments and values read."""
        cached = self._digests.get(node)
        if cached is not None:
            return cached
        if node in self._roots:
            root = self._roots[node]
            digest = output_digest(root.graph, root.output)
        else:
            index, position = self._node_of_op[node]
            op = self._ops[index]
            digest = op_digest(op.name, position, canonical(op.args, self._leaf))
        self._digests[node] = digest
        return digest

    def _leaf(self, value: Any) -> str | None:
        if isinstance(value, Ref):
            return self._digest(value.node)
        if isinstance(value, Const):
            if value.value not in self._value_digests:
                self._value_digests[value.value] = value_digest(self._values[value.value])
            return self._value_digests[value.value]
        return None

    def _program(self, seen: Observation, inputs: Mapping[str, torch.Tensor], ops: list[int]) -> Program:
        taken = [self._ops[i] for i in ops]
        used = {c.value for op in taken for c in _consts(op.args)}
        roots = {r.node: self._roots[r.node] for op in taken for r in _refs(op.args) if r.node in self._roots}
        outputs: dict[str, int | torch.Tensor] = {name: recipe.node for name, recipe in seen.glued.items()}
        for name in seen.passed:
            node = self._node(inputs[name])
            outputs[name] = node  # type: ignore[assignment]
            roots[node] = self._roots[node]  # type: ignore[index]
        for name in seen.host:
            outputs[name] = inputs[name].detach().clone()
        samples = {}
        for node, root in roots.items():
            tensor = next((t for ref, t in self._live() if ref == node), None)
            if tensor is not None:
                samples[f"{root.graph}/{root.output}"] = tensor.detach().clone()
        return Program(
            ops=taken,
            values={v: self._values[v] for v in used},
            roots=roots,
            outputs=outputs,
            root_samples=samples,
            input_samples={name: t.detach().clone() for name, t in inputs.items()},
        )

    def _live(self) -> list[tuple[int, torch.Tensor]]:
        return [(node, t) for ref, node in self._tensors.values() if (t := ref()) is not None]


def _refs(value: Any) -> list[Ref]:
    if isinstance(value, Ref):
        return [value]
    if isinstance(value, (list, tuple)):
        return [r for v in value for r in _refs(v)]
    if isinstance(value, dict):
        return [r for v in value.values() for r in _refs(v)]
    return []


def _consts(value: Any) -> list[Const]:
    if isinstance(value, Const):
        return [value]
    if isinstance(value, (list, tuple)):
        return [c for v in value for c in _consts(v)]
    if isinstance(value, dict):
        return [c for v in value.values() for c in _consts(v)]
    return []


def _flag(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], template: Any) -> str | None:
    """Why no graph of fixed shapes can hold this op, or None."""
    if name in DATA_DEPENDENT_SHAPES or (name == "where" and len(args) == 1 and not kwargs):
        return f"{name} makes a shape from values"
    if name in ("__getitem__", "__setitem__", "index_select", "index", "masked_fill") and name != "masked_fill":
        index = args[1] if len(args) > 1 else None
        if any(t.dtype == torch.bool for t in _shallow_tensors(index)):
            return f"{name} with a boolean mask makes a shape from values"
    odd = _odd_arguments(template)
    return f"{name} takes a {odd} (Python state)" if odd else None


def _odd_arguments(value: Any) -> str | None:
    if isinstance(value, (Ref, Const, slice, *PLAIN_ARGUMENTS)) or value is Ellipsis:
        return None
    if isinstance(value, (list, tuple)):
        return next((odd for v in value if (odd := _odd_arguments(v))), None)
    if isinstance(value, dict):
        return next((odd for v in value.values() if (odd := _odd_arguments(v))), None)
    if callable(value):
        return None  # a function argument (a reduction's key) is code, replayed as it is
    return type(value).__qualname__


def _site() -> str:
    """The innermost frame outside torch and this package: the host code that ran the op."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith((_TORCH, _HERE)) and "<" not in filename[:1]:
            return f"{Path(filename).name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"
