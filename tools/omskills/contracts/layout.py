"""How a contract's call and output trees lie flat: which leaves are tensors, which constants.

Shared by the export wrapper and the spliced module, so both read a call the same way. Light on
purpose (torch and the records only): the deployed path imports it without the export machinery.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from omskills.contracts.pytree import OUTPUT_ROOT, leaf_paths, spec_from_str
from omskills.errors import InputError
from omskills.records.contracts import ContractSpec, NonTensorArg, TensorSpec


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a contract's dtype name ("float32", "int64", "bool", ...)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InputError(f"dtype: unknown tensor dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class LeafRole:
    """Where one leaf of a tree comes from: the index-th tensor or the index-th non-tensor leaf."""

    is_tensor: bool
    index: int


@dataclass(frozen=True)
class TreeLayout:
    """The flat layout of a contract's call or output tree: which leaves are tensors, which constants."""

    roles: tuple[LeafRole, ...]
    paths: tuple[str, ...]

    @classmethod
    def of_call(cls, contract: ContractSpec) -> TreeLayout:
        paths = leaf_paths(spec_from_str(contract.in_spec))
        return cls._build(contract.candidate, "in_spec", paths, contract.inputs, contract.non_tensor_args)

    @classmethod
    def of_output(cls, contract: ContractSpec) -> TreeLayout:
        paths = leaf_paths(spec_from_str(contract.out_spec), root=OUTPUT_ROOT)
        return cls._build(contract.candidate, "out_spec", paths, contract.outputs, contract.non_tensor_outputs)

    @classmethod
    def _build(
        cls, candidate: str, field: str, paths: list[str], tensors: list[TensorSpec], others: list[NonTensorArg]
    ) -> TreeLayout:
        where = f"contract {candidate!r}"
        tensor_at = {spec.tree_path: i for i, spec in enumerate(tensors)}
        other_at = {arg.tree_path: i for i, arg in enumerate(others)}
        roles = []
        for path in paths:
            if path in tensor_at:
                roles.append(LeafRole(True, tensor_at[path]))
            elif path in other_at:
                roles.append(LeafRole(False, other_at[path]))
            else:
                raise InputError(f"{where}: {field} leaf {path} is in neither the tensor nor the non-tensor leaves")
        tensor_order = [role.index for role in roles if role.is_tensor]
        if tensor_order != list(range(len(tensors))):
            raise InputError(f"{where}: tensors are not listed in the flat order of {field} ({paths})")
        if len(roles) - len(tensor_order) != len(others):
            raise InputError(f"{where}: non-tensor leaves listed that are not leaves of {field}")
        return cls(roles=tuple(roles), paths=tuple(paths))

    def merge(self, tensors: Sequence[Any], constants: Sequence[Any]) -> list[Any]:
        """The tree's leaves in flat order, from its tensors and its non-tensor values."""
        return [tensors[r.index] if r.is_tensor else constants[r.index] for r in self.roles]

    def tensors_of(self, leaves: Sequence[Any]) -> list[Any]:
        return [leaf for leaf, role in zip(leaves, self.roles) if role.is_tensor]

    def others_of(self, leaves: Sequence[Any]) -> list[Any]:
        return [leaf for leaf, role in zip(leaves, self.roles) if not role.is_tensor]
