"""ONNX Runtime backend: CPU everywhere, CUDA where a GPU exists, CANN on Ascend.

The CANN execution provider ships as the `onnxruntime-cann` wheel, which installs under the
same import name as `onnxruntime`; whichever wheel is installed decides what is available.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import numpy as np
from omskills.isolation import trim_heap
from omskills.records.deploy import DeployedGraph
from omskills.records.toolchain import BatchSplit
from omskills.runtime.base import (
    BackendError,
    HeldOutput,
    IOSpec,
    Placement,
    Runner,
    RuntimeBackend,
    check_feeds,
)
from omskills.runtime.batch_split import SplitBatchBackend, served_in_gears

# Tried in this order when the caller does not choose: the Ascend provider first (the point
# of this project), then a GPU, then the CPU that is always there.
PREFERRED_PROVIDERS = ("CANNExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")

logger = logging.getLogger(__name__)

CPU_PROVIDER = "CPUExecutionProvider"
CANN_PROVIDER = "CANNExecutionProvider"

# Attention is fused in memory for models up to this size: the rewrite holds the model twice
# (parsed and serialised) next to the session's own copy; a bigger model opens as exported.
FUSE_IN_MEMORY_MAX_BYTES = 1 << 30

# ONNX Runtime reports element types as "tensor(<onnx name>)"; these are the names that
# differ from numpy's spelling. Others ("int64", "bool", "float16", ...) are the same.
_ORT_TO_NUMPY = {"float": "float32", "double": "float64", "string": "object"}


def available_providers() -> list[str]:
    import onnxruntime

    return list(onnxruntime.get_available_providers())


def resolve_providers(requested: Sequence[str] | None) -> list[str]:
    """The providers to ask for: the caller's (each must be available) or the preferred ones present."""
    available = available_providers()
    if requested is None:
        chosen = [name for name in PREFERRED_PROVIDERS if name in available]
        if not chosen:
            raise BackendError(f"onnxruntime offers none of {list(PREFERRED_PROVIDERS)}; available: {available}")
        return chosen
    if isinstance(requested, str):
        requested = [requested]
    unavailable = [name for name in requested if name not in available]
    if unavailable:
        raise BackendError(f"providers: {unavailable} not available in this onnxruntime; available: {available}")
    return list(requested)


def numpy_dtype_of(ort_type: str) -> str:
    """'tensor(float)' -> 'float32'."""
    inner = ort_type.removeprefix("tensor(").removesuffix(")")
    return _ORT_TO_NUMPY.get(inner, inner)


class OnnxRuntimeBackend(RuntimeBackend):
    kind = "onnxruntime"
    auto_rank = 1  # "auto" falls back to it: it opens every graph's ONNX file

    @classmethod
    def runs_here(cls) -> list[str]:
        """One 'onnxruntime:<provider>' per preferred provider this onnxruntime offers (none
        without onnxruntime)."""
        try:
            available = available_providers()
        except ImportError:
            return []
        return [f"{cls.kind}:{name}" for name in PREFERRED_PROVIDERS if name in available]

    @classmethod
    def serve(cls, graph: DeployedGraph, root: Path, placement: Placement) -> Runner:
        """A session on the providers asked for (or the preferred ones present). The CANN provider
        gets the NPU and the precision mode chosen in emulation. A graph with batch gears runs the
        sizes its OM runs, any other batch as gear-sized calls (as the OM backend serves it); on the
        CPU no gear above the chunks probe_onnx found the batch needs."""
        cann = {"device_id": str(placement.device_id)}
        if graph.precision_mode:
            cann["precision_mode"] = graph.precision_mode
        model = placement.model or root / graph.onnx.path
        backend = cls(model, providers=placement.providers, provider_options={CANN_PROVIDER: cann}).activate()
        memory = graph.batch_split if backend.device == CPU_PROVIDER else None
        geared = served_in_gears(backend, graph, "ONNX Runtime runs the OM's batch gears", memory)
        if geared is not None:
            return geared
        return SplitBatchBackend(backend, memory) if memory is not None else backend

    def __init__(
        self,
        path: str | Path,
        providers: Sequence[str] | None = None,
        threads: int | None = None,
        provider_options: Mapping[str, Mapping[str, str]] | None = None,
        fuse_attention: bool = False,
        spin: bool = False,
    ) -> None:
        """provider_options: provider name -> its options (the CANN provider's device_id and
        precision_mode, say); options of a provider not chosen are ignored. fuse_attention: on the
        CPU, run exported attention as ONNX Runtime's fused MultiHeadAttention (see
        omskills.runtime.attention_fusion); the file on disk is not changed. Off by default: the
        rewrite needs the `onnx` package, which a deployment does not import, and a deployment
        must compute exactly what verify computed. spin: let ONNX Runtime's worker threads spin
        waiting for work after a run (its default). Off here: a spliced pipeline runs PyTorch
        between the graph calls, and on a machine with few cores spinning threads take the cores
        PyTorch needs (a tiny video pipeline on 2 cores: spliced/eager 1.3-1.7 with spinning, 1.0-1.2
        without)."""
        super().__init__(path)
        if threads is not None and threads < 1:
            raise BackendError(f"threads: must be >= 1, got {threads}")
        self.providers = resolve_providers(providers)
        self.provider_options = {
            name: {k: str(v) for k, v in opts.items()} for name, opts in (provider_options or {}).items()
        }
        self.threads = threads
        self.fuse_attention = fuse_attention
        self.spin = spin
        self.fused_attention_blocks = 0  # attention blocks the running session computes fused
        self._session = None

    def _activate_impl(self) -> tuple[list[IOSpec], list[IOSpec]]:
        fused = self._fused_model() if self.fuse_attention and self.providers[0] == CPU_PROVIDER else None
        if fused is not None:
            try:
                self._session = self._new_session(fused)
            except BackendError as exc:
                logger.warning(
                    "%s: the session with fused attention does not load (%s); running it as exported",
                    self.path.name,
                    exc,
                )
                self.fused_attention_blocks = 0
        if self._session is None:
            self._session = self._new_session(None)
        trim_heap()  # the parsed model ORT copied its weights from (as big as the weights)
        # ORT drops providers that fail to initialise; the first one kept is the one that runs
        # the graph (nodes it does not support fall back to the next, typically the CPU).
        self.device = self._session.get_providers()[0]
        return _specs(self._session.get_inputs()), _specs(self._session.get_outputs())

    def _new_session(self, model: bytes | None):
        """A session on `model` (serialised; its external data next to the file) or on the file."""
        import onnxruntime

        options = onnxruntime.SessionOptions()
        # Errors only: ORT's warnings go to stderr and would drown the progress display.
        options.log_severity_level = 3
        # No per-session arena: each session would keep its peak activations (GBs for a 4-frame
        # full-scale call), and verify holds one session per spliced candidate next to the
        # PyTorch model; without the arena the memory goes back after each run.
        options.enable_cpu_mem_arena = False
        if self.threads is not None:
            options.intra_op_num_threads = self.threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if self.spin else "0")
        if model is not None:
            options.add_session_config_entry(
                "session.model_external_initializers_file_folder_path", str(self.path.parent)
            )
        try:
            providers = [
                (name, self.provider_options[name]) if name in self.provider_options else name
                for name in self.providers
            ]
            return onnxruntime.InferenceSession(
                model if model is not None else str(self.path), sess_options=options, providers=providers
            )
        except Exception as exc:  # ORT raises its own types (InvalidProtobuf, Fail, ...)
            raise BackendError(f"onnxruntime cannot load {self.path}: {_first_line(exc)}") from exc

    def _fused_model(self) -> bytes | None:
        """The model with its attention fused, serialised; None when nothing was fused or the model
        is too big to rewrite in memory."""
        import onnx
        from omskills.runtime.attention_fusion import fuse_attention

        if self.path.stat().st_size > FUSE_IN_MEMORY_MAX_BYTES:
            logger.info(
                "%s: %d bytes, over %d: attention left unfused",
                self.path.name,
                self.path.stat().st_size,
                FUSE_IN_MEMORY_MAX_BYTES,
            )
            return None
        try:
            model = onnx.load(str(self.path), load_external_data=False)
            self.fused_attention_blocks = fuse_attention(model)
        except Exception as exc:  # a model the matcher cannot read runs as exported
            logger.warning("%s: attention fusion skipped (%s)", self.path.name, _first_line(exc))
            self.fused_attention_blocks = 0
            return None
        if not self.fused_attention_blocks:
            return None
        logger.info("%s: %d attention block(s) fused for ONNX Runtime", self.path.name, self.fused_attention_blocks)
        return model.SerializeToString()

    def _infer_impl(self, feeds: dict[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        names = [spec.name for spec in self._outputs]
        try:
            values = self._session.run(names, feeds)
        except Exception as exc:
            if not self.fused_attention_blocks:
                raise BackendError(f"onnxruntime failed to run {self.path.name}: {_first_line(exc)}") from exc
            # A fused block met shapes the export allowed and MultiHeadAttention does not (a
            # broadcast batch, say): from now on the graph runs as exported.
            logger.warning(
                "%s: fused attention failed (%s); running the graph as exported from now on",
                self.path.name,
                _first_line(exc),
            )
            self.fused_attention_blocks = 0
            self._session = self._new_session(None)
            return self._infer_impl(feeds)
        # The heap is not trimmed after a run: the next run, or PyTorch between calls, reuses those
        # pages, and trimming made it fault them in again (a memory-attention call: 14 % slower).
        return dict(zip(names, values))

    def _fetch_impl(self, feeds: dict[str, np.ndarray], names: list[str]) -> Mapping[str, object]:
        """On the CPU, where ONNX Runtime stands in for the OM in verify, the outputs outside `names`
        are held as the OM holds them on its device (here in host memory, where they already are), so
        the host meets the same placeholders; a device provider copies every output back."""
        produced = self._infer_impl(feeds)
        if self.device != CPU_PROVIDER:
            return produced
        return {name: value if name in names else _held(value) for name, value in produced.items()}

    @property
    def holds_values(self) -> bool:
        """Whether `run_values` serves this session: ONNX Runtime's CPU, where an OrtValue and the
        numpy array viewing it are one buffer (a device provider would need its own binding)."""
        self.activate()
        return self.device == CPU_PROVIDER and not self.fused_attention_blocks

    def run_values(self, feeds: Mapping[str, object], fetch: Collection[str] | None = None) -> dict[str, object]:
        """`run` with values that stay in ONNX Runtime: an input may be an OrtValue another session
        returned, bound as it is; every output comes back as an OrtValue on the session's device
        (those outside `fetch` held, as `_fetch_impl` holds them). The spliced pipeline hands an
        output on this way when the next graph reads it unchanged."""
        import onnxruntime

        if not self.holds_values:
            raise BackendError(f"{self.path.name}: runs on {self.device}, where outputs are not kept as values")
        values = {k: v for k, v in feeds.items() if isinstance(v, onnxruntime.OrtValue)}
        arrays = check_feeds(
            self._inputs, {k: values[k].numpy() if k in values else v for k, v in feeds.items()}, model=self.path.name
        )
        binding = self._session.io_binding()
        for name, array in arrays.items():
            if name in values:
                binding.bind_ortvalue_input(name, values[name])
            else:
                binding.bind_cpu_input(name, np.require(array, requirements="C"))
        names = [spec.name for spec in self._outputs]
        for name in names:
            binding.bind_output(name, "cpu")
        started = time.perf_counter()
        try:
            self._session.run_with_iobinding(binding)
        except Exception as exc:
            raise BackendError(f"onnxruntime failed to run {self.path.name}: {_first_line(exc)}") from exc
        self.last_seconds = time.perf_counter() - started
        values = dict(zip(names, binding.get_outputs()))
        return {name: v if fetch is None or name in fetch else _held_value(v) for name, v in values.items()}

    def _deactivate_impl(self) -> None:
        self._session = None
        trim_heap()


def _held(array: np.ndarray) -> HeldOutput:
    return HeldOutput(shape=tuple(array.shape), copy_back=lambda: array)


def _held_value(value) -> HeldOutput:
    """An OrtValue held: the host array viewing it is made only when the host reads it."""
    # A copy: the host tensor must not outlive the OrtValue whose buffer a view would share.
    return HeldOutput(shape=tuple(value.shape()), copy_back=lambda: np.array(value.numpy()))


def _specs(node_args) -> list[IOSpec]:
    return [IOSpec(name=arg.name, shape=list(arg.shape), dtype=numpy_dtype_of(arg.type)) for arg in node_args]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def open_onnxruntime(path: str | Path, split: BatchSplit | None) -> Runner:
    """An ONNX Runtime session on `path`, running the batch in chunks when `split` is given."""
    backend = OnnxRuntimeBackend(path).activate()
    return SplitBatchBackend(backend, split) if split is not None else backend
