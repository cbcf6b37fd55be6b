"""Capture the real I/O contract of candidate modules while the main path runs.

One run of the driver's `run()` with forward pre-hooks and forward hooks on each candidate. Per
call we flatten (args, kwargs) and the output, and keep only what the contract needs: the tree
specs, each leaf's shape/dtype/device or non-tensor value, the provenance of each input tensor,
and handles to the output storages so their consumers can be read after the run. Inputs are
copied only for the bounded set of calls kept as samples (a module may modify them in place), and
each copy goes to a scratch file at once: a large model's samples are gigabytes, which held in
memory to the end of the run would sit on top of the run's own peak.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omskills.contracts import pytree
from omskills.contracts.layout import dtype_name
from omskills.contracts.provenance import ProvenanceTracker, StorageHistory
from omskills.contracts.samples import save_sample
from omskills.errors import OmskillsError
from omskills.files import process_alive
from omskills.records.contracts import (
    CallShape,
    ContractSpec,
    Dispatch,
    LineageRoot,
    NonTensorArg,
    Provenance,
    ShapeDerivedArg,
    TensorSpec,
    is_ancestor,
)
from torch import nn

# How many distinct values of a varying non-tensor argument are quoted in the record.
_QUOTED_VALUES = 5
# A candidate whose calls differ in scalar non-tensor arguments gets one graph per combination of
# their values, up to this many; with more, the argument is too varied to dispatch on.
MAX_DISPATCH_VALUES = 4
_SCALARS = (bool, int, float, str, type(None))


# --------------------------------------------------------------------------- per-call observation


@dataclass
class _LeafInfo:
    """One leaf of one call: a tensor's shape/dtype/device, or a non-tensor value."""

    is_tensor: bool
    shape: tuple[int, ...] = ()
    dtype: str = ""
    device: str = ""
    value: Any = None
    holds_tensors: bool = False  # a non-tensor leaf with tensors inside (see `pytree.is_opaque`)


def _describe(leaves: list[Any]) -> list[_LeafInfo]:
    infos = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            infos.append(_LeafInfo(True, tuple(leaf.shape), dtype_name(leaf.dtype), str(leaf.device)))
        else:
            infos.append(_LeafInfo(False, value=leaf, holds_tensors=pytree.holds_tensors(leaf)))
    return infos


def _structure_key(spec: str, infos: list[_LeafInfo]) -> str:
    # Same tree spec is not enough: a leaf may be None in one call and a tensor in the next.
    return spec + "|" + "".join("T" if info.is_tensor else "c" for info in infos)


class _Spilled:
    """Copies of one call's tensors, written to a scratch file as soon as they are taken."""

    def __init__(self, path: Path, tensors: list[torch.Tensor]) -> None:
        self.path = path
        torch.save([t.detach().clone() for t in tensors], path)

    def load(self) -> list[torch.Tensor]:
        # mapped, not read: the pages come from the file as the sample writer copies them out
        return torch.load(self.path, map_location="cpu", mmap=True, weights_only=True)

    def drop(self) -> None:
        self.path.unlink(missing_ok=True)


class _SpillFolder:
    """The scratch folder of one capture (`.capture-<pid>` in the samples folder); those of
    captures whose process died are removed when the next one starts."""

    PREFIX = ".capture-"

    def __init__(self, samples_dir: Path) -> None:
        for folder in samples_dir.glob(f"{glob.escape(self.PREFIX)}*"):
            pid = folder.name[len(self.PREFIX) :]
            if folder.is_dir() and not folder.is_symlink() and pid.isdigit() and not process_alive(int(pid)):
                shutil.rmtree(folder, ignore_errors=True)
        self.path = samples_dir / f"{self.PREFIX}{os.getpid()}"
        shutil.rmtree(self.path, ignore_errors=True)  # this process's own, from a capture that raised
        self.path.mkdir(parents=True)
        self._count = 0

    def spill(self, tensors: list[torch.Tensor]) -> _Spilled:
        self._count += 1
        return _Spilled(self.path / f"{self._count}.pt", tensors)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


@dataclass
class _Call:
    index: int
    in_spec: str
    in_paths: list[str]
    in_leaves: list[_LeafInfo]
    provenance: list[Provenance]  # one per input tensor, flat order
    sample_inputs: _Spilled | None = None
    out_spec: str = ""
    out_paths: list[str] = field(default_factory=list)
    out_leaves: list[_LeafInfo] = field(default_factory=list)
    out_histories: list[StorageHistory | None] = field(default_factory=list)
    out_seq: int = 0
    sample_outputs: _Spilled | None = None

    dispatch_key: str = ""  # the scalar non-tensor values of the call (those not derived from shapes)

    @property
    def in_key(self) -> str:
        return _structure_key(self.in_spec, self.in_leaves)

    @property
    def sample_key(self) -> str:
        return self.in_key + "|" + self.dispatch_key

    @property
    def structure(self) -> str:
        return self.in_key + "||" + _structure_key(self.out_spec, self.out_leaves)

    def input_signature(self) -> tuple[Any, ...]:
        return tuple((i.shape, i.dtype) for i in self.in_leaves if i.is_tensor)

    def shapes(self) -> CallShape:
        return CallShape(
            inputs=[list(i.shape) for i in self.in_leaves if i.is_tensor],
            outputs=[list(i.shape) for i in self.out_leaves if i.is_tensor],
        )


class _SampleSelector:
    """Keeps at most `limit` sampled calls per input structure and dispatch values, preferring
    distinct input shapes; dispatch values beyond MAX_DISPATCH_VALUES per structure get none.

    Decided at pre-hook time (before the inputs are cloned): a call is taken while there is room,
    or when its shapes are new and a kept call has shapes seen twice (that one is evicted).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.kept: dict[str, list[_Call]] = {}
        self._dispatch_keys: dict[str, set[str]] = {}

    def _room_for_key(self, call: _Call) -> bool:
        keys = self._dispatch_keys.setdefault(call.in_key, set())
        if call.dispatch_key in keys or len(keys) < MAX_DISPATCH_VALUES:
            keys.add(call.dispatch_key)
            return True
        return False

    def _evictable(self, kept: list[_Call]) -> _Call | None:
        counts = Counter(c.input_signature() for c in kept)
        duplicates = [c for c in kept if counts[c.input_signature()] > 1]
        return duplicates[-1] if duplicates else None

    def wants(self, call: _Call) -> bool:
        if not self._room_for_key(call):
            return False
        kept = self.kept.get(call.sample_key, [])
        if len(kept) < self.limit:
            return True
        is_new_shape = call.input_signature() not in {c.input_signature() for c in kept}
        return is_new_shape and self._evictable(kept) is not None

    def add(self, call: _Call) -> _Call | None:
        """Keep `call`; returns the call whose sample is no longer kept (`call` itself when it
        does not fit, an evicted one when it does at its cost), or None."""
        kept = self.kept.setdefault(call.sample_key, [])
        victim = None
        if len(kept) >= self.limit:
            victim = self._evictable(kept)
            if victim is None:
                return call
            kept.remove(victim)
        kept.append(call)
        return victim

    def among(self, calls: list[_Call]) -> list[_Call]:
        """The sampled calls among `calls`, in call order."""
        wanted = {id(c) for c in calls}
        return sorted((c for kept in self.kept.values() for c in kept if id(c) in wanted), key=lambda c: c.index)


# --------------------------------------------------------------------------- one candidate


class _CandidateRecorder:
    def __init__(
        self,
        name: str,
        path: str,
        module: nn.Module,
        tracker: ProvenanceTracker,
        max_samples: int,
        derived_paths: set[str],
        spill: _SpillFolder | None,
    ):
        self.name = name
        self.spill = spill
        self.path = path
        self.module = module
        self.tracker = tracker
        self.derived_paths = derived_paths
        self.parameter_names = pytree.positional_parameter_names(module.forward)
        self.calls: list[_Call] = []
        self.selector = _SampleSelector(max_samples)
        self._in_flight: list[_Call] = []

    def attach(self) -> list[Any]:
        # The output hook goes first: a hook registered earlier may replace the output (a driver's
        # verification takes |object_score_logits|), and the sample must hold what forward returned.
        return [
            self.module.register_forward_pre_hook(self._before, with_kwargs=True),
            self.module.register_forward_hook(self._after, with_kwargs=True, prepend=True),
        ]

    def _before(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        flat = pytree.flatten_call(args, kwargs)
        call = _Call(
            index=len(self.calls) + len(self._in_flight),
            in_spec=pytree.spec_to_str(flat.spec),
            in_paths=flat.paths,
            in_leaves=_describe(flat.leaves),
            provenance=[self.tracker.origin(t, consumer=self.path) for t in flat.tensors()],
        )
        call.dispatch_key = repr(
            [
                (path, leaf)
                for path, leaf in zip(flat.paths, flat.leaves)
                if isinstance(leaf, _SCALARS) and path not in self.derived_paths
            ]
        )
        # asked even when no sample is kept: it counts the dispatch values a graph is made for
        if self.selector.wants(call) and self.spill is not None:
            call.sample_inputs = self.spill.spill(flat.tensors())
        self._in_flight.append(call)

    def _after(self, _module: nn.Module, _args: tuple[Any, ...], _kwargs: dict[str, Any], output: Any) -> None:
        call = self._in_flight.pop()
        flat = pytree.flatten(output)
        call.out_spec = pytree.spec_to_str(flat.spec)
        call.out_paths = flat.paths
        call.out_leaves = _describe(flat.leaves)
        call.out_histories = [self.tracker.history(t) for t in flat.tensors()]
        if call.sample_inputs is not None and self.spill is not None:
            call.sample_outputs = self.spill.spill(flat.tensors())
            dropped = self.selector.add(call)
            if dropped is not None:
                for spilled in (dropped.sample_inputs, dropped.sample_outputs):
                    if spilled is not None:
                        spilled.drop()
                dropped.sample_inputs = dropped.sample_outputs = None
        call.out_seq = self.tracker.seq  # after the sample's copy: reading the outputs for it is no use
        self.calls.append(call)


# --------------------------------------------------------------------------- building the contract


def _replacement_point(path: str) -> tuple[str, str]:
    parent, _, attribute = path.rpartition(".")
    return parent, attribute


def _dynamic_dims(shapes: list[tuple[int, ...]]) -> dict[str, list[int]]:
    dims: dict[str, list[int]] = {}
    if len({len(s) for s in shapes}) != 1:
        return dims  # rank changes: no per-dim statement holds (the strategy step treats it)
    for d in range(len(shapes[0])):
        values = sorted({s[d] for s in shapes})
        if len(values) > 1:
            dims[str(d)] = values
    return dims


def _merged_provenance(per_call: list[Provenance]) -> Provenance:
    """One input's provenance over all its calls: the first call's origin, every call's roots."""
    first = per_call[0]
    roots = _merged_roots(per_call)
    distinct = list(dict.fromkeys((p.kind, p.source) for p in per_call))
    if len(distinct) == 1:
        return first.model_copy(update={"roots": roots})
    if len({kind for kind, _ in distinct}) == 1:
        source = "; ".join(s or "?" for _, s in distinct)
    else:
        source = "; ".join(f"{k}:{s or '?'}" for k, s in distinct)
    return Provenance(kind=first.kind, source=source, derived=first.derived, roots=roots)


def _merged_roots(per_call: list[Provenance]) -> dict[LineageRoot, str] | None:
    if any(p.roots is None for p in per_call):
        return None  # a call whose roots were not traced: the union is not known
    roots: dict[LineageRoot, str] = {}
    for provenance in per_call:
        for kind, source in (provenance.roots or {}).items():
            roots.setdefault(kind, source)
    return roots


def _reduced_consumers(consumers: list[str], producer: str, preferred: set[str]) -> list[str]:
    """Keep the outermost receiving modules, plus candidates among the inner ones."""
    consumers = [c for c in consumers if not is_ancestor(producer, c)]  # the producer's own insides
    outermost = [c for c in consumers if not any(is_ancestor(o, c) for o in consumers)]
    return [c for c in consumers if c in outermost or c in preferred]


def _json_scalar(value: Any) -> bool | int | float | str | None:
    return value if isinstance(value, (bool, int, float, str)) or value is None else None


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # objects whose == is ambiguous or raises: only identity counts
        return False


def _shown(value: Any) -> str:
    """A value as the record quotes it: scalars as they are, objects by their kind (the repr of a
    cache holding tensors would be megabytes)."""
    if isinstance(value, _SCALARS):
        return repr(value)
    size = f" of {len(value)} items" if isinstance(value, (dict, list, tuple)) else ""
    return f"a {type(value).__name__}{size}"


def _non_tensor_leaves(calls: list[_Call], outputs: bool) -> list[NonTensorArg]:
    first = calls[0]
    leaves = first.out_leaves if outputs else first.in_leaves
    paths = first.out_paths if outputs else first.in_paths
    result = []
    for index, (info, path) in enumerate(zip(leaves, paths)):
        if info.is_tensor:
            continue
        values = [(c.out_leaves if outputs else c.in_leaves)[index].value for c in calls]
        distinct: list[Any] = []
        for value in values:
            if not any(_same(value, seen) for seen in distinct):
                distinct.append(value)
        constant = len(distinct) == 1
        kinds = {type(v) for v in distinct}
        if not constant and len(kinds) == 1 and not isinstance(distinct[0], _SCALARS):
            # Objects (an image list, a session): their reprs are addresses, which say nothing.
            shown = f"a {kinds.pop().__name__} object, {len(distinct)} distinct in {len(values)} calls"
        else:
            shown = _shown(distinct[0]) if constant else ", ".join(_shown(v) for v in distinct[:_QUOTED_VALUES])
            if len(distinct) > _QUOTED_VALUES:
                shown += f", ... ({len(distinct)} distinct)"
        result.append(
            NonTensorArg(
                tree_path=path,
                value_repr=shown,
                constant=constant,
                value=_json_scalar(info.value),
                flat_index=index,
                holds_tensors=any((c.out_leaves if outputs else c.in_leaves)[index].holds_tensors for c in calls),
            )
        )
    return result


def _tensor_indices(leaves: list[_LeafInfo]) -> list[int]:
    return [i for i, info in enumerate(leaves) if info.is_tensor]


def _input_specs(recorder: _CandidateRecorder, calls: list[_Call]) -> list[TensorSpec]:
    first = calls[0]
    indices = _tensor_indices(first.in_leaves)
    names = pytree.input_names([first.in_paths[i] for i in indices], recorder.parameter_names)
    specs = []
    for k, (index, name) in enumerate(zip(indices, names)):
        info = first.in_leaves[index]
        specs.append(
            TensorSpec(
                name=name,
                tree_path=first.in_paths[index],
                shape=list(info.shape),
                dtype=info.dtype,
                device=info.device,
                dynamic_dims=_dynamic_dims([c.in_leaves[index].shape for c in calls]),
                provenance=_merged_provenance([c.provenance[k] for c in calls]),
                flat_index=index,
            )
        )
    return specs


def _reads(calls: list[_Call], outputs: int) -> list[list[bool]]:
    """Per call, per tensor output: whether anything read its values after the call returned. A
    storage the tracker cannot follow counts as read."""
    return [[_read(call, k) for k in range(outputs)] for call in calls]


def _read(call: _Call, k: int) -> bool:
    history = call.out_histories[k] if k < len(call.out_histories) else None
    return history is None or history.read_after(call.out_seq)


def _unread(recorder: _CandidateRecorder, calls: list[_Call], outputs: int) -> list[bool]:
    """Per tensor output: never read after any call, while every call had another output read, so
    the study saw what the host does with the graph's results and this one is not among them. Only
    with torch functions traced: module consumers alone miss what Python code reads."""
    reads = _reads(calls, outputs)
    if not recorder.tracker.trace_ops or not all(any(row) for row in reads):
        return [False] * outputs
    return [not any(row[k] for row in reads) for k in range(outputs)]


def _output_specs(recorder: _CandidateRecorder, calls: list[_Call], taken: set[str]) -> list[TensorSpec]:
    first = calls[0]
    indices = _tensor_indices(first.out_leaves)
    names = pytree.output_names([first.out_paths[i] for i in indices], taken)
    unread = _unread(recorder, calls, len(indices))
    specs = []
    for k, (index, name) in enumerate(zip(indices, names)):
        info = first.out_leaves[index]
        consumers: dict[str, None] = {}
        for call in calls:
            history = call.out_histories[k]
            if history is not None:
                consumers.update(dict.fromkeys(history.consumers_after(call.out_seq)))
        specs.append(
            TensorSpec(
                name=name,
                tree_path=first.out_paths[index],
                shape=list(info.shape),
                dtype=info.dtype,
                device=info.device,
                dynamic_dims=_dynamic_dims([c.out_leaves[index].shape for c in calls]),
                consumers=_reduced_consumers(list(consumers), recorder.path, recorder.tracker.preferred),
                unread=unread[k],
                flat_index=index,
            )
        )
    return specs


def _save_samples(
    recorder: _CandidateRecorder,
    name: str,
    calls: list[_Call],
    inputs: list[TensorSpec],
    outputs: list[TensorSpec],
    samples_dir: Path,
    relative_to: Path | None,
) -> list[str]:
    """At most the selector's limit of the sampled calls among `calls`, distinct input shapes first
    (calls sampled per dispatch value that one contract serves are more than it needs)."""
    sampled = recorder.selector.among(calls)
    distinct = list({c.input_signature(): c for c in reversed(sampled)}.values())[::-1]
    chosen = sorted(
        (distinct + [c for c in sampled if c not in distinct])[: recorder.selector.limit], key=lambda c: c.index
    )
    paths = []
    for n, call in enumerate(chosen):
        assert call.sample_inputs is not None and call.sample_outputs is not None
        path = save_sample(
            samples_dir / f"{name}_{n}.npz",
            name,
            call.index,
            inputs={spec.name: t for spec, t in zip(inputs, call.sample_inputs.load())},
            outputs={spec.name: t for spec, t in zip(outputs, call.sample_outputs.load())},
        )
        paths.append(str(path.relative_to(relative_to)) if relative_to else str(path))
    return paths


def _bind_derived(contract: ContractSpec, calls: list[_Call], derivations: dict[str, ShapeDerivedArg]) -> None:
    """Mark the arguments the driver derives from shapes, where every observed call agrees."""
    by_path = {arg.tree_path: arg for arg in contract.non_tensor_args}
    unknown = sorted(set(derivations) - set(by_path))
    if unknown:
        raise OmskillsError(
            f"candidate {contract.candidate}: derived argument(s) {unknown} are not non-tensor "
            f"arguments (it has {sorted(by_path) or 'none'})"
        )
    for path, derivation in derivations.items():
        arg = by_path[path]

        def agrees(call: _Call, arg: NonTensorArg = arg, derivation: ShapeDerivedArg = derivation) -> bool:
            def shape_of(ref: str) -> tuple[int, ...]:
                return call.in_leaves[contract.inputs[contract.input_index(ref)].flat_index].shape

            return call.in_leaves[arg.flat_index].value == derivation.value(shape_of)

        try:
            holds = all(agrees(call) for call in calls)
        except KeyError as exc:
            raise OmskillsError(f"candidate {contract.candidate}: derived argument {path}: {exc.args[0]}") from exc
        if holds:
            arg.derived = derivation


def _contract(
    recorder: _CandidateRecorder,
    name: str,
    calls: list[_Call],
    structures: int,
    frames: int | None,
    samples_dir: Path,
    relative_to: Path | None,
    derivations: dict[str, ShapeDerivedArg],
    dispatch: Dispatch | None = None,
    save: bool = True,
    total_calls: int | None = None,
) -> ContractSpec:
    inputs = _input_specs(recorder, calls)
    outputs = _output_specs(recorder, calls, {spec.name for spec in inputs})
    parent, attribute = _replacement_point(recorder.path)
    contract = ContractSpec(
        candidate=name,
        module_path=recorder.path,
        module_class=f"{type(recorder.module).__module__}.{type(recorder.module).__qualname__}",
        parent_path=parent,
        attribute=attribute,
        method="forward",
        calls=total_calls or len(calls),
        calls_per_frame=(total_calls or len(calls)) / frames if frames else None,
        in_spec=calls[0].in_spec,
        out_spec=calls[0].out_spec,
        inputs=inputs,
        outputs=outputs,
        non_tensor_args=_non_tensor_leaves(calls, outputs=False),
        non_tensor_outputs=_non_tensor_leaves(calls, outputs=True),
        structure_variants=structures,
        call_shapes=list({json.dumps(s.model_dump()): s for s in (c.shapes() for c in calls)}.values()),
        samples=_save_samples(recorder, name, calls, inputs, outputs, samples_dir, relative_to) if save else [],
        dispatch=dispatch,
    )
    _bind_derived(contract, calls, derivations)
    return contract


def _dispatch_groups(
    recorder: _CandidateRecorder, contract: ContractSpec, calls: list[_Call]
) -> list[tuple[dict[str, Any], list[_Call]]] | None:
    """Calls grouped by the values of the scalar non-tensor arguments that vary (and are not derived
    from shapes), or None when there are none, too many combinations to give each a graph, or a
    value whose calls were not sampled (its graph could be neither exported nor probed)."""
    varying = [arg for arg in contract.non_tensor_args if not arg.constant and arg.derived is None]
    if not varying:
        return None
    groups: dict[str, tuple[dict[str, Any], list[_Call]]] = {}
    for call in calls:
        values = {arg.tree_path: call.in_leaves[arg.flat_index].value for arg in varying}  # type: ignore[index]
        if not all(isinstance(v, _SCALARS) for v in values.values()):
            return None
        groups.setdefault(repr(sorted(values.items())), (values, []))[1].append(call)
    if len(groups) > MAX_DISPATCH_VALUES:
        return None
    if recorder.selector.limit and any(not recorder.selector.among(group) for _, group in groups.values()):
        return None
    return list(groups.values())


def _graph_name(candidate: str, values: dict[str, Any], parameter_names: list[str]) -> str:
    """ "mask_decoder-multimask_output_True": the candidate and the values its graph serves, in
    characters safe in file names, step keys and ATC's --output."""
    names = pytree.input_names(list(values), parameter_names)
    parts = [re.sub(r"[^0-9A-Za-z_.]+", "_", f"{n}_{v}").strip("_") for n, v in zip(names, values.values())]
    return "-".join([candidate] + parts)


def _contracts(
    recorder: _CandidateRecorder,
    frames: int | None,
    samples_dir: Path,
    relative_to: Path | None,
    derivations: dict[str, ShapeDerivedArg],
) -> list[ContractSpec]:
    """The candidate's contract on its main call structure; one per value of a dispatch argument."""
    structures = Counter(c.structure for c in recorder.calls)
    main = structures.most_common(1)[0][0]  # ties: Counter keeps first-seen order
    calls = [c for c in recorder.calls if c.structure == main]
    whole = _contract(
        recorder,
        recorder.name,
        calls,
        len(structures),
        frames,
        samples_dir,
        relative_to,
        derivations,
        save=False,
        total_calls=len(recorder.calls),
    )
    groups = _dispatch_groups(recorder, whole, calls)
    if groups is None:
        whole.samples = _save_samples(
            recorder, whole.candidate, calls, whole.inputs, whole.outputs, samples_dir, relative_to
        )
        return [whole]
    return [
        _contract(
            recorder,
            _graph_name(recorder.name, values, recorder.parameter_names),
            group,
            len(structures),
            frames,
            samples_dir,
            relative_to,
            derivations,
            dispatch=Dispatch(candidate=recorder.name, on=values),
        )
        for values, group in groups
    ]


# --------------------------------------------------------------------------- entry point


def _resolve(root: nn.Module, name: str, path: str) -> nn.Module:
    try:
        return root.get_submodule(path)
    except AttributeError as exc:
        raise OmskillsError(f"candidate {name}: module path {path!r} does not exist in {type(root).__name__}") from exc


def capture_contracts(
    root: nn.Module,
    candidates: dict[str, str],
    run: Callable[[], Any],
    tracker: ProvenanceTracker | None = None,
    samples_dir: Path | None = None,
    max_samples: int = 3,
    frame_counter: Callable[[], int] | None = None,
    relative_to: Path | None = None,
    derived_args: dict[str, dict[str, ShapeDerivedArg]] | None = None,
    input_sets: int = 1,
) -> list[ContractSpec]:
    """Run `run()` once with hooks on the candidates (name -> module path) and return their contracts.

    `tracker` is the driver's ProvenanceTracker (so it can tag frames, prompts and session state
    during the run); one is made if none is given. Samples go to `samples_dir` as
    `<name>_<k>.npz` (none are kept without a samples_dir), their paths stored relative to
    `relative_to` when given (the task workdir).
    `frame_counter()` returns the number of frames processed so far, for calls_per_frame.
    `derived_args` (candidate -> {argument tree path: derivation}) names non-tensor arguments the
    source computes from input shapes; each is bound where every observed call agrees with it.
    A candidate whose calls differ in other scalar non-tensor arguments gets one contract per
    combination of their values (`ContractSpec.dispatch`), each with samples of its own.
    `input_sets`: how many input sets `run` takes the main path through (`ContractSpec.input_sets`).
    """
    if max_samples < 0:
        raise OmskillsError(f"max_samples must be >= 0, got {max_samples}")
    tracker = tracker or ProvenanceTracker()
    derived_args = derived_args or {}
    spill = _SpillFolder(samples_dir) if samples_dir is not None and max_samples > 0 else None
    try:
        return _capture(
            root,
            candidates,
            run,
            tracker,
            samples_dir,
            max_samples,
            frame_counter,
            relative_to,
            derived_args,
            input_sets,
            spill,
        )
    finally:
        if spill is not None:
            spill.remove()


def _capture(
    root: nn.Module,
    candidates: dict[str, str],
    run: Callable[[], Any],
    tracker: ProvenanceTracker,
    samples_dir: Path | None,
    max_samples: int,
    frame_counter: Callable[[], int] | None,
    relative_to: Path | None,
    derived_args: dict[str, dict[str, ShapeDerivedArg]],
    input_sets: int,
    spill: _SpillFolder | None,
) -> list[ContractSpec]:
    recorders = [
        _CandidateRecorder(
            name,
            path,
            _resolve(root, name, path),
            tracker,
            max_samples if spill else 0,
            set(derived_args.get(name, {})),
            spill,
        )
        for name, path in candidates.items()
    ]
    tracker.preferred = set(candidates.values())
    handles: list[Any] = []
    try:
        with tracker.attached(root):
            for recorder in recorders:
                handles += recorder.attach()
            run()
    finally:
        for handle in handles:
            handle.remove()

    never_called = [r for r in recorders if not r.calls]
    if never_called:
        named = ", ".join(f"{r.name} ({r.path})" for r in never_called)
        verb = "was" if len(never_called) == 1 else "were"
        raise OmskillsError(f"candidate {named} {verb} never called on the main path")
    frames = frame_counter() if frame_counter else None
    contracts = [
        contract
        for r in recorders
        for contract in _contracts(r, frames, Path(samples_dir or "."), relative_to, derived_args.get(r.name, {}))
    ]
    for contract in contracts:
        contract.input_sets = input_sets
    return contracts
