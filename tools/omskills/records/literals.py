"""Closed sets of values that the command-line parser offers as choices too.

Standard library only: `omskills` builds its parser (for every command, `--version` included)
without importing pydantic or the engine, so these cannot live beside the pydantic records.
omskills.records.choices re-exports them for the skill tools.
"""

from __future__ import annotations

from typing import Literal

# write_bundle / `omskills bundle --artifact`: which compiled artifacts go into the bundle.
BundleArtifact = Literal["auto", "onnx", "om"]
