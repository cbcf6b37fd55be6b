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
from omskills.contracts.reads import reads_values
from omskills.records.contracts import Provenance, ProvenanceKind, is_ancestor
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
    last_read: int = 0  # stamp of the last torch function or module that read its values

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
        """Tag every tensor in `tree` (a tensor or any nested structure); returns `tree` unchanged."""
        for tensor in tensor_leaves(tree):
            self._add_event(tensor, Provenance(kind=kind, source=source))
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
            self._add_event(tensor, Provenance(kind="parameter", source=name))
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
        origins = [self.origin(t) for t in _shallow_tensors(inputs)]
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


_JOIN = "; "
_KINDS = frozenset(get_args(ProvenanceKind))


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
        except Exception:  # lineage is an annotation: it must never break the model's run
            _log.debug("provenance lineage skipped for %s", func, exc_info=True)
        return out


_log = logging.getLogger(__name__)
