"""Flatten a module call's (args, kwargs) and its output into tensor leaves and a tree spec.

Built on torch.utils._pytree, so the spec we store is the one torch.export and the export wrapper
understand. Dataclasses torch does not know are registered on demand the first time they are
met, and so are classes a model registered itself without keys; a driver names other container
classes (`ModelDriver.pytree_types`, e.g. a DETR-style NestedTensor). Each gets a serialised name
"module:qualname" that `spec_from_str` can import again in another process. Non-tensor leaves (ints, floats, bools,
strings, None, other objects) stay in the flat list as constants.

Leaf paths are readable strings: `args[0]['x'].tensors`, `kwargs['mask']`, `out[1]`.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pt
from omskills.errors import OmskillsError

# Paths of a call tree (args, kwargs) start with "args" or "kwargs"; of an output with "out".
CALL_ROOTS = ("args", "kwargs")
OUTPUT_ROOT = "out"


@dataclass(frozen=True)
class FlatTree:
    """A pytree taken apart: leaves in flat order, their readable paths, and the spec to rebuild it."""

    leaves: list[Any]
    paths: list[str]
    spec: pt.TreeSpec

    def tensor_indices(self) -> list[int]:
        return [i for i, leaf in enumerate(self.leaves) if isinstance(leaf, torch.Tensor)]

    def tensors(self) -> list[torch.Tensor]:
        return [self.leaves[i] for i in self.tensor_indices()]


# --------------------------------------------------------------------------- registration


def serialized_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def is_registered(cls: type) -> bool:
    """Registered with what flattening by path and serialising the spec need (keys, a type name)."""
    node = pt.SUPPORTED_NODES.get(cls)
    if node is None:
        return False
    return node.flatten_with_keys_fn is not None


def _needs_registration(obj: Any) -> bool:
    cls = type(obj)
    if is_registered(cls) or isinstance(obj, (torch.Tensor, tuple, list, dict)):
        return False
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _attribute_names(obj: Any) -> tuple[str, ...]:
    """The attributes that make up a struct: dataclass fields first, then any other instance attributes."""
    names: list[str] = []
    if dataclasses.is_dataclass(obj):
        # A field(init=False) may not be set yet: only attributes the object really has.
        names = [f.name for f in dataclasses.fields(obj) if hasattr(obj, f.name)]
    names += [k for k in getattr(obj, "__dict__", {}) if k not in names]
    return tuple(names)


def register_struct(cls: type) -> None:
    """Register a dataclass or attribute class as a pytree node.

    Children are its attributes (per instance, so optional extra attributes survive); it is rebuilt
    without calling __init__/__post_init__, so the object comes back exactly as it was.
    """
    if is_registered(cls):
        return
    if cls in pt.SUPPORTED_NODES:
        # The model registered it itself without keys or a serialised name: replace that
        # registration with one that has both; same children.
        pt._deregister_pytree_node(cls)

    def flatten(obj: Any) -> tuple[list[Any], tuple[str, ...]]:
        names = _attribute_names(obj)
        return [getattr(obj, n) for n in names], names

    def flatten_with_keys(obj: Any) -> tuple[list[tuple[pt.KeyEntry, Any]], tuple[str, ...]]:
        names = _attribute_names(obj)
        return [(pt.GetAttrKey(n), getattr(obj, n)) for n in names], names

    def unflatten(values: Any, names: tuple[str, ...]) -> Any:
        obj = cls.__new__(cls)
        for name, value in zip(names, values):
            object.__setattr__(obj, name, value)  # also works on frozen dataclasses
        return obj

    pt.register_pytree_node(
        cls,
        flatten,
        unflatten,
        serialized_type_name=serialized_name(cls),
        to_dumpable_context=lambda names: json.dumps(list(names)),
        from_dumpable_context=lambda text: tuple(json.loads(text)),
        flatten_with_keys_fn=flatten_with_keys,
    )


def ensure_registered(tree: Any) -> None:
    """Register every dataclass, and every class registered without keys, found in `tree`
    (repeats until nested ones are found too)."""
    while True:
        found = {type(leaf) for leaf in pt.tree_leaves(tree, is_leaf=is_opaque) if _needs_registration(leaf)}
        found |= {
            t for t in _node_types(pt.tree_structure(tree, is_leaf=is_opaque)) if t is not None and not is_registered(t)
        }
        if not found:
            return
        for cls in found:
            register_struct(cls)


def _node_types(spec: pt.TreeSpec) -> set[type]:
    """Every node type in a spec (a model may have registered some without keys)."""
    types = {spec.type}
    for child in spec.children():
        types |= _node_types(child)
    return types


def _ensure_serialisable(spec: pt.TreeSpec) -> None:
    # Namedtuples flatten natively but need a serialised name before treespec_dumps accepts them.
    if spec.is_leaf():
        return
    # A namedtuple node has type `collections.namedtuple` and its class as context.
    cls = spec.context
    if spec.type is pt.namedtuple and isinstance(cls, type) and cls not in pt.SUPPORTED_SERIALIZED_TYPES:
        pt._register_namedtuple(cls, serialized_type_name=serialized_name(cls))
    for child in spec.children():
        _ensure_serialisable(child)


# --------------------------------------------------------------------------- flatten / unflatten


def _key_str(key: pt.KeyEntry) -> str:
    return str(key)  # SequenceKey -> "[0]", MappingKey -> "['k']", GetAttrKey -> ".name"


def is_opaque(node: Any) -> bool:
    """A container kept whole, as one Python leaf: a dict keyed by objects (a cache keyed by
    modules) has no description a record or a graph signature can hold."""
    return isinstance(node, dict) and not all(isinstance(key, (str, int)) for key in node)


def holds_tensors(node: Any) -> bool:
    """An opaque container with tensors inside (state a graph cannot take as an argument)."""
    return is_opaque(node) and any(isinstance(v, torch.Tensor) for v in pt.tree_leaves(list(node.values())))


def flatten(tree: Any, root: str = OUTPUT_ROOT) -> FlatTree:
    """Flatten any structure; paths are prefixed with `root` (e.g. "out[0]")."""
    ensure_registered(tree)
    with_paths, spec = pt.tree_flatten_with_path(tree, is_leaf=is_opaque)
    paths = [root + "".join(_key_str(k) for k in path) for path, _ in with_paths]
    return FlatTree(leaves=[leaf for _, leaf in with_paths], paths=paths, spec=spec)


def flatten_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> FlatTree:
    """Flatten a call's (args, kwargs); paths start with "args[i]" or "kwargs['name']"."""
    tree = (tuple(args), dict(kwargs))
    ensure_registered(tree)
    with_paths, spec = pt.tree_flatten_with_path(tree, is_leaf=is_opaque)
    paths = []
    for path, _ in with_paths:
        head = CALL_ROOTS[path[0].idx]  # type: ignore[attr-defined]
        paths.append(head + "".join(_key_str(k) for k in path[1:]))
    return FlatTree(leaves=[leaf for _, leaf in with_paths], paths=paths, spec=spec)


def unflatten(leaves: list[Any], spec: pt.TreeSpec) -> Any:
    return pt.tree_unflatten(list(leaves), spec)


def unflatten_call(leaves: list[Any], spec: pt.TreeSpec) -> tuple[tuple[Any, ...], dict[str, Any]]:
    args, kwargs = unflatten(leaves, spec)
    return tuple(args), dict(kwargs)


def leaf_paths(spec: pt.TreeSpec, root: str | None = None) -> list[str]:
    """Readable leaf paths of a spec alone (rebuilds it with placeholder leaves); root None = call tree."""
    placeholder = unflatten([0] * spec.num_leaves, spec)
    if root is None:
        return flatten_call(*placeholder).paths
    return flatten(placeholder, root=root).paths


# --------------------------------------------------------------------------- serialisation


def spec_to_str(spec: pt.TreeSpec) -> str:
    _ensure_serialisable(spec)
    return pt.treespec_dumps(spec)


def _import_type(name: str) -> type:
    module_name, _, qualname = name.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise OmskillsError(f"tree spec names type {name!r}, which cannot be imported here: {exc}") from exc
    return obj


def _register_types_named_in(schema: Any) -> None:
    type_name = schema.get("type")
    if type_name == "collections.namedtuple":  # the namedtuple's own class is named in the context
        class_name = schema.get("context")
        if class_name not in pt.SERIALIZED_TYPE_TO_PYTHON_TYPE:
            pt._register_namedtuple(_import_type(class_name), serialized_type_name=class_name)
    if type_name and type_name not in pt.SERIALIZED_TYPE_TO_PYTHON_TYPE:
        if ":" not in type_name:
            raise OmskillsError(f"tree spec names type {type_name!r}, which is not registered with torch pytree")
        cls = _import_type(type_name)
        if pt.is_namedtuple_class(cls):
            pt._register_namedtuple(cls, serialized_type_name=type_name)
        else:
            register_struct(cls)
    for child in schema.get("children_spec", []):
        _register_types_named_in(child)


def spec_from_str(text: str) -> pt.TreeSpec:
    """Load a spec written by `spec_to_str`, importing and registering the classes it names."""
    try:
        _protocol, schema = json.loads(text)
    except (ValueError, TypeError) as exc:
        raise OmskillsError(f"tree spec is not valid JSON: {exc}") from exc
    _register_types_named_in(schema)
    return pt.treespec_loads(text)


# --------------------------------------------------------------------------- names


_NOT_NAME_CHAR = re.compile(r"[^0-9A-Za-z_]+")


def positional_parameter_names(fn: Callable[..., Any]) -> list[str]:
    """Names of the positional parameters of `fn` (a bound forward), used to name args[i]."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds]


def _sanitise(name: str, fallback: str) -> str:
    name = _NOT_NAME_CHAR.sub("_", name).strip("_")
    name = re.sub(r"_+", "_", name)
    if not name:
        return fallback
    return name if not name[0].isdigit() else f"{fallback}_{name}"


def _parts_of(path: str) -> list[str]:
    # "args[0]['x'].tensors" -> ["args", "0", "x", "tensors"]
    return [p for p in re.split(r"[\[\]'\".]+", path) if p]


def _unique(names: list[str], taken: set[str]) -> list[str]:
    result = []
    for name in names:
        candidate, n = name, 2
        while candidate in taken:
            candidate, n = f"{name}_{n}", n + 1
        taken.add(candidate)
        result.append(candidate)
    return result


def input_names(paths: list[str], parameter_names: list[str]) -> list[str]:
    """ONNX-valid, unique names for input leaves: args[i] takes the parameter's name, else in_i."""
    names = []
    for path in paths:
        parts = _parts_of(path)
        if parts[0] == "args":
            index = int(parts[1])
            head = parameter_names[index] if index < len(parameter_names) else f"in_{index}"
            parts = [head] + parts[2:]
        else:
            parts = parts[1:]
        names.append(_sanitise("_".join(parts), "in"))
    return _unique(names, set())


def output_names(paths: list[str], taken: set[str]) -> list[str]:
    """ONNX-valid names for output leaves, unique and distinct from the input names in `taken`."""
    names = []
    for path in paths:
        parts = _parts_of(path)[1:]  # drop "out"
        if not parts or parts[0].isdigit():
            parts = ["out"] + parts
        name = _sanitise("_".join(parts), "out")
        if name in taken:
            name = f"out_{name}"
        names.append(name)
    return _unique(names, set(taken))
