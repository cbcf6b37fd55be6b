"""Stage 2 engine: capture the real I/O contracts of candidate modules on the main path.

- `pytree`: flatten/unflatten calls and outputs (dataclasses and driver-named containers registered),
  serialisable tree specs, readable leaf paths and ONNX-valid names;
- `provenance`: `ProvenanceTracker`, where each tensor came from (user input, session,
  parameter, another module) and which modules consume it;
- `capture`: `capture_contracts`, hooks on the candidates during one run -> `ContractSpec`s;
- `samples`: npz samples of real calls that reload bit-exactly.
"""

from omskills.contracts.capture import capture_contracts
from omskills.contracts.provenance import ProvenanceTracker
from omskills.contracts.samples import Sample, load_sample, save_sample

__all__ = ["ProvenanceTracker", "Sample", "capture_contracts", "load_sample", "save_sample"]
