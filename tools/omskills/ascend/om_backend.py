"""OM backend: runs an ATC-compiled `.om` model through ais_bench's InferSession.

Interface used (and nothing else), as documented in the ait/msit benchmark
"interface python API" guide (gitee.com/ascend/ait, ait/docs/benchmark/API_GUIDE.md; mirrored at
github.com/mjlovesz/test-my-pages docs/benchmark/API_GUIDE.md) and its samples
(ait/components/benchmark/api_samples/interface_api_usage/api_infer/infer_api_*.py):

- `InferSession(device_id: int, model_path: str, acl_json_path=None, debug=False, loop=1)`
- `get_inputs()` / `get_outputs()` -> list of `aclruntime.tensor_desc` with `.name`, `.shape`
  (list[int], -1 for a dimension that varies) and `.datatype` (enum `aclruntime.dtype`: 'uint8',
  'int8', 'uint16', 'int16', 'uint32', 'int32', 'uint64', 'int64', 'float16', 'float32',
  'double64', 'bool')
- `infer(feeds: list, mode='static', custom_sizes=100000, out_array=True)` -> list[np.ndarray];
  feeds are positional in `get_inputs()` order; outputs come in `get_outputs()` order; `mode` is
  one of 'static', 'dymbatch', 'dymhw', 'dymdims', 'dymshape' and must match how ATC compiled
  the model; `custom_sizes` (bytes per output, int or list) only matters for 'dymshape'. With
  `out_array=False` the outputs are `aclruntime.Tensor`s in device memory (the guide); each is
  copied back by `tensor.to_host()` then `numpy.array(tensor)`, which is what `InferSession.run`
  does for `out_array=True` (ais_bench/infer/interface.py, `convert_tensors_to_host` and
  `convert_tensors_to_arrays`), and it has a `.shape`.
- `free_resource()` frees the session's device memory (newer releases; older ones lack it).

`ais_bench` and `aclruntime` are not on PyPI: they come as wheels built for an Ascend host
with CANN installed, so this module imports them only when a session is opened.

ACL context. ACL keeps one current context per thread. InferSession makes its own context current
when it loads the model, and `torch_npu` has its own: a process that uses both, without care, calls
one library with the other's context current (ACL errors 107002 "the context is empty" and 107003
"the stream is not in the current context"). Through pyACL (`acl.rt.get_context` /
`acl.rt.set_context`, CANN's Python AscendCL API) this backend remembers the session's context
when it loads, makes it current around each `infer`, and puts the caller's back afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Literal, get_args

import numpy as np
from omskills.ascend.probe import om_runtime_problem
from omskills.records.deploy import DeployedGraph
from omskills.runtime.base import BackendError, HeldOutput, IOSpec, Placement, Runner, RuntimeBackend
from omskills.runtime.batch_split import served_in_gears

OmMode = Literal["static", "dymbatch", "dymhw", "dymdims", "dymshape"]
OM_MODES: tuple[str, ...] = get_args(OmMode)

# ATC shape strategy (records.contracts.ShapeStrategy.kind) -> InferSession.infer mode.
_MODE_FOR_STRATEGY: dict[str, OmMode] = {
    "static": "static",
    "dynamic_batch_size": "dymbatch",
    "dynamic_image_size": "dymhw",
    "dynamic_dims": "dymdims",
    "dynamic_shape": "dymshape",
}

# Gear models (dynamic batch / image size / dims) get an extra input through which ACL is told
# the gear; it is the runtime's business, not a model input (CANN AscendCL guide,
# "Model Inference with Dynamic-Shape Inputs": ACL_DYNAMIC_TENSOR_NAME).
ACL_DYNAMIC_TENSOR_NAME = "ascend_mbatch_shape_data"

# aclruntime.dtype names that numpy spells differently.
_ACL_TO_NUMPY = {"double64": "float64"}

_MISSING_AIS_BENCH = (
    "the OM backend needs an Ascend NPU host with CANN and the ais_bench + aclruntime wheels "
    "(not on PyPI; built from Ascend's msit/ait benchmark tool): {reason}"
)


def om_mode_for_strategy(kind: str) -> OmMode:
    """The InferSession mode that matches an ATC shape strategy kind."""
    try:
        return _MODE_FOR_STRATEGY[kind]
    except KeyError:
        known = list(_MODE_FOR_STRATEGY)
        raise BackendError(f"shape strategy: unknown kind {kind!r}; expected one of {known}") from None


def import_infer_session():
    """`ais_bench.infer.interface.InferSession`, or a BackendError saying what is missing."""
    try:
        from ais_bench.infer.interface import InferSession
    except ImportError as exc:  # aclruntime also fails here when CANN's libraries are absent
        raise BackendError(_MISSING_AIS_BENCH.format(reason=exc)) from exc
    return InferSession


def ais_bench_available() -> bool:
    try:
        import_infer_session()
    except BackendError:
        return False
    return True


def _pyacl():
    """CANN's pyACL module, or None where it is not installed (then contexts are left alone)."""
    try:
        import acl
    except ImportError:
        return None
    return acl


class AclContexts:
    """The thread's current ACL context, read and set through pyACL (no-ops without it)."""

    def __init__(self) -> None:
        self.acl = _pyacl()

    def current(self) -> object | None:
        if self.acl is None:
            return None
        context, ret = self.acl.rt.get_context()
        return context if ret == 0 and context else None

    def make_current(self, context: object | None) -> None:
        if self.acl is None or context is None:
            return
        ret = self.acl.rt.set_context(context)
        if ret != 0:
            raise BackendError(f"acl.rt.set_context failed with ACL error {ret}")

    @contextlib.contextmanager
    def held(self, context: object | None) -> Iterator[None]:
        """`context` current inside the block; the caller's (torch_npu's, say) back after it."""
        saved = self.current()
        switch = context is not None and context != saved
        if switch:
            self.make_current(context)
        try:
            yield
        finally:
            if switch and saved is not None:
                self.make_current(saved)

    def soc_name(self) -> str | None:
        get = getattr(self.acl, "get_soc_name", None)
        return get() if callable(get) else None


class OmBackend(RuntimeBackend):
    kind = "om"
    auto_rank = 0  # "auto" takes the OM wherever every graph has one and ais_bench is installed

    @classmethod
    def unavailable(cls) -> str | None:
        return None if ais_bench_available() else "ais_bench is not installed"

    @classmethod
    def runs_here(cls) -> list[str]:
        """'om' where the OM runtime imports (in a child: it may abort without Ascend drivers) and
        an NPU is listed."""
        return [] if om_runtime_problem() else [cls.kind]

    @classmethod
    def cannot_serve(cls, graph: DeployedGraph) -> str | None:
        if graph.om is None:
            return f"no OM was built (run its ATC script where CANN is installed: {graph.atc_script or 'convert_atc'})"
        return None

    @classmethod
    def serve(cls, graph: DeployedGraph, root: Path, placement: Placement) -> Runner:
        """An InferSession in the mode of the ATC shape strategy the OM was built with, on the NPU
        `placement.device_id`; an OM built with batch gears serves any batch as gear-sized calls."""
        if graph.om is None:
            raise BackendError(f"{graph.name}: {cls.cannot_serve(graph)}, so it cannot run on the om backend")
        strategy = graph.strategy
        mode = om_mode_for_strategy(strategy.kind) if strategy else "static"
        sizes = _dymshape_sizes(graph) if mode == "dymshape" else None
        om = cls(root / graph.om.path, device_id=placement.device_id, mode=mode, custom_sizes=sizes).activate()
        return served_in_gears(om, graph, "the OM runs only its batch gears") or om

    def __init__(
        self,
        path: str | Path,
        device_id: int = 0,
        mode: OmMode = "static",
        custom_sizes: int | list[int] | None = None,
    ) -> None:
        super().__init__(path)
        if mode not in OM_MODES:
            raise BackendError(
                f"mode: {mode!r} is not an InferSession mode; expected one of {list(OM_MODES)} "
                "(om_mode_for_strategy() maps an ATC shape strategy to its mode)"
            )
        if custom_sizes is not None and mode != "dymshape":
            raise BackendError(f"custom_sizes: only used with mode='dymshape', not mode={mode!r}")
        self.device_id = device_id
        self.mode: OmMode = mode
        self.custom_sizes = custom_sizes
        self._session = None
        self._contexts = AclContexts()
        self._context: object | None = None  # the context the session was loaded in

    def _activate_impl(self) -> tuple[list[IOSpec], list[IOSpec]]:
        infer_session = import_infer_session()
        caller = self._contexts.current()
        try:
            self._session = infer_session(self.device_id, str(self.path))
        except Exception as exc:  # aclruntime raises RuntimeError with ACL's code in the text
            raise BackendError(f"ais_bench cannot load {self.path} on npu:{self.device_id}: {exc}") from exc
        finally:
            self._context = self._contexts.current()
            if caller is not None and self._context != caller:
                self._contexts.make_current(caller)
        soc = self._contexts.soc_name()
        self.device = f"npu:{self.device_id}" + (f" ({soc})" if soc else "")
        inputs = [self._spec(d) for d in self._session.get_inputs() if d.name != ACL_DYNAMIC_TENSOR_NAME]
        outputs = [self._spec(d) for d in self._session.get_outputs()]
        self._check_mode_matches(inputs)
        return inputs, outputs

    def _spec(self, desc) -> IOSpec:
        shape = [int(d) for d in desc.shape]
        if self.mode in ("dymbatch", "dymhw", "dymdims"):
            # A gear model's descriptor may report -1 or the largest gear depending on the
            # aclruntime release; only rank and dtype are checked here and ACL itself rejects a
            # shape that is not one of the compiled gears.
            shape = [-1] * len(shape)
        return IOSpec(name=desc.name, shape=shape, dtype=_numpy_dtype(desc.datatype, desc.name))

    def _check_mode_matches(self, inputs: list[IOSpec]) -> None:
        # The one mismatch visible from the metadata: ACL reports -1 for dims a model leaves
        # open, and a static session cannot feed those.
        if self.mode == "static":
            dynamic = [spec.name for spec in inputs if not spec.is_static]
            if dynamic:
                raise BackendError(
                    f"mode: 'static' does not match {self.path.name}, whose input(s) {dynamic} have dynamic "
                    "dims; pass the mode of the ATC shape strategy (om_mode_for_strategy)"
                )

    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        values = self._infer(feeds)
        return {spec.name: np.asarray(value) for spec, value in zip(self._outputs, values)}

    def _fetch_impl(self, feeds: dict[str, np.ndarray], names: list[str]) -> Mapping[str, object]:
        """Only the outputs `names` cross the link: with out_array=False InferSession returns every
        output as an aclruntime.Tensor in device memory, and the others stay there, held until the
        host reads them (aclruntime allocates each call's output buffers anew, so a held output
        keeps that call's values)."""
        values = self._infer(feeds, out_array=False)
        return {
            spec.name: self._to_host(value) if spec.name in names else self._held(value)
            for spec, value in zip(self._outputs, values)
        }

    def _infer(self, feeds: dict[str, np.ndarray], **extra: object) -> list:
        # InferSession takes feeds by position, in get_inputs() order, and reads raw buffers.
        ordered = [np.require(feeds[spec.name], requirements="C") for spec in self._inputs]  # 0-d stays 0-d
        options: dict[str, object] = {"mode": self.mode, **extra}
        if self.custom_sizes is not None:
            options["custom_sizes"] = self.custom_sizes
        try:
            with self._contexts.held(self._context):
                values = self._session.infer(ordered, **options)
        except BackendError:
            raise
        except Exception as exc:
            raise BackendError(f"ais_bench failed to run {self.path.name} (mode={self.mode}): {exc}") from exc
        if len(values) != len(self._outputs):
            raise BackendError(
                f"ais_bench returned {len(values)} outputs for {self.path.name}, which declares {len(self._outputs)}"
            )
        return list(values)

    def _to_host(self, value) -> np.ndarray:
        """A device tensor copied back, as InferSession.run does for out_array=True."""
        with self._contexts.held(self._context):
            value.to_host()
        return np.array(value)

    def _held(self, value) -> HeldOutput:
        return HeldOutput(shape=tuple(int(d) for d in value.shape), copy_back=lambda: self._to_host(value))

    def _deactivate_impl(self) -> None:
        # free_resource() releases this session's device memory only; finalize() would tear
        # down ACL for the whole process, including other open sessions, so it is not called.
        free = getattr(self._session, "free_resource", None)
        if callable(free):
            with self._contexts.held(self._context):
                free()
        self._session = None


def _numpy_dtype(datatype: object, name: str) -> str:
    # aclruntime.dtype is a pybind11 enum: `.name` is 'float32'; str() would be 'dtype.float32'.
    label = getattr(datatype, "name", None) or str(datatype).rsplit(".", 1)[-1]
    label = _ACL_TO_NUMPY.get(label, label)
    try:
        return np.dtype(label).name
    except TypeError:
        raise BackendError(f"OM I/O '{name}': unsupported datatype {datatype!r}") from None


# InferSession in dymshape mode needs each output's buffer size up front. The sizes come from the
# largest output seen at capture, times this margin (calls within the strategy's ranges may be larger).
DYMSHAPE_OUTPUT_MARGIN = 4


def _dymshape_sizes(graph: DeployedGraph) -> list[int]:
    sizes = []
    for index, spec in enumerate(graph.contract.outputs):
        shapes = [call.outputs[index] for call in graph.contract.call_shapes if index < len(call.outputs)]
        largest = max(int(np.prod(shape)) if shape else 1 for shape in shapes or [spec.shape])
        itemsize = 2 if spec.dtype == "bfloat16" else np.dtype(spec.dtype).itemsize  # numpy has no bfloat16
        sizes.append(largest * itemsize * DYMSHAPE_OUTPUT_MARGIN)
    return sizes
