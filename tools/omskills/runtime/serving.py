"""Open the backend that serves one deployed graph, as its artifact and shape strategy require.

- `om`: an ais_bench InferSession in the mode of the ATC shape strategy the OM was built with
  (static, dymbatch, dymhw, dymdims, dymshape) on the record's device. An OM built with batch
  gears serves any batch as gear-sized calls (`SplitBatchBackend` with gears).
- `onnxruntime`: a session on the providers asked for (or the preferred ones present). The CANN
  provider gets the device id and the precision mode chosen in emulation; on the CPU the batch runs
  in the chunks probe_onnx found it needs.

The caller chooses between the two (`resolve_backend` for "auto").
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from omskills.records.deploy import DeployedGraph
from omskills.runtime import open_backend
from omskills.runtime.base import BackendError, RuntimeBackend
from omskills.runtime.batch_split import SplitBatchBackend, batch_split_for
from omskills.runtime.om_backend import ais_bench_available, om_mode_for_strategy
from omskills.runtime.onnxruntime_backend import resolve_providers

logger = logging.getLogger(__name__)

CANN_PROVIDER = "CANNExecutionProvider"
CPU_PROVIDER = "CPUExecutionProvider"
SERVING_BACKENDS = ("auto", "om", "onnxruntime")

# InferSession in dymshape mode needs each output's buffer size up front. The sizes come from the
# largest output seen at capture, times this margin (calls within the strategy's ranges may be larger).
DYMSHAPE_OUTPUT_MARGIN = 4


def resolve_backend(requested: str, graphs: Sequence[DeployedGraph]) -> str:
    """ "om" or "onnxruntime" for `requested` ("auto": the OM where every graph has one and ais_bench
    is installed, else ONNX Runtime on its best provider). Logs what "auto" chose and why."""
    if requested not in SERVING_BACKENDS:
        raise BackendError(f"backend: {requested!r} is not one of {list(SERVING_BACKENDS)}")
    if requested != "auto":
        return requested
    without_om = [g.name for g in graphs if g.om is None]
    if not without_om and ais_bench_available():
        logger.info("backend auto: om (ais_bench is installed and every graph has an OM)")
        return "om"
    why = f"no OM for {without_om}" if without_om else "ais_bench is not installed"
    providers = resolve_providers(None)
    logger.info("backend auto: onnxruntime on %s (%s)", providers[0], why)
    return "onnxruntime"


def open_graph(
    graph: DeployedGraph,
    root: Path,
    backend: str,
    *,
    device_id: int = 0,
    providers: Sequence[str] | None = None,
    model: Path | None = None,
) -> RuntimeBackend | SplitBatchBackend:
    """The backend serving `graph` ("om" or "onnxruntime"); `model` replaces the graph's ONNX file
    (an emulated rewrite of it, say)."""
    if backend == "om":
        return _open_om(graph, root, device_id)
    if backend == "onnxruntime":
        return _open_onnxruntime(graph, model or root / graph.onnx.path, device_id, providers)
    raise BackendError(f"backend: {backend!r} is not 'om' or 'onnxruntime'")


def _open_om(graph: DeployedGraph, root: Path, device_id: int) -> RuntimeBackend | SplitBatchBackend:
    if graph.om is None:
        raise BackendError(
            f"{graph.name}: no OM was built (run its ATC script where CANN is installed: "
            f"{graph.atc_script or 'convert_atc'}), so it cannot run on the om backend"
        )
    strategy = graph.strategy
    mode = om_mode_for_strategy(strategy.kind) if strategy else "static"
    sizes = _dymshape_sizes(graph) if mode == "dymshape" else None
    om = open_backend(root / graph.om.path, "om", device_id=device_id, mode=mode, custom_sizes=sizes)
    if strategy is not None and strategy.kind == "dynamic_batch_size":
        gears = sorted({gear[0] for gear in strategy.gears if gear})
        split = batch_split_for(graph.contract, strategy, max(gears), "the OM runs only its batch gears")
        if split is not None:
            return SplitBatchBackend(om, split, gears=gears)
    return om


def _open_onnxruntime(
    graph: DeployedGraph, model: Path, device_id: int, providers: Sequence[str] | None
) -> RuntimeBackend | SplitBatchBackend:
    cann = {"device_id": str(device_id)}
    if graph.precision_mode:
        cann["precision_mode"] = graph.precision_mode
    backend = open_backend(model, "onnxruntime", providers=providers, provider_options={CANN_PROVIDER: cann})
    if graph.batch_split is not None and backend.device == CPU_PROVIDER:
        return SplitBatchBackend(backend, graph.batch_split)
    return backend


def _dymshape_sizes(graph: DeployedGraph) -> list[int]:
    sizes = []
    for index, spec in enumerate(graph.contract.outputs):
        shapes = [call.outputs[index] for call in graph.contract.call_shapes if index < len(call.outputs)] or [
            spec.shape
        ]
        largest = max(int(np.prod(shape)) if shape else 1 for shape in shapes)
        itemsize = 2 if spec.dtype == "bfloat16" else np.dtype(spec.dtype).itemsize  # numpy has no bfloat16
        sizes.append(largest * itemsize * DYMSHAPE_OUTPUT_MARGIN)
    return sizes
