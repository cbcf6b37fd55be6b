"""Device portability: run CUDA-minded model code on another device, explicitly and logged.

`DevicePortability(device, source_root)` is a context you enter around model building and
the main path. While active it redirects the CUDA-only calls model code makes (`.cuda()`,
`pin_memory`, `device="cuda"` in tensor factories, CUDA device queries, CUDA bf16
autocast, bf16 casts) to the target device in fp32, and records every site it touched as a
`PortabilityFinding` (file:line inside the model source, what it did, how often). Drivers can
also add `FunctionFix`es (one function replaced) and `WatchedImport`s (imports of modules some
hosts lack, e.g. triton or pkg_resources, recorded and stood in for when missing). On exit
everything is restored. Nothing is patched at import time.

These findings are the same places an NPU port must touch (there, the target device is
`npu` and the same redirections apply through torch_npu).
"""

from __future__ import annotations

import builtins
import functools
import importlib
import importlib.resources
import importlib.util
import sys
import threading
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, ModuleType, SimpleNamespace
from typing import Any
from unittest import mock

import torch
from omskills.records.inventory import PortabilityFinding

# Tensor factories that accept `device=` (and some `pin_memory=`).
_FACTORIES = (
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "linspace",
    "tensor",
    "as_tensor",
    "rand",
    "randn",
    "randint",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "eye",
)


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


@dataclass(frozen=True)
class FunctionFix:
    """Replace `module.attribute` while the layer is active.

    `make(original)` returns a function giving `(fix_was_needed, result)`, so only calls that
    really needed the fix are recorded as findings.
    """

    module: str
    attribute: str
    kind: str
    detail: str
    make: Callable[[Callable[..., Any]], Callable[..., tuple[bool, Any]]]


@dataclass(frozen=True)
class WatchedImport:
    """A module the model source imports that accelerator hosts may lack (triton, pkg_resources).

    While the layer is active, every `import <name>` executed by the model source is a finding
    at its file:line. When the module cannot be found, `stand_in()` provides substitute modules
    (module name -> module) for as long as the layer is active, so the import itself succeeds.
    """

    name: str
    kind: str
    detail: str
    stand_in: Callable[[], dict[str, ModuleType]] | None = None


def pkg_resources_stand_in() -> dict[str, ModuleType]:
    """`pkg_resources.resource_filename` (gone from setuptools >= 81) on importlib.resources."""
    module = ModuleType("pkg_resources")

    def resource_filename(package: str, resource: str) -> str:
        return str(importlib.resources.files(package).joinpath(resource))

    module.resource_filename = resource_filename  # type: ignore[attr-defined]
    return {"pkg_resources": module}


class _UnavailableKernel:
    """What the triton stand-in hands out: usable at import time, raises if a kernel is launched."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attribute: str) -> _UnavailableKernel:
        return _UnavailableKernel(f"{self._name}.{attribute}")

    def __getitem__(self, _key: Any) -> _UnavailableKernel:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name}: triton is not installed (omskills portability stand-in)")


def _identity_decorator(*args: Any, **kwargs: Any) -> Any:
    """`@triton.jit` and `@triton.jit(...)`: the function stays a plain (unlaunchable) function."""
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda fn: fn


def triton_stand_in() -> dict[str, ModuleType]:
    """Enough of triton for modules that define kernels at import time and never launch them."""
    modules: dict[str, ModuleType] = {}
    for name in ("triton", "triton.language"):
        module = ModuleType(name)
        module.__getattr__ = lambda attribute, _n=name: _UnavailableKernel(f"{_n}.{attribute}")  # type: ignore[method-assign]
        modules[name] = module
    for decorator in ("jit", "autotune", "heuristics"):
        setattr(modules["triton"], decorator, _identity_decorator)
    modules["triton"].language = modules["triton.language"]  # type: ignore[attr-defined]
    return modules


HOST_DEPENDENT_IMPORTS = (
    WatchedImport("triton", "triton", "CUDA/ROCm kernel library; no NPU build", triton_stand_in),
    WatchedImport("pkg_resources", "pkg_resources", "removed from setuptools >= 81", pkg_resources_stand_in),
)


class DevicePortability:
    def __init__(self, device: str | torch.device, source_root: Path, fp32: bool = True):
        self.device = torch.device(device)
        self.source_root = str(Path(source_root).resolve())
        self.fp32 = fp32
        self._counts: Counter[tuple[str, int, str, str]] = Counter()
        self._lock = threading.Lock()
        self._stack: ExitStack | None = None
        self._function_fixes: list[FunctionFix] = []
        self._watched_imports: dict[str, WatchedImport] = {}

    def add_fix(self, fix: FunctionFix) -> None:
        """A model-specific replacement of one function, applied (and recorded) while active."""
        self._function_fixes.append(fix)

    def watch_import(self, watched: WatchedImport) -> None:
        """Record imports of `watched.name` from the model source; stand in for it when missing."""
        self._watched_imports[watched.name] = watched

    # -- recording ---------------------------------------------------------------------
    def _site(self) -> tuple[str, int]:
        """The innermost caller frame inside the model source (else the innermost outside torch)."""
        frame: FrameType | None = sys._getframe(2)
        while frame is not None:
            filename = frame.f_code.co_filename
            if filename.startswith(self.source_root):
                rel = str(Path(filename).relative_to(self.source_root))
                return rel, frame.f_lineno
            frame = frame.f_back
        return "<outside model source>", 0

    def _record(self, kind: str, action: str) -> None:
        file, line = self._site()
        with self._lock:
            self._counts[(file, line, kind, action)] += 1

    def findings(self) -> list[PortabilityFinding]:
        with self._lock:
            items = sorted(self._counts.items())
        return [
            PortabilityFinding(file=f, line=line_no, kind=k, detail=f"{a} (x{n})", action=a, seen_at_runtime=True)
            for (f, line_no, k, a), n in items
        ]

    # -- redirections ------------------------------------------------------------------
    @property
    def redirect_cuda(self) -> bool:
        return self.device.type != "cuda"

    def _map_device(self, kwargs: dict[str, Any], kind: str) -> dict[str, Any]:
        if self.redirect_cuda and _is_cuda(kwargs.get("device")):
            self._record(kind, f"device={kwargs['device']!s} -> {self.device}")
            kwargs["device"] = self.device
        if kwargs.get("pin_memory") and self.device.type == "cpu":
            self._record("pin_memory", "pin_memory=True dropped (no pinned memory without CUDA)")
            kwargs["pin_memory"] = False
        return kwargs

    def _wrap_factory(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def factory(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **self._map_device(kwargs, "device_cuda"))

        return factory

    def _tensor_cuda(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._record("cuda_call", f"Tensor.cuda() -> .to({self.device})")
        return tensor.to(self.device, non_blocking=kwargs.get("non_blocking", False))

    def _module_cuda(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        self._record("cuda_call", f"Module.cuda() -> .to({self.device})")
        return module.to(self.device)

    def _pin_memory(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._record("pin_memory", "Tensor.pin_memory() skipped")
        return tensor

    def _tensor_to(self, original: Callable[..., Any]) -> Callable[..., Any]:
        portability = self

        @functools.wraps(original)
        def to(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            args = tuple(portability._map_positional(a) for a in args)
            if "device" in kwargs:
                kwargs = portability._map_device(kwargs, "device_cuda")
            if (
                portability.fp32
                and (kwargs.get("dtype") is torch.bfloat16 or torch.bfloat16 in args)
                and tensor.is_floating_point()
            ):
                portability._record("bf16_cast", "Tensor.to(bfloat16) kept in float32 for parity")
                kwargs.pop("dtype", None)
                args = tuple(a for a in args if a is not torch.bfloat16)
            return original(tensor, *args, **kwargs)

        return to

    def _map_positional(self, arg: Any) -> Any:
        if self.redirect_cuda and _is_cuda(arg):
            self._record("device_cuda", f"to({arg!s}) -> {self.device}")
            return self.device
        return arg

    def _autocast_init(self, original: Callable[..., Any]) -> Callable[..., Any]:
        portability = self

        @functools.wraps(original)
        def init(ac: Any, device_type: str, dtype: Any = None, enabled: bool = True, cache_enabled: Any = None) -> None:
            if device_type == "cuda" and portability.redirect_cuda:
                portability._record(
                    "autocast", f"torch.autocast('cuda', {dtype}) disabled: fp32 on {portability.device}"
                )
                enabled = False
            original(ac, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

        return init

    def _autocast_enter(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """Autocast decorators are built at import time; disable them when entered."""
        portability = self

        @functools.wraps(original)
        def enter(ac: Any) -> Any:
            if getattr(ac, "device", None) == "cuda" and portability.redirect_cuda and ac._enabled:
                portability._record("autocast", "@torch.autocast('cuda') disabled at call time")
                ac._enabled = False
            return original(ac)

        return enter

    def _cuda_query(self, name: str, result: Callable[..., Any]) -> Callable[..., Any]:
        def query(*args: Any, **kwargs: Any) -> Any:
            self._record("cuda_query", f"torch.cuda.{name}() answered for {self.device}")
            return result(*args, **kwargs)

        return query

    def _device_properties(self, *args: Any, **kwargs: Any) -> SimpleNamespace:
        # major=0: code that enables TF32/flash paths for sm_80+ leaves them off.
        return SimpleNamespace(name=f"{self.device} (no CUDA; omskills portability)", major=0, minor=0, total_memory=0)

    def __enter__(self) -> DevicePortability:
        stack = ExitStack()
        if self.redirect_cuda:
            for name in _FACTORIES:
                stack.enter_context(mock.patch.object(torch, name, self._wrap_factory(getattr(torch, name))))
            # Patched on the class, so each replacement is a plain function taking the instance.
            stack.enter_context(
                mock.patch.object(torch.Tensor, "cuda", lambda t, *a, **k: self._tensor_cuda(t, *a, **k))
            )
            stack.enter_context(
                mock.patch.object(torch.nn.Module, "cuda", lambda m, *a, **k: self._module_cuda(m, *a, **k))
            )
            stack.enter_context(
                mock.patch.object(torch.Tensor, "pin_memory", lambda t, *a, **k: self._pin_memory(t, *a, **k))
            )
            stack.enter_context(mock.patch.object(torch.Tensor, "to", self._tensor_to(torch.Tensor.to)))
            ac = torch.amp.autocast_mode.autocast
            stack.enter_context(mock.patch.object(ac, "__enter__", self._autocast_enter(ac.__enter__)))
            stack.enter_context(mock.patch.object(ac, "__init__", self._autocast_init(ac.__init__)))
            stack.enter_context(
                mock.patch.object(torch.cuda, "current_device", self._cuda_query("current_device", lambda *a, **k: 0))
            )
            stack.enter_context(
                mock.patch.object(
                    torch.cuda, "memory_allocated", self._cuda_query("memory_allocated", lambda *a, **k: 0)
                )
            )
            stack.enter_context(
                mock.patch.object(torch.cuda, "memory_reserved", self._cuda_query("memory_reserved", lambda *a, **k: 0))
            )
            stack.enter_context(
                mock.patch.object(
                    torch.cuda, "max_memory_allocated", self._cuda_query("max_memory_allocated", lambda *a, **k: 0)
                )
            )
            stack.enter_context(
                mock.patch.object(
                    torch.cuda, "max_memory_reserved", self._cuda_query("max_memory_reserved", lambda *a, **k: 0)
                )
            )
            stack.enter_context(
                mock.patch.object(
                    torch.cuda,
                    "get_device_properties",
                    self._cuda_query("get_device_properties", self._device_properties),
                )
            )
            stack.enter_context(
                mock.patch.object(torch.cuda, "synchronize", self._cuda_query("synchronize", lambda *a, **k: None))
            )
            stack.enter_context(
                mock.patch.object(torch.cuda, "empty_cache", self._cuda_query("empty_cache", lambda *a, **k: None))
            )
        if self._watched_imports:
            # Before the function fixes: importing their modules may import watched ones.
            self._watch_imports(stack)
        for fix in self._function_fixes:
            module = importlib.import_module(fix.module)
            original = getattr(module, fix.attribute)
            stack.enter_context(mock.patch.object(module, fix.attribute, self._recorded_fix(fix, original)))
        self._stack = stack
        return self

    def _watch_imports(self, stack: ExitStack) -> None:
        stand_ins: dict[str, ModuleType] = {}
        for watched in self._watched_imports.values():
            if (
                watched.stand_in is not None
                and watched.name not in sys.modules
                and importlib.util.find_spec(watched.name) is None
            ):
                stand_ins.update(watched.stand_in())
        missing = {name.split(".")[0] for name in stand_ins}
        # Not mock.patch.dict: on exit it would also drop every module imported meanwhile.
        sys.modules.update(stand_ins)
        stack.callback(self._remove_stand_ins, stand_ins)
        stack.enter_context(
            mock.patch.object(builtins, "__import__", self._recording_import(builtins.__import__, missing))
        )

    @staticmethod
    def _remove_stand_ins(stand_ins: dict[str, ModuleType]) -> None:
        for name, module in stand_ins.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]

    def _recording_import(self, original: Callable[..., Any], missing: set[str]) -> Callable[..., Any]:
        portability = self

        @functools.wraps(original)
        def recording_import(
            name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0
        ) -> Any:
            watched = portability._watched_imports.get(name.split(".")[0]) if level == 0 else None
            # Only imports written in the model source count (not, e.g., torch importing triton).
            if watched is not None and sys._getframe(1).f_code.co_filename.startswith(portability.source_root):
                how = "not installed: stand-in module for the run" if watched.name in missing else "imported"
                portability._record(watched.kind, f"import {name} {how} ({watched.detail})")
            return original(name, globals, locals, fromlist, level)

        return recording_import

    def _recorded_fix(self, fix: FunctionFix, original: Callable[..., Any]) -> Callable[..., Any]:
        replacement = fix.make(original)

        @functools.wraps(original)
        def fixed(*args: Any, **kwargs: Any) -> Any:
            used, result = replacement(*args, **kwargs)
            if used:
                self._record(fix.kind, fix.detail)
            return result

        return fixed

    def __exit__(self, *exc: Any) -> None:
        assert self._stack is not None
        self._stack.close()
        self._stack = None
