"""A graph output left on the device, standing where the host expects a tensor.

The study marks an output `unread` when the host read the graph's other outputs after every call
and never that one (an LSTM's cell state and per-step outputs, where the caller keeps only the
last hidden state). The splice then asks its runner for the other outputs only, and puts an
`Unfetched` tensor in the unread one's place. It answers what needs no values (shape, dtype,
device: `contracts.reads.METADATA`) from what the runtime reported. The first torch function
that reads its values copies the output back (that call's own values, which the runtime held),
says so once in the log and counts the copy (`on_read`), and from then on it is that tensor:
a read the study did not see costs a late copy, never a wrong value.

A widened boundary (host code between two graphs taken into one graph) leaves every output of the
first graph's call on the device, and opens a `GlueWindow` on them until the next graph's call. While
it is open, a torch operation on those outputs is not run: it gives a `Deferred` tensor (its shape and
dtype from running it on the meta device) that remembers the operation. The next graph's call is
answered inside the widened graph when each of its inputs is such a recipe with the digest the
capture saw (`contracts.recipes`); anything else that reads a deferred value computes it on the host
then, from the outputs copied back (counted), so a recipe no graph answers is still the right value.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pt
from omskills.contracts.reads import function_name, reads_values, writes_in_place
from omskills.contracts.recipes import canonical, deep_recipes, op_digest, output_digest, slot_digest


class Unfetched(torch.Tensor):
    """A tensor whose values are still on the device: copied back at the first read of them."""

    _copy_back: Callable[[], np.ndarray] | None
    _on_read: Callable[[torch.Tensor], None]
    _value: torch.Tensor | None
    _window: GlueWindow | None

    @staticmethod
    def __new__(
        cls,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        copy_back: Callable[[], np.ndarray],
        on_read: Callable[[torch.Tensor], None],
    ) -> Unfetched:
        made = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        made._copy_back, made._on_read, made._value, made._window = copy_back, on_read, None, None
        return made

    @property
    def fetched(self) -> bool:
        return self._value is not None

    def value(self) -> torch.Tensor:
        """The output itself, copied back on the first call (the runtime's hold on it let go)."""
        if self._value is None:
            copy_back, self._copy_back = self._copy_back, None
            array = np.require(copy_back(), requirements="C")  # type: ignore[misc]
            with torch._C.DisableTorchFunctionSubclass():
                self._value = torch.from_numpy(array).to(device=self.device, dtype=self.dtype)
            self._on_read(self._value)
        return self._value

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not reads_values(func):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        window = _open_window((args, kwargs))
        if window is not None and (deferred := _deferred(func, args, kwargs, window)) is not NOT_DEFERRED:
            return deferred
        args, kwargs = pt.tree_map(_value_of, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        # What reaches the dispatcher without a torch function (C++ callers) reads the values too.
        args, kwargs = pt.tree_map(_value_of, (args, kwargs or {}))
        return func(*args, **kwargs)


def _value_of(item: Any) -> Any:
    return item.value() if isinstance(item, Unfetched) else item


class GlueWindow:
    """The time between a widened graph's call and the call it answers: operations on the held
    outputs of `graph` are deferred while it is open."""

    def __init__(self, graph: str) -> None:
        self.graph = graph
        self.open = True
        self._roots: dict[int, tuple[weakref.ref, str]] = {}

    def add_root(self, tensor: Unfetched, output: str) -> None:
        tensor._window = self
        self._roots[id(tensor)] = (weakref.ref(tensor), output)

    def match(self, recipes: Mapping[str, str], inputs: Mapping[str, torch.Tensor]) -> list[torch.Tensor] | None:
        """The slots (what the inputs rest on besides the outputs, in the recipes' order) when each
        input's recipe has the digest the capture saw (`boundary.glue`); None when one does not."""
        walk = _RecipeWalk(self)
        with deep_recipes():
            for name in sorted(recipes):
                tensor = inputs.get(name)
                if tensor is None or walk.digest(tensor) != recipes[name]:
                    return None
        return walk.slots

    def is_root(self, tensor: torch.Tensor) -> str | None:
        root = self._roots.get(id(tensor))
        return root[1] if root is not None and root[0]() is tensor else None


class _RecipeWalk:
    """Digests of tensors in one window, as `boundary.glue` takes them at the capture."""

    def __init__(self, window: GlueWindow) -> None:
        self.window = window
        self.slots: list[torch.Tensor] = []
        self._digests: dict[int, str] = {}

    def digest(self, value: Any) -> str | None:
        if not isinstance(value, torch.Tensor):
            return None
        cached = self._digests.get(id(value))
        if cached is None:
            cached = self._digest(value)
            self._digests[id(value)] = cached
        return cached

    def _digest(self, tensor: torch.Tensor) -> str:
        if (output := self.window.is_root(tensor)) is not None:
            return output_digest(self.window.graph, output)
        if isinstance(tensor, Deferred) and tensor._window is self.window:
            op = tensor._op
            return op_digest(op.name, tensor._position, canonical((op.args, op.kwargs), self.digest))
        self.slots.append(tensor)
        return slot_digest(tensor.dtype, tuple(tensor.shape))


class _DeferredOp:
    """One deferred operation: run on the host, once, when a result is read."""

    def __init__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.func, self.name, self.args, self.kwargs = func, function_name(func), args, kwargs
        self._results: list[torch.Tensor] | None = None

    def result(self, position: int) -> torch.Tensor:
        if self._results is None:
            args, kwargs = pt.tree_map(_value_of, (self.args, self.kwargs))
            out = self.func(*args, **kwargs)
            # A write in place that gives nothing back (`x[i] = v`) made its first argument the result.
            self._results = [leaf for leaf in pt.tree_leaves(out) if isinstance(leaf, torch.Tensor)] or [args[0]]
        return self._results[position]


class Deferred(Unfetched):
    """The result of an operation on a widened graph's held outputs, not computed yet."""

    _op: _DeferredOp
    _position: int

    @staticmethod
    def __new__(
        cls, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, op: _DeferredOp, position: int
    ) -> Deferred:
        made = Unfetched.__new__(cls, shape, dtype, device, _never, _nothing)
        made._op, made._position = op, position
        return made

    def value(self) -> torch.Tensor:
        if self._value is None:
            self._value = self._op.result(self._position)
        return self._value


def _never() -> np.ndarray:
    raise AssertionError("a deferred value is computed, never copied back")


def _nothing(_tensor: torch.Tensor) -> None:
    return None


def _open_window(tree: Any) -> GlueWindow | None:
    """The one open window the tensors of an operation's arguments are in, if any."""
    leaves = pt.tree_leaves(tree)
    windows = {id(w): w for leaf in leaves if isinstance(leaf, Unfetched) and (w := leaf._window) and w.open}
    if len(windows) != 1:
        return None
    return next(iter(windows.values()))


NOT_DEFERRED = object()  # what an operation that must run now gives (None is what a deferred write gives)


def _deferred(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], window: GlueWindow) -> Any:
    """The operation's results as `Deferred` tensors, or NOT_DEFERRED when it cannot wait: it gives
    something other than tensors, or the meta device cannot tell its shapes."""
    name = function_name(func)
    if writes_in_place(name, kwargs):
        return _deferred_write(func, args, kwargs, window)
    try:
        with torch._C.DisableTorchFunctionSubclass():
            meta = func(*pt.tree_map(_on_meta, args), **pt.tree_map(_on_meta, kwargs))
    except Exception:  # noqa: BLE001 - an operation the meta device cannot run is computed now
        return NOT_DEFERRED
    leaves = pt.tree_leaves(meta)
    if not leaves or not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        return NOT_DEFERRED
    device = next(leaf.device for leaf in pt.tree_leaves((args, kwargs)) if isinstance(leaf, Unfetched))
    op = _DeferredOp(func, args, kwargs)
    positions = iter(range(len(leaves)))

    def wrap(leaf: torch.Tensor) -> Deferred:
        made = Deferred(tuple(leaf.shape), leaf.dtype, device, op, next(positions))
        made._window = window
        return made

    return pt.tree_map(wrap, meta)


def _deferred_write(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], window: GlueWindow) -> Any:
    """An in-place write into a deferred value of the window (`x *= s`, `x[i] = v`): the value becomes
    the write's result, its old recipe the write's input, so every holder of it sees the write, as
    they would see it in place. Anything else (a write into an output, into a value read already,
    `out=`) is done now, on the host."""
    target = args[0] if args else None
    if kwargs.get("out") is not None or not isinstance(target, Deferred) or target._window is not window:
        return NOT_DEFERRED
    if target._value is not None:
        return NOT_DEFERRED
    try:
        with torch._C.DisableTorchFunctionSubclass():
            meta = func(*pt.tree_map(_on_meta, args), **pt.tree_map(_on_meta, kwargs))
    except Exception:  # noqa: BLE001 - a write the meta device cannot run is made now
        return NOT_DEFERRED
    before = Deferred(tuple(target.shape), target.dtype, target.device, target._op, target._position)
    before._window = window
    target._op, target._position = _DeferredOp(func, (before, *args[1:]), kwargs), 0
    return None if meta is None else target


def _on_meta(item: Any) -> Any:
    if isinstance(item, Unfetched):
        return torch.empty(tuple(item.shape), dtype=item.dtype, device="meta")
    if isinstance(item, torch.Tensor):
        return item.to("meta")
    return item
