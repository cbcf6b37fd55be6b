"""TEST DOUBLE for `ais_bench.infer.interface.InferSession`: it is NOT Ascend and runs no OM.

It implements the documented interface of InferSession (ait/msit benchmark "interface python API"
guide: constructor `(device_id, model_path, ...)`, `get_inputs()` / `get_outputs()` returning
descriptors with `.name`, `.shape` (-1 for a dim that varies) and `.datatype` (an enum whose
`.name` is 'float32', 'int64', 'double64', ...), `infer(feeds, mode='static', custom_sizes=100000,
out_array=True)` returning arrays in `get_outputs()` order, `free_resource()`) on ONNX Runtime.

`model_path` is either an ONNX file (run as it is, no checks) or the "OM" that `tests/fake_atc`
writes: a JSON note of the ATC options and the ONNX it was given. For such a build the double
enforces what the real session does:
- `mode` must be the one the OM was built for (static, dymbatch, dymdims, dymhw, dymshape);
- a gear OM runs its gears only (dymbatch: the batch must be one of --dynamic_batch_size;
  dymdims: the dynamic dims must form one row of --dynamic_dims); a static OM its one shape;
- the session owns the ACL context it was created in (the `acl` double): `infer` with another
  context current fails like ACL does (107003), so a caller mixing torch_npu and ais_bench must
  switch contexts around each call.

Every `infer` call is recorded (mode, custom_sizes, feed shapes and dtypes, and which outputs were
copied back to the host) for tests to check. With `out_array=False` the outputs are device tensor
doubles (`.shape`, `to_host()`, then `numpy.array`), as ais_bench's InferSession returns them.
"""

from __future__ import annotations

import enum
import importlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import onnxruntime


def _acl():
    """pyACL: the double beside this package on sys.path, one a test installed, or None."""
    if "acl" in sys.modules:
        return sys.modules["acl"]
    try:
        return importlib.import_module("acl")
    except ImportError:
        return None


DOCUMENTED_MODES = ("static", "dymbatch", "dymhw", "dymdims", "dymshape")
OM_DOUBLE_MARK = "omskills test double, not an OM"
ACL_DYNAMIC_TENSOR_NAME = "ascend_mbatch_shape_data"


class DoubleDType(enum.Enum):
    """Mirrors the names of `aclruntime.dtype`."""

    uint8 = "uint8"
    int8 = "int8"
    uint16 = "uint16"
    int16 = "int16"
    uint32 = "uint32"
    int32 = "int32"
    uint64 = "uint64"
    int64 = "int64"
    float16 = "float16"
    float32 = "float32"
    double64 = "double64"
    bool = "bool"


_ORT_TO_ACL = {"float": DoubleDType.float32, "double": DoubleDType.double64}


@dataclass
class TensorDescDouble:
    """Mirrors `aclruntime.tensor_desc` (the fields the guide lists)."""

    name: str
    shape: list[int]
    datatype: DoubleDType
    format: int = 0
    size: int = 0
    realsize: int = 0


@dataclass
class InferCall:
    mode: str
    custom_sizes: object
    feed_shapes: list[tuple[int, ...]]
    feed_dtypes: list[str]
    out_array: bool = True
    copied_back: list[str] = field(default_factory=list)  # outputs brought to the host (all, with out_array)


class DeviceTensorDouble:
    """Mirrors an `aclruntime.Tensor` in device memory: its `.shape`; `to_host()` copies it back,
    and only then does `numpy.array(tensor)` read it (as InferSession.run does for out_array=True)."""

    def __init__(self, name: str, value, call: InferCall) -> None:
        self.name, self._value, self._call, self._on_host = name, value, call, False
        self.shape = list(value.shape)

    def to_host(self) -> None:
        self._on_host = True
        self._call.copied_back.append(self.name)

    def __array__(self, dtype=None, copy=None):
        if not self._on_host:
            raise RuntimeError(f"{self.name} is in device memory: call to_host() first")
        return self._value if dtype is None else self._value.astype(dtype)


@dataclass
class OmBuild:
    """What fake_atc compiled: the ONNX, the input shapes (-1: dynamic) and the gears."""

    onnx: str
    mode: str
    input_shapes: dict[str, list[int]]
    gears: list[list[int]]

    @classmethod
    def read(cls, path: Path) -> OmBuild | None:
        try:
            note = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None
        if not isinstance(note, dict) or note.get("double") != OM_DOUBLE_MARK:
            return None
        options = note["options"]
        shapes = {}
        for item in filter(None, options.get("input_shape", "").split(";")):
            name, _, dims = item.rpartition(":")
            shapes[name] = [int(d) for d in dims.split(",")]
        mode, gears = "static", []
        if "dynamic_batch_size" in options:
            mode, gears = "dymbatch", [[int(b)] for b in options["dynamic_batch_size"].split(",")]
        elif "dynamic_dims" in options:
            mode, gears = "dymdims", [[int(d) for d in g.split(",")] for g in options["dynamic_dims"].split(";")]
        elif "dynamic_image_size" in options:
            mode, gears = "dymhw", [[int(d) for d in g.split(",")] for g in options["dynamic_image_size"].split(";")]
        elif any(-1 in dims for dims in shapes.values()):
            mode = "dymshape"
        # The ONNX where fake_atc found it, or beside the OM (where a bundle puts both).
        onnx = path.parent / note["onnx"]
        if not onnx.is_file():
            onnx = path.parent / Path(note["onnx"]).name
        return cls(onnx=str(onnx.resolve()), mode=mode, input_shapes=shapes, gears=gears)


@dataclass
class InferSessionDouble:
    device_id: int
    model_path: str
    acl_json_path: str | None = None
    debug: bool = False
    loop: int = 1
    calls: list[InferCall] = field(default_factory=list)
    freed: bool = False

    def __post_init__(self) -> None:
        self.built = OmBuild.read(Path(self.model_path))
        onnx_path = self.built.onnx if self.built else self.model_path
        self._ort = onnxruntime.InferenceSession(onnx_path, providers=["CPUExecutionProvider"])
        # aclruntime creates the session's context on the device, which becomes current.
        self.acl = _acl()
        self.context = self.acl.rt.create_context(self.device_id)[0] if self.acl is not None else None

    def get_inputs(self) -> list[TensorDescDouble]:
        descs = [self._desc(arg) for arg in self._ort.get_inputs()]
        if self.built and self.built.mode in ("dymbatch", "dymdims", "dymhw"):
            descs.append(TensorDescDouble(name=ACL_DYNAMIC_TENSOR_NAME, shape=[-1], datatype=DoubleDType.int64))
        return descs

    def get_outputs(self) -> list[TensorDescDouble]:
        return [self._desc(arg) for arg in self._ort.get_outputs()]

    def infer(self, feeds, mode="static", custom_sizes=100000, out_array=True):
        call = InferCall(
            mode=mode,
            custom_sizes=custom_sizes,
            feed_shapes=[tuple(f.shape) for f in feeds],
            feed_dtypes=[str(f.dtype) for f in feeds],
            out_array=out_array,
        )
        self.calls.append(call)
        if mode not in DOCUMENTED_MODES:
            raise RuntimeError(f"mode {mode} invalid")
        if self.acl is not None and self.context is not None and self.acl.rt.get_context()[0] != self.context:
            raise RuntimeError(
                "ACL error 107003: the stream is not in the current context "
                "(the session's context is not current on this thread)"
            )
        names = [arg.name for arg in self._ort.get_inputs()]
        if self.built:
            self._check_built(mode, dict(zip(names, feeds)))
        values = self._ort.run(None, dict(zip(names, feeds)))
        outputs = [arg.name for arg in self._ort.get_outputs()]
        if out_array:
            call.copied_back += outputs
            return values
        return [DeviceTensorDouble(name, value, call) for name, value in zip(outputs, values)]

    def _check_built(self, mode: str, feeds: dict) -> None:
        built = self.built
        if mode != built.mode:
            raise RuntimeError(f"infer mode {mode!r} does not match the OM, which ATC built for {built.mode!r}")
        dynamic = [
            int(size)
            for name, value in feeds.items()
            for size, want in zip(value.shape, built.input_shapes.get(name, list(value.shape)))
            if want == -1
        ]
        for name, value in feeds.items():
            want = built.input_shapes.get(name)
            if want and any(w != -1 and w != s for s, w in zip(value.shape, want)):
                raise RuntimeError(f"input {name} has shape {list(value.shape)}, the OM was built for {want}")
        if mode == "dymbatch" and dynamic and [dynamic[0]] not in built.gears:
            raise RuntimeError(
                f"aclmdlSetDynamicBatchSize failed: batch {dynamic[0]} is not one of the OM's gears {built.gears}"
            )
        if mode in ("dymdims", "dymhw") and dynamic not in built.gears:
            raise RuntimeError(f"dynamic dims {dynamic} are not one of the OM's gears {built.gears}")

    def free_resource(self) -> None:
        self.freed = True

    def _desc(self, arg) -> TensorDescDouble:
        element = arg.type.removeprefix("tensor(").removesuffix(")")
        datatype = _ORT_TO_ACL.get(element) or DoubleDType[element]
        built = self.built.input_shapes.get(arg.name) if self.built else None
        shape = built or [d if isinstance(d, int) else -1 for d in arg.shape]
        return TensorDescDouble(name=arg.name, shape=shape, datatype=datatype)


InferSession = InferSessionDouble
