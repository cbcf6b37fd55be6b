"""Closed sets of values the skill tools take, as `Literal` types: an MCP client sees them as `enum`.

Light on purpose (no onnx, no torch): the tool scripts import them at their top level. Each set is
written once: here, or in the light record module that owns it and imported or derived from it
(`Literal[...]`, `typing.get_args`). The one copy is EmulatedMode, whose source
(omskills.ascend.precision_modes.SPEED_ORDER) imports onnx; tests/test_tool_surface.py keeps the two equal.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from omskills.records.export import ExporterName
from omskills.records.intake import KNOWN_SOCS
from omskills.records.literals import BundleArtifact
from omskills.records.names import SafeName
from omskills.records.toolchain import VariantName
from pydantic import Field

# --precision_mode values documented for ATC (CANN 8.0 guide, `--precision_mode`); force_fp16 is
# the default for inference.
PrecisionMode = Literal[
    "force_fp16",
    "force_fp32",
    "cube_fp16in_fp32out",
    "allow_fp32_to_fp16",
    "must_keep_origin_dtype",
    "allow_mix_precision",
    "allow_mix_precision_fp16",
    "allow_mix_precision_bf16",
    "allow_fp32_to_bf16",
]
PRECISION_MODES: tuple[str, ...] = get_args(PrecisionMode)

# `--soc_version` names ATC takes (omskills.records.intake.KNOWN_SOCS), derived here so they never drift.
Soc = Literal[KNOWN_SOCS]  # type: ignore[valid-type]

# The ATC precision modes emulated on CPU: omskills.ascend.precision_modes.SPEED_ORDER (which imports onnx).
EmulatedMode = Literal[
    "force_fp16",
    "allow_mix_precision",
    "allow_mix_precision_fp16",
    "allow_fp32_to_fp16",
    "force_fp32",
    "cube_fp16in_fp32out",
    "must_keep_origin_dtype",
]

# What compare_layers sets the fp32 ONNX against.
CompareAgainst = Literal["emulated", "npu_dump", "pytorch"]

# verify_main_path: the graphs as exported, or each in its chosen ATC precision mode emulated on CPU.
VerifyPrecision = Literal["fp32", "emulated"]


# The `candidate` argument of the per-candidate tools (export_onnx ... convert_atc): a free name, since
# the plan decides which exist (the MCP server completes it from the task record).
CandidateName = Annotated[
    SafeName | None,
    Field(
        description="One candidate (graph) to work on, as plan_candidates names it; default: the plan's first batch."
    ),
]

__all__ = [
    "PRECISION_MODES",
    "BundleArtifact",
    "CandidateName",
    "CompareAgainst",
    "EmulatedMode",
    "ExporterName",
    "PrecisionMode",
    "Soc",
    "VariantName",
    "VerifyPrecision",
]
