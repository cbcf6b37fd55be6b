"""InferSessionDouble: a test double for `ais_bench.infer.interface.InferSession`.

It is NOT Ascend and runs no OM: it implements the documented interface of InferSession
(ait/msit benchmark "interface python API" guide: constructor `(device_id, model_path, ...)`,
`get_inputs()` / `get_outputs()` returning descriptors with `.name`, `.shape` (-1 for a dim that
varies), `.datatype` (an enum whose `.name` is 'float32', 'int64', 'double64', ...), and
`infer(feeds, mode='static', custom_sizes=100000, out_array=True)` returning a list of arrays
in `get_outputs()` order) on top of ONNX Runtime, so the OM adapter can be tested on a CPU.

Every `infer` call is recorded (mode, custom_sizes, feed shapes/dtypes) for the tests to check.
Install it with `install_fake_ais_bench(monkeypatch)`, which puts a fake
`ais_bench.infer.interface` module into `sys.modules`.
"""

from __future__ import annotations

import enum
import sys
import types
from dataclasses import dataclass, field

import onnxruntime

DOCUMENTED_MODES = ("static", "dymbatch", "dymhw", "dymdims", "dymshape")


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
        self._ort = onnxruntime.InferenceSession(self.model_path, providers=["CPUExecutionProvider"])

    def get_inputs(self) -> list[TensorDescDouble]:
        return [_desc(arg) for arg in self._ort.get_inputs()]

    def get_outputs(self) -> list[TensorDescDouble]:
        return [_desc(arg) for arg in self._ort.get_outputs()]

    def infer(self, feeds, mode="static", custom_sizes=100000, out_array=True):
        self.calls.append(
            InferCall(
                mode=mode,
                custom_sizes=custom_sizes,
                feed_shapes=[tuple(f.shape) for f in feeds],
                feed_dtypes=[str(f.dtype) for f in feeds],
            )
        )
        if mode not in DOCUMENTED_MODES:
            raise RuntimeError(f"mode {mode} invalid")
        # Positional feeds, as InferSession takes them: the i-th array is the i-th input.
        names = [arg.name for arg in self._ort.get_inputs()]
        return self._ort.run(None, dict(zip(names, feeds)))

    def free_resource(self) -> None:
        self.freed = True


def _desc(arg) -> TensorDescDouble:
    element = arg.type.removeprefix("tensor(").removesuffix(")")
    datatype = _ORT_TO_ACL.get(element) or DoubleDType[element]
    shape = [d if isinstance(d, int) else -1 for d in arg.shape]
    return TensorDescDouble(name=arg.name, shape=shape, datatype=datatype)


def install_fake_ais_bench(monkeypatch, session_class=InferSessionDouble) -> types.ModuleType:
    """Make `from ais_bench.infer.interface import InferSession` return `session_class`."""
    package = types.ModuleType("ais_bench")
    infer = types.ModuleType("ais_bench.infer")
    interface = types.ModuleType("ais_bench.infer.interface")
    interface.InferSession = session_class
    package.infer = infer
    infer.interface = interface
    monkeypatch.setitem(sys.modules, "ais_bench", package)
    monkeypatch.setitem(sys.modules, "ais_bench.infer", infer)
    monkeypatch.setitem(sys.modules, "ais_bench.infer.interface", interface)
    return interface
