"""Make Huawei's auto_optimizer (msit "surgeon", PyPI `ait-surgeon`) usable with today's onnx,
and apply its knowledges one at a time.

Why this layer exists:
- auto_optimizer imports `onnx.mapping`, which onnx removed in 1.19. Its two tables are rebuilt
  here from `onnx.helper.tensor_dtype_to_np_dtype` and registered as `onnx.mapping` before the
  import. Nothing else of onnx is patched.
- Its module `graph_optimizer.optimizer` calls `logging.basicConfig(stream=sys.stdout)` at import
  time, which would route every library's logging to stdout (and corrupt the MCP stdio stream);
  the root logger is restored after the import.
- Knowledges are applied one by one on a copy of the graph, so a broken knowledge (e.g.
  KnowledgeDynamicReshape) is recorded as failed and skipped instead of aborting the run, and
  one whose result fails strict shape inference is undone (recorded as rejected).

`ait-surgeon` 0.1.1 pins onnxruntime<1.16 and ms-ait, which would downgrade this environment;
install it with `pip install --no-deps ait-surgeon` (its remaining imports — numpy, onnx,
onnxruntime — are already here; click is only needed by its CLI).
"""

from __future__ import annotations

import copy
import importlib
import logging
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from omskills.errors import OmskillsError
from omskills.records.toolchain import KnowledgeOutcome
from onnx import TensorProto, helper

# Knowledges the tool itself leaves off unless asked (auto_optimizer.common.click_utils.
# default_off_knowledges): they change results (the *Fix ones, ResizeModeToNearest) or are
# known to fail on ordinary graphs (DynamicReshape). KnowledgeBigKernel needs arguments.
DEFAULT_OFF = (
    "KnowledgeEmptySliceFix",
    "KnowledgeTopkFix",
    "KnowledgeGatherToSplit",
    "KnowledgeSplitQKVMatmul",
    "KnowledgeDynamicReshape",
    "KnowledgeResizeModeToNearest",
    "KnowledgeBigKernel",
)


class AutoOptimizerUnavailable(OmskillsError):
    """auto_optimizer cannot be imported here; the message says why."""


def mapping_tables() -> tuple[dict[int, np.dtype], dict[np.dtype, int]]:
    """onnx.mapping's TENSOR_TYPE_TO_NP_TYPE and NP_TYPE_TO_TENSOR_TYPE, rebuilt from onnx.helper.

    Only numpy's own dtypes are kept (extension types such as bfloat16 or float8 come from
    ml_dtypes in new onnx and had no numpy equivalent in the old tables).
    """
    tensor_to_np: dict[int, np.dtype] = {}
    for _, code in TensorProto.DataType.items():
        if code == TensorProto.UNDEFINED:
            continue
        try:
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(code))
        except (KeyError, ValueError, TypeError):
            continue
        if dtype.kind == "V":  # ml_dtypes extension type
            continue
        tensor_to_np[code] = dtype
    np_to_tensor: dict[np.dtype, int] = {}
    for code, dtype in tensor_to_np.items():
        np_to_tensor.setdefault(dtype, code)  # first wins: float32 -> FLOAT, not a later alias
    return tensor_to_np, np_to_tensor


def install_onnx_mapping() -> bool:
    """Register a minimal `onnx.mapping` if this onnx lacks it. True when it was installed."""
    try:
        importlib.import_module("onnx.mapping")
        return False
    except ModuleNotFoundError:
        pass
    tensor_to_np, np_to_tensor = mapping_tables()
    shim = types.ModuleType("onnx.mapping")
    shim.__doc__ = "Compatibility tables rebuilt by omskills.convert.auto_optimizer (onnx >= 1.19 has no onnx.mapping)."
    shim.TENSOR_TYPE_TO_NP_TYPE = tensor_to_np
    shim.NP_TYPE_TO_TENSOR_TYPE = np_to_tensor
    sys.modules["onnx.mapping"] = shim
    onnx.mapping = shim  # type: ignore[attr-defined]
    return True


@dataclass(frozen=True)
class AutoOptimizerApi:
    """The three things used from auto_optimizer."""

    OnnxGraph: Any
    GraphOptimizer: Any
    knowledge_pool: dict[str, Any]
    version: str


def load_auto_optimizer() -> AutoOptimizerApi:
    """Import auto_optimizer through the compatibility layer, or raise AutoOptimizerUnavailable."""
    install_onnx_mapping()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        from auto_optimizer import KnowledgeFactory, OnnxGraph
        from auto_optimizer.graph_optimizer.optimizer import GraphOptimizer
    except ImportError as err:
        raise AutoOptimizerUnavailable(
            f"auto_optimizer is not importable ({err}); install it with `pip install --no-deps ait-surgeon`"
        ) from None
    finally:
        # Undo the import-time logging.basicConfig(stream=sys.stdout).
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
        root.setLevel(level)
    return AutoOptimizerApi(
        OnnxGraph=OnnxGraph,
        GraphOptimizer=GraphOptimizer,
        knowledge_pool=dict(KnowledgeFactory.get_knowledge_pool()),
        version=_distribution_version("ait-surgeon"),
    )


def default_knowledges(api: AutoOptimizerApi) -> list[str]:
    """All registered knowledges except the ones the tool leaves off by default."""
    return [name for name in api.knowledge_pool if name not in DEFAULT_OFF]


def apply_knowledges(
    api: AutoOptimizerApi, model: str | Path | onnx.ModelProto, knowledges: list[str] | None = None
) -> tuple[onnx.ModelProto, list[KnowledgeOutcome]]:
    """Apply each knowledge in turn on a copy of the graph; keep the copy when it applied.

    Returns the optimised model and one outcome per knowledge. Unknown knowledge names raise.
    """
    names = default_knowledges(api) if knowledges is None else knowledges
    unknown = [n for n in names if n not in api.knowledge_pool]
    if unknown:
        raise OmskillsError(
            f"knowledges: unknown auto_optimizer knowledge(s) {unknown}; known: {sorted(api.knowledge_pool)}"
        )
    graph = api.OnnxGraph.parse(model if isinstance(model, onnx.ModelProto) else str(model))
    outcomes: list[KnowledgeOutcome] = []
    for name in names:
        knowledge = api.knowledge_pool[name]
        if hasattr(knowledge, "reset"):
            knowledge.reset()
        candidate = copy.deepcopy(graph)
        try:
            applied = bool(api.GraphOptimizer.optimize(candidate, knowledge))
        except Exception as err:  # a knowledge's bug must not stop the others
            outcomes.append(KnowledgeOutcome(name=name, outcome="failed", error=f"{type(err).__name__}: {err}"[:500]))
            continue
        if not applied:
            outcomes.append(KnowledgeOutcome(name=name, outcome="not_matched"))
            continue
        problem = graph_problem(candidate.model())
        if problem:
            outcomes.append(KnowledgeOutcome(name=name, outcome="rejected", error=problem[:500]))
            continue
        graph = candidate
        outcomes.append(KnowledgeOutcome(name=name, outcome="applied"))
    return graph.model(), outcomes


def graph_problem(model: onnx.ModelProto) -> str | None:
    """Why a rewritten model is not valid ONNX (strict shape inference), or None.

    Some knowledges leave type-inconsistent graphs (KnowledgeTypeCast can give one Slice both
    int32 and int64 index inputs); this catches them per knowledge so the others still apply.
    Models over 2 GiB cannot be serialised for the check and are not verified here (the
    variant's own checks still run).
    """
    if model.ByteSize() > 2**31 - 1:
        return None
    try:
        onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def _distribution_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"
