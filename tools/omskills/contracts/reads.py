"""What reads a tensor's values: every torch function but those that only look at its metadata.

The study counts a graph output as read when a torch function that reads values takes it after the
call (`provenance`), and a deployment leaves an output the study never saw read on the device
(`splicing.unfetched`): its placeholder answers metadata from what the runtime reported and copies
the values back at the first function that reads them. Both use this one definition, so what the
study did not count as a read is exactly what the placeholder answers without the values. Which
functions write into a tensor in place is here too: the study's lineage, the glue's capture and a
deferred write at deployment take it from one place.
"""

from __future__ import annotations

from typing import Any

# Shape, type and place: known without the values (`len` is the size of dim 0).
METADATA = frozenset(
    {
        "shape",
        "dtype",
        "device",
        "layout",
        "size",
        "dim",
        "ndim",
        "ndimension",
        "numel",
        "nelement",
        "nbytes",
        "itemsize",
        "element_size",
        "__len__",
        "is_floating_point",
        "is_complex",
        "is_cuda",
        "is_cpu",
        "is_meta",
        "is_sparse",
        "is_quantized",
        "requires_grad",
        "untyped_storage",  # provenance keys tensors by their storage: its own look-ups read nothing
    }
)


def function_name(func: Any) -> str:
    """`torch.Tensor.size` -> "size"; a property's getter (`Tensor.shape.__get__`) -> "shape"."""
    name = getattr(func, "__name__", "")
    owner = getattr(func, "__self__", None)
    if name == "__get__" and owner is not None:
        return getattr(owner, "__name__", name)
    return name


def reads_values(func: Any) -> bool:
    return function_name(func) not in METADATA


# Names ending in "_" that write no values.
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "detach_", "rename_", "refine_names_"})
_IN_PLACE_DUNDERS = frozenset(
    {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
     "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}
)  # fmt: skip


def writes_in_place(op: str, kwargs: dict[str, Any]) -> bool:
    """Whether the op writes into its first argument (`add_`, `x[i] = v`, `x += y`) or into `out=`."""
    if kwargs.get("out") is not None or op in _IN_PLACE_DUNDERS:
        return True
    return op.endswith("_") and not op.startswith("__") and op not in _NOT_WRITES
