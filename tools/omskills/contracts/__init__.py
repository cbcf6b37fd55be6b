"""Capturing the real I/O contracts of candidate modules on the main path (stage 2)."""

from __future__ import annotations

import importlib
from typing import Any

# - `pytree`: flatten/unflatten calls and outputs (dataclasses and driver-named containers
#   registered), serialisable tree specs, readable leaf paths and ONNX-valid names;
# - `layout`: which leaves of a contract's call and output trees are tensors, which constants;
# - `provenance`: `ProvenanceTracker`, where each tensor came from (user input, session,
#   parameter, another module) and which modules consume it;
# - `capture`: `capture_contracts`, hooks on the candidates during one run -> `ContractSpec`s;
# - `samples`: npz samples of real calls that reload bit-exactly.
# The names below are imported on first use: the deployed path reads `pytree` and `layout` and must
# not load the capture machinery with them.

_LAZY = {
    "capture_contracts": "omskills.contracts.capture",
    "ProvenanceTracker": "omskills.contracts.provenance",
    "Sample": "omskills.contracts.samples",
    "load_sample": "omskills.contracts.samples",
    "save_sample": "omskills.contracts.samples",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'omskills.contracts' has no attribute {name!r}")


__all__ = ["ProvenanceTracker", "Sample", "capture_contracts", "load_sample", "save_sample"]
