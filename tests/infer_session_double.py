"""Helpers for the Ascend test doubles under tests/doubles (an InferSession, pyACL, the CANN provider).

The doubles are loaded here under private names, so this process does not start believing ais_bench
or pyACL are installed; a test installs them where it wants them:
- `install_fake_ais_bench(monkeypatch, session_class)`: `from ais_bench.infer.interface import
  InferSession` returns `session_class`;
- `install_acl_double(monkeypatch)`: `import acl` returns the pyACL double (fresh contexts);
- `DOUBLES`: the folder to put on PYTHONPATH for a child process to import the doubles as
  `ais_bench` and `acl`.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

DOUBLES = Path(__file__).resolve().with_name("doubles")


def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


acl_double = _load("omskills_test_acl_double", DOUBLES / "acl.py")
_interface = _load("omskills_test_infer_session_double", DOUBLES / "ais_bench" / "infer" / "interface.py")
DOCUMENTED_MODES = _interface.DOCUMENTED_MODES
DoubleDType = _interface.DoubleDType
InferCall = _interface.InferCall
InferSessionDouble = _interface.InferSessionDouble
OmBuild = _interface.OmBuild
TensorDescDouble = _interface.TensorDescDouble


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


def install_acl_double(monkeypatch) -> types.ModuleType:
    """Make `import acl` return the pyACL double, with no context yet."""
    acl_double.reset()
    monkeypatch.setitem(sys.modules, "acl", acl_double)
    return acl_double


def recording_sessions(monkeypatch, session_class=InferSessionDouble) -> list:
    """Install the fake ais_bench with a subclass of `session_class` that appends every session it
    opens to the list returned."""
    created: list = []

    class Recording(session_class):
        def __post_init__(self) -> None:
            super().__post_init__()
            created.append(self)

    install_fake_ais_bench(monkeypatch, Recording)
    return created
