"""Where each tensor of a run came from: user input, session state, a parameter, or a module.

The tracker keys tensors by their storage's data_ptr, so a view (`x[0]`, `x.permute(...)`) is
traced to the same origin as its base. A weak reference to the storage guards against a freed
buffer's address being reused by an unrelated tensor: the entry dies with the storage.

Events on one storage are kept in time order:
  * the driver tags what it creates (`tag`, `wrap_callable`): frames, images and tokenizer output
    -> "input", tensors kept across frames -> "session";
  * `attached(root)` tags the root's parameters and buffers ("parameter") and adds a forward hook to
    every module, so each tensor a module returns gets a "module_output" event naming the module;
    pre-hooks on every module record which modules receive each tensor (its consumers);
  * each storage also keeps when its values were last read (by a consumer, or with `trace_ops` by a
    torch function other than a metadata look-up, `contracts.reads`): an output no one read shows.
A tensor passed through several nested modules gets one event per level, innermost first.
With `trace_ops` (default), a TorchFunctionMode also gives each fresh tensor computed by a torch op
the origin of its inputs, marked derived: a value thresholded in Python between two modules is
still traced to the module that produced the logits.

Each storage also keeps its roots (`Provenance.roots`): every kind of origin its values were computed
from, however many ops and modules lie between, so whether a value depends only on user inputs and
the model's constants is decidable (splicing.memo). A tag or the model's parameters set the roots; an
op's result takes the union of its inputs' roots, an in-place op adds them to what it writes; a
tensor made from Python values alone (`torch.zeros`, `torch.tensor`) is "constant"; a random op adds
"random"; a write into a parameter or buffer during the run makes it "session" state; a tensor no
traced op made (`torch.from_numpy`, or made before the run) is "unknown".
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, get_args

import torch
import torch.utils._pytree as pt
from omskills.contracts import pytree
from omskills.contracts.reads import reads_values, writes_in_place
from omskills.records.contracts import LineageRoot, Provenance, ProvenanceKind, is_ancestor
from torch import nn
from torch.overrides import TorchFunctionMode


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    pytree.ensure_registered(tree)
    return [leaf for leaf in pt.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def _storage_of(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    # Sparse, nested, fake or meta tensors have no (real) storage: they cannot be traced.
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return storage if storage.data_ptr() != 0 else None


@dataclass
class StorageHistory:
    """What happened to one storage: origin events and consumers, each stamped with a sequence number."""

    events: list[tuple[int, Provenance]] = field(default_factory=list)
    consumers: list[tuple[int, str]] = field(default_factory=list)
    roots: dict[LineageRoot, str] = field(default_factory=dict)  # kind -> the first source seen
    last_read: int = 0  # stamp of the last torch function or module that read its values

    def add_roots(self, roots: dict[LineageRoot, str]) -> None:
        for kind, source in roots.items():
            self.roots.setdefault(kind, source)

    def read_after(self, seq: int) -> bool:
        return self.last_read > seq

    def consumers_after(self, seq: int) -> list[str]:
        seen: dict[str, None] = {}
        for stamp, path in self.consumers:
            if stamp > seq:
                seen.setdefault(path, None)
        return list(seen)


class ProvenanceTracker:
    """Maps tensors to their origin during one run of a model's main path."""

    def __init__(self, trace_ops: bool = True) -> None:
        self.trace_ops = trace_ops
        self._histories: dict[int, tuple[weakref.ref, StorageHistory]] = {}
        self._clock = itertools.count(1)
        self.seq = 0  # sequence number of the latest event
        # Module paths a producer should be reported as when it is one of several nested producers
        # (the candidates: "output of detector.backbone.vision_backbone" is what the user needs).
        self.preferred: set[str] = set()
        # Storages each module received, per call in flight (a stack: modules may re-enter).
        self._received: dict[str, list[set[int]]] = {}

    # ------------------------------------------------------------------ storage histories

    def _tick(self) -> int:
        self.seq = next(self._clock)
        return self.seq

    def history(self, tensor: torch.Tensor, create: bool = True) -> StorageHistory | None:
        storage = _storage_of(tensor)
        if storage is None:
            return None
        ptr = storage.data_ptr()
        entry = self._histories.get(ptr)
        if entry is not None and entry[0]() is storage:
            return entry[1]
        if not create:
            return None
        history = StorageHistory()

        def forget(_ref: weakref.ref, ptr: int = ptr, history: StorageHistory = history) -> None:
            current = self._histories.get(ptr)
            if current is not None and current[1] is history:
                del self._histories[ptr]

        self._histories[ptr] = (weakref.ref(storage, forget), history)
        return history

    def _add_event(self, tensor: torch.Tensor, provenance: Provenance) -> None:
        history = self.history(tensor)
        if history is not None:
            history.events.append((self._tick(), provenance))

    def _add_consumer(self, tensor: torch.Tensor, module_path: str) -> None:
        history = self.history(tensor, create=False)
        if history is not None:
            history.consumers.append((self._tick(), module_path))
            history.last_read = self.seq

    def read(self, tensors: list[torch.Tensor]) -> None:
        """A torch function read the values of `tensors` (only one stamp is kept per storage: the last)."""
        for tensor in tensors:
            history = self.history(tensor, create=False)
            if history is not None:
                history.last_read = self._tick()

    # ------------------------------------------------------------------ tagging by the driver

    def tag(self, tree: Any, kind: ProvenanceKind, source: str) -> Any:
        """Tag every tensor in `tree` (a tensor or any nested structure); returns `tree` unchanged.

        A tag says what the values are from now on (a driver's random frames stand for a user's),
        so it replaces their roots; a module output tagged by hand keeps the roots it has."""
        for tensor in tensor_leaves(tree):
            self._add_event(tensor, Provenance(kind=kind, source=source))
            history = self.history(tensor, create=False)
            if history is not None and kind in _ROOT_KINDS:
                history.roots = {kind: source}  # type: ignore[dict-item]
        return tree

    @contextmanager
    def wrap_callable(self, owner: Any, attr: str, kind: ProvenanceKind, source: str) -> Iterator[None]:
        """While active, the tensor outputs of `owner.attr(...)` are tagged (e.g. a tokenizer -> input)."""
        original = getattr(owner, attr)
        if isinstance(original, nn.Module):
            handle = original.register_forward_hook(lambda _m, _a, out: self.tag(out, kind, source))
            try:
                yield
            finally:
                handle.remove()
            return

        @functools.wraps(original)
        def tagged(*args: Any, **kwargs: Any) -> Any:
            return self.tag(original(*args, **kwargs), kind, source)

        had_own_attribute = attr in getattr(owner, "__dict__", {})
        setattr(owner, attr, tagged)
        try:
            yield
        finally:
            if had_own_attribute:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)  # the class attribute shows through again

    # ------------------------------------------------------------------ module hooks

    @contextmanager
    def attached(self, root: nn.Module) -> Iterator[ProvenanceTracker]:
        """Tag the root's parameters/buffers and hook every module; hooks are removed on exit."""
        for name, tensor in itertools.chain(root.named_parameters(), root.named_buffers()):
            self.tag(tensor, "parameter", name)
        handles = []
        try:
            for path, module in root.named_modules():
                if isinstance(module, torch.jit.ScriptModule):
                    continue  # scripted modules take no Python hooks; their callers are still traced
                handles.append(module.register_forward_pre_hook(self._consumer_hook(path), with_kwargs=True))
                handles.append(module.register_forward_hook(self._producer_hook(path)))
            with _LineageMode(self) if self.trace_ops else contextlib.nullcontext():
                yield self
        finally:
            for handle in handles:
                handle.remove()

    def _consumer_hook(self, path: str):
        def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            received = set()
            for tensor in tensor_leaves((args, kwargs)):
                self._add_consumer(tensor, path)
                storage = _storage_of(tensor)
                if storage is not None:
                    received.add(storage.data_ptr())
            self._received.setdefault(path, []).append(received)

        return hook

    def _producer_hook(self, path: str):
        def hook(_module: nn.Module, _args: tuple[Any, ...], output: Any) -> None:
            calls = self._received.get(path)
            received = calls.pop() if calls else set()
            for tensor in tensor_leaves(output):
                storage = _storage_of(tensor)
                # A module that hands back (a view of) its own input did not produce it (Identity,
                # eval-mode Dropout, reshapes): the origin stays where it was.
                if storage is None or storage.data_ptr() in received:
                    continue
                self._add_event(tensor, Provenance(kind="module_output", source=path))

        return hook

    # ------------------------------------------------------------------ queries

    def origin(self, tensor: torch.Tensor, consumer: str | None = None) -> Provenance:
        """Where `tensor` came from, as seen by module `consumer` when it receives it, with its roots."""
        return self._latest(tensor, consumer).model_copy(update={"roots": self.roots(tensor)})

    def roots(self, tensor: torch.Tensor) -> dict[LineageRoot, str]:
        """Every kind of origin `tensor`'s values were computed from ("unknown" when none was traced)."""
        history = self.history(tensor, create=False)
        return dict(history.roots) if history is not None and history.roots else dict(_UNTRACED)

    def _latest(self, tensor: torch.Tensor, consumer: str | None = None) -> Provenance:
        """Where `tensor` came from, as seen by module `consumer` when it receives it.

        The latest event wins, except that outputs of the consumer's own ancestors are skipped (an
        ancestor that returns the tensor later is passing it on, not producing it). Among the run of
        nested modules that returned the tensor last, a preferred (candidate) module is reported,
        otherwise the outermost one.
        """
        history = self.history(tensor, create=False)
        if history is None or not history.events:
            return Provenance(kind="unknown")
        events = [p for _, p in history.events]
        relevant = [
            p
            for p in events
            if not (p.kind == "module_output" and consumer is not None and is_ancestor(p.source or "", consumer))
        ]
        if not relevant:
            return events[0]  # only ancestors produced it (e.g. their previous call): the innermost
        last = relevant[-1]
        if last.kind != "module_output" or last.derived:
            return last
        # Modules that returned this very tensor, outermost first (derived events are a new tensor).
        chain = list(itertools.takewhile(lambda p: p.kind == "module_output" and not p.derived, reversed(relevant)))
        preferred = [p for p in chain if p.source in self.preferred]
        return preferred[0] if preferred else last

    # ------------------------------------------------------------------ lineage through tensor ops

    def inherit(self, outputs: Any, inputs: tuple[Any, ...]) -> None:
        """Give fresh tensors in `outputs` the origin of the tensors in `inputs` (marked derived)."""
        fresh = [t for t in _shallow_tensors(outputs) if (h := self.history(t)) is not None and not h.events]
        if not fresh:
            return
        origins = [self._latest(t) for t in _shallow_tensors(inputs)]
        informative = [o for o in origins if o.kind not in ("parameter", "constant", "unknown")]
        chosen = informative or [o for o in origins if o.kind == "parameter"]
        if not chosen:
            return
        # Joined origins are split back into their parts before joining again: a loop that feeds
        # a tensor back into itself (an NMS loop: keep = keep & ~f(keep), 200 times) would
        # otherwise double the source string each step (24 GB in seconds).
        distinct = list(dict.fromkeys(part for o in chosen for part in _origin_parts(o)))
        if len(distinct) == 1:
            provenance = Provenance(kind=distinct[0][0], source=distinct[0][1], derived=True)
        else:
            joined = _JOIN.join(f"{kind}:{source}" for kind, source in distinct)
            provenance = Provenance(kind=distinct[0][0], source=joined, derived=True)
        for tensor in fresh:
            self._add_event(tensor, provenance)

    def carry_roots(self, op: str, outputs: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """What op `op` wrote (its results, the tensor an in-place op writes into) gets the roots of
        what it read; a write into a parameter or buffer makes that tensor session state."""
        in_place = writes_in_place(op, kwargs)
        written = _written(outputs, args, kwargs, in_place)
        if not written:
            return
        roots = self._read_roots(op, args, kwargs)
        for tensor in written:
            history = self.history(tensor)
            if history is None:
                continue
            if in_place:
                written_parameter = next((p.source for _, p in history.events if p.kind == "parameter"), None)
                if written_parameter is not None:
                    history.roots.setdefault("session", f"{written_parameter}, written by {op} during the run")
            history.add_roots(roots)

    def _read_roots(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[LineageRoot, str]:
        """The roots of every tensor op `op` read; "constant" when it read none, "random" when it draws."""
        read = _shallow_tensors((args, kwargs))
        roots: dict[LineageRoot, str] = {}
        for tensor in read:
            for kind, source in self._roots_of(tensor).items():
                roots.setdefault(kind, source)
        if not read:
            roots["constant"] = f"torch.{op}"  # made from Python values alone
        if _draws_random(op, args, kwargs):
            roots.setdefault("random", f"torch.{op}")
        return roots

    def _roots_of(self, tensor: torch.Tensor) -> dict[LineageRoot, str]:
        history = self.history(tensor, create=False)
        return history.roots if history is not None and history.roots else _UNTRACED


_JOIN = "; "
_KINDS = frozenset(get_args(ProvenanceKind))
# Kinds a tag sets as a tensor's roots (a module output is a result, not a root).
_ROOT_KINDS = frozenset(get_args(LineageRoot))
_UNTRACED: dict[LineageRoot, str] = {
    "unknown": "made outside torch's functions, e.g. torch.from_numpy, or before the run"
}

# Ops whose result comes from a random generator, whatever their arguments.
_RANDOM_OPS = frozenset(
    {
        "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm", "normal", "normal_",
        "uniform_", "bernoulli", "bernoulli_", "multinomial", "poisson", "exponential_", "geometric_", "cauchy_",
        "log_normal_", "random_", "rrelu", "rrelu_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
        "xavier_uniform_", "xavier_normal_", "orthogonal_", "sparse_",
    }
)  # fmt: skip
# Ops that draw only with a probability above 0 while training: name -> (the probability's position
# and keyword, its default, the training flag's position and keyword; None: no flag).
_DROPOUT_OPS: dict[str, tuple[int, str, float, int | None, str | None]] = {
    **dict.fromkeys(
        ("dropout", "dropout_", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"),
        (1, "p", 0.5, 2, "training"),
    ),
    "scaled_dot_product_attention": (4, "dropout_p", 0.0, None, None),
    "multi_head_attention_forward": (10, "dropout_p", 0.0, 13, "training"),
}


def _written(outputs: Any, args: tuple[Any, ...], kwargs: dict[str, Any], in_place: bool) -> list[torch.Tensor]:
    """The tensors an op wrote: its results in storages it did not read (a result in one it read is
    a view of an input, or the input itself), and the target of an in-place op."""
    results = _shallow_tensors(outputs)
    if not results and not in_place:
        return []
    read = {ptr for t in _shallow_tensors((args, kwargs)) if (ptr := _storage_ptr(t)) is not None}
    out = kwargs.get("out")
    targets = _shallow_tensors(out if out is not None else list(args[:1])) if in_place else []
    return [t for t in results if _storage_ptr(t) not in read] + targets


def _draws_random(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if op in _RANDOM_OPS:
        return True
    dropout = _DROPOUT_OPS.get(op)
    if dropout is None:
        return False
    p_at, p_name, p_default, training_at, training_name = dropout
    p = _argument(args, kwargs, p_at, p_name, p_default)
    training = True if training_at is None else _argument(args, kwargs, training_at, training_name, True)
    if training_name is not None and "train" in kwargs:  # torch.dropout(input, p, train)
        training = kwargs["train"]
    return bool(training) and isinstance(p, (int, float)) and p > 0


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], position: int, name: str | None, default: Any) -> Any:
    if name is not None and name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else default


def _storage_ptr(tensor: torch.Tensor) -> int | None:
    storage = _storage_of(tensor)
    return storage.data_ptr() if storage is not None else None


def _origin_parts(origin: Provenance) -> list[tuple[str, str | None]]:
    """(kind, source) of each origin an inherited provenance joined ("kind:source; kind:source")."""
    if not origin.derived or not origin.source or _JOIN not in origin.source:
        return [(origin.kind, origin.source)]
    parts = []
    for part in origin.source.split(_JOIN):
        kind, sep, source = part.partition(":")
        parts.append((kind, source) if sep and kind in _KINDS else (origin.kind, part))
    return parts


def _shallow_tensors(value: Any) -> list[torch.Tensor]:
    # Torch ops take tensors directly or in one level of list/tuple (cat, stack): no pytree walk needed.
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        found = []
        for item in value:
            if isinstance(item, torch.Tensor):
                found.append(item)
            elif isinstance(item, (list, tuple, dict)):
                found += _shallow_tensors(item)
        return found
    if isinstance(value, dict):
        return _shallow_tensors(list(value.values()))
    return []


class _LineageMode(TorchFunctionMode):
    """Propagates origins through every torch op run while the tracker is attached."""

    def __init__(self, tracker: ProvenanceTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if reads_values(func):
            try:
                self.tracker.read(_shallow_tensors((args, kwargs)))
            except Exception:  # reads are an annotation too
                _log.debug("provenance read skipped for %s", func, exc_info=True)
        out = func(*args, **kwargs)
        try:
            self.tracker.inherit(out, (args, kwargs))
            self.tracker.carry_roots(getattr(func, "__name__", str(func)), out, args, kwargs)
        except Exception:  # lineage is an annotation: it must never break the model's run
            _log.debug("provenance lineage skipped for %s", func, exc_info=True)
        return out


_log = logging.getLogger(__name__)
