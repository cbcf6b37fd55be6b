"""TEST DOUBLE for ONNX Runtime's CANN execution provider (the onnxruntime-cann wheel): no NPU.

`install_cann_provider_double(monkeypatch)` makes this onnxruntime list "CANNExecutionProvider" and
open sessions asked for it on the CPU provider, after checking the provider options as the real
provider documents them (onnxruntime.ai, "CANN Execution Provider", configuration options): only
the documented keys, an integer device_id, a precision_mode among the five CANN modes. The
sessions report "CANNExecutionProvider" first, as the real one would; the graph runs on the CPU.
"""

from __future__ import annotations

import onnxruntime

PROVIDER = "CANNExecutionProvider"
DOCUMENTED_OPTIONS = {
    "device_id",
    "npu_mem_limit",
    "arena_extend_strategy",
    "enable_cann_graph",
    "dump_graphs",
    "dump_om_model",
    "precision_mode",
    "op_select_impl_mode",
    "optypelist_for_implmode",
}
PRECISION_MODES = ("force_fp32", "force_fp16", "allow_fp32_to_fp16", "must_keep_origin_dtype", "allow_mix_precision")


def install_cann_provider_double(monkeypatch) -> list:
    """Install the double; returns the list every session it opens is appended to."""
    real_session = onnxruntime.InferenceSession
    real_available = onnxruntime.get_available_providers
    created: list = []

    class CannSessionDouble(real_session):
        def __init__(self, path, sess_options=None, providers=None, **kwargs):
            self.cann_options = None
            cpu_only = []
            for entry in providers or []:
                name, options = entry if isinstance(entry, tuple) else (entry, {})
                if name == PROVIDER:
                    self.cann_options = _checked(dict(options))
                else:
                    cpu_only.append(entry)
            super().__init__(path, sess_options=sess_options, providers=cpu_only or ["CPUExecutionProvider"], **kwargs)
            created.append(self)

        def get_providers(self):
            real = super().get_providers()
            return [PROVIDER, *real] if self.cann_options is not None else real

    monkeypatch.setattr(onnxruntime, "InferenceSession", CannSessionDouble)
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: [PROVIDER, *real_available()])
    return created


def _checked(options: dict) -> dict:
    unknown = sorted(set(options) - DOCUMENTED_OPTIONS)
    if unknown:
        raise ValueError(f"CANN provider: unknown option(s) {unknown}")
    if "device_id" in options and not str(options["device_id"]).isdigit():
        raise ValueError(f"CANN provider: device_id {options['device_id']!r} is not an integer")
    if "precision_mode" in options and options["precision_mode"] not in PRECISION_MODES:
        raise ValueError(f"CANN provider: precision_mode {options['precision_mode']!r} is not one of {PRECISION_MODES}")
    return options
