"""Runtime backends: one interface over ONNX Runtime and ais_bench (OM).

The OM adapter is exercised against InferSessionDouble (tests/infer_session_double.py), a test
double of ais_bench's documented InferSession backed by ONNX Runtime: no OM is built or run here.
"""

from __future__ import annotations

import contextlib
import sys
import warnings

import numpy as np
import pytest
import torch
from infer_session_double import InferSessionDouble, recording_sessions
from omskills.ascend import om_backend
from omskills.ascend.om_backend import OmBackend, om_mode_for_strategy
from omskills.errors import OmskillsError
from omskills.runtime import (
    BackendError,
    BackendInputError,
    IOSpec,
    OnnxRuntimeBackend,
    available_backends,
    open_backend,
)


class LinearAndIds(torch.nn.Module):
    """Float input with a dynamic batch, int input with a static size."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, ids: torch.Tensor):
        return torch.relu(self.linear(x)), ids * 2


class DiffAndScale(torch.nn.Module):
    """Non-commutative in its inputs, so feeding them in the wrong order shows."""

    def forward(self, a: torch.Tensor, b: torch.Tensor):
        return a - b, a * 3.0


def export(module: torch.nn.Module, args, path, inputs, outputs, dynamic_axes=None) -> str:
    # The legacy exporter takes ~0.4 s here against ~11 s for dynamo=True; toy modules need
    # nothing more. Exporters print to stdout: keep stdout clean.
    with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module.eval(),
            args,
            str(path),
            input_names=inputs,
            output_names=outputs,
            dynamic_axes=dynamic_axes,
            dynamo=False,
        )
    return str(path)


@pytest.fixture(scope="module")
def linear_model(tmp_path_factory):
    torch.manual_seed(0)
    module = LinearAndIds()
    path = tmp_path_factory.mktemp("onnx") / "linear.onnx"
    export(
        module,
        (torch.randn(2, 4), torch.arange(5)),
        path,
        ["x", "ids"],
        ["y", "ids2"],
        dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
    )
    return module, str(path)


@pytest.fixture(scope="module")
def diff_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("onnx") / "diff.onnx"
    return export(DiffAndScale(), (torch.randn(2, 3), torch.randn(2, 3)), path, ["a", "b"], ["diff", "scaled"])


def feeds_for(batch: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch)
    return {"x": rng.standard_normal((batch, 4), dtype=np.float32), "ids": np.arange(5, dtype=np.int64)}


# -- IOSpec ---------------------------------------------------------------------------------


def test_iospec_spells_unknown_dims_as_question_mark_and_keeps_named_ones():
    spec = IOSpec(name="x", shape=[None, "batch", -1, 3], dtype="float32")
    assert spec.shape == ["?", "batch", "?", 3]
    assert not spec.is_static
    assert IOSpec(name="y", shape=[1, 3], dtype="int64").is_static


# -- ONNX Runtime backend -------------------------------------------------------------------


def test_onnxruntime_backend_matches_torch_and_reports_provider_and_time(linear_model):
    module, path = linear_model
    feeds = feeds_for(2)
    with OnnxRuntimeBackend(path) as backend:
        outputs = backend.run(feeds)
        assert backend.device == "CPUExecutionProvider"  # the only preferred provider on this machine
        assert backend.describe() == "onnxruntime:CPUExecutionProvider"
        assert backend.last_seconds is not None and backend.last_seconds > 0
    with torch.no_grad():
        y, ids2 = module(torch.from_numpy(feeds["x"]), torch.from_numpy(feeds["ids"]))
    assert list(outputs) == ["y", "ids2"]
    np.testing.assert_allclose(outputs["y"], y.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(outputs["ids2"], ids2.numpy())


def test_onnxruntime_worker_threads_sleep_between_runs_unless_asked_to_spin(linear_model):
    # A spliced pipeline runs PyTorch between graph calls: spinning ORT threads would take its cores.
    _, path = linear_model
    spin_entry = "session.intra_op.allow_spinning"
    for options, expected in (({}, "0"), ({"spin": True}, "1")):
        with OnnxRuntimeBackend(path, **options) as backend:
            assert backend._session.get_session_options().get_session_config_entry(spin_entry) == expected
            assert backend.run(feeds_for(2))["y"].shape[0] == 2


def test_onnxruntime_heap_pages_go_back_after_loading_and_closing_not_between_runs(linear_model, monkeypatch):
    """Without ORT's arena the parsed model is freed to glibc, which keeps the pages (0.7 GB for a
    2 GB graph); between runs the pages are kept for the next run, which would fault them in again."""
    from omskills.runtime import onnxruntime_backend

    trims: list[str] = []
    monkeypatch.setattr(onnxruntime_backend, "trim_heap", lambda: trims.append("trim"))
    _, path = linear_model
    with OnnxRuntimeBackend(path) as backend:
        assert len(trims) == 1  # the session is built
        for _ in range(3):
            backend.run(feeds_for(2))
        assert len(trims) == 1
    assert len(trims) == 2  # closed


def test_onnxruntime_backend_exposes_io_metadata_with_symbolic_dims(linear_model):
    _, path = linear_model
    with open_backend(path, "onnxruntime") as backend:
        assert backend.inputs == [
            IOSpec(name="x", shape=["batch", 4], dtype="float32"),
            IOSpec(name="ids", shape=[5], dtype="int64"),
        ]
        assert [(o.name, o.dtype) for o in backend.outputs] == [("y", "float32"), ("ids2", "int64")]


def test_dynamic_dim_accepts_any_size(linear_model):
    _, path = linear_model
    with open_backend(path, "onnxruntime", threads=1) as backend:
        for batch in (1, 3, 7):
            assert backend.run(feeds_for(batch))["y"].shape == (batch, 3)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda f: f.pop("ids"), r"missing input\(s\) \['ids'\]"),
        (lambda f: f.update(idz=f.pop("ids")), r"missing input\(s\) \['ids'\]; unknown input\(s\) \['idz'\]"),
        (lambda f: f.update(x=f["x"].astype(np.float64)), "input 'x' has dtype float64, expected float32"),
        (lambda f: f.update(x=f["x"][None]), "input 'x' has rank 3 .* expected rank 2"),
        (lambda f: f.update(ids=np.arange(6, dtype=np.int64)), "input 'ids' has size 6 on dim 0 .* expected 5"),
        (lambda f: f.update(x=f["x"].tolist()), "input 'x' must be a numpy.ndarray, got list"),
    ],
    ids=["missing", "unknown", "dtype", "rank", "static-dim", "not-an-array"],
)
def test_bad_feeds_raise_a_clear_error_naming_the_input(linear_model, change, message):
    _, path = linear_model
    feeds = feeds_for(2)
    change(feeds)
    with OnnxRuntimeBackend(path) as backend, pytest.raises(BackendInputError, match=message) as caught:
        backend.run(feeds)
    assert isinstance(caught.value, OmskillsError)
    assert "\n" not in str(caught.value)


def test_unavailable_provider_is_refused_by_name(linear_model):
    _, path = linear_model
    with pytest.raises(BackendError, match=r"providers: \['NoSuchExecutionProvider'\] not available"):
        OnnxRuntimeBackend(path, providers=["NoSuchExecutionProvider"])


def test_missing_or_corrupt_model_file_is_a_clear_error(tmp_path):
    with pytest.raises(BackendError, match="model file not found: .*absent.onnx"):
        open_backend(tmp_path / "absent.onnx", "onnxruntime")
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(b"not a protobuf")
    with pytest.raises(BackendError, match="onnxruntime cannot load .*corrupt.onnx"):
        open_backend(corrupt, "onnxruntime")


def test_open_backend_rejects_unknown_kind_and_options(linear_model):
    _, path = linear_model
    with pytest.raises(BackendError, match="kind: unknown backend 'tensorrt'"):
        open_backend(path, "tensorrt")
    with pytest.raises(BackendError, match=r"onnxruntime backend: unknown option\(s\) \['device_id'\]"):
        open_backend(path, "onnxruntime", device_id=0)


def test_available_backends_lists_ort_providers_and_om_only_where_an_npu_runs_it(monkeypatch):
    monkeypatch.setattr(om_backend, "om_runtime_problem", lambda: "not importable: ais_bench")  # as on this machine
    assert available_backends() == ["onnxruntime:CPUExecutionProvider"]
    monkeypatch.setattr(om_backend, "om_runtime_problem", lambda: None)
    assert available_backends() == ["om", "onnxruntime:CPUExecutionProvider"]


# -- OM backend through the InferSession test double -------------------------------------------


@pytest.fixture
def sessions(monkeypatch) -> list[InferSessionDouble]:
    """Installs the fake ais_bench; collects every InferSessionDouble the adapter creates."""
    return recording_sessions(monkeypatch)


def test_om_backend_without_ais_bench_says_what_is_needed(monkeypatch, diff_model):
    monkeypatch.setitem(sys.modules, "ais_bench.infer.interface", None)
    with pytest.raises(BackendError, match="OM backend needs an Ascend NPU host with CANN and the ais_bench"):
        open_backend(diff_model, "om")


def test_om_backend_orders_feeds_by_model_inputs_and_names_outputs(sessions, diff_model):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.full((2, 3), 10.0, dtype=np.float32)
    with open_backend(diff_model, "om", device_id=3) as backend:
        outputs = backend.run({"b": b, "a": a})  # dict order differs from the model's
        assert backend.device == "npu:3"
        assert backend.describe() == "om:npu:3"
    (session,) = sessions
    assert session.device_id == 3
    assert session.calls[0].mode == "static"
    assert list(outputs) == ["diff", "scaled"]
    np.testing.assert_array_equal(outputs["diff"], a - b)
    np.testing.assert_array_equal(outputs["scaled"], a * 3)
    assert session.freed  # close() released the session's device memory


def test_om_backend_reads_metadata_from_get_inputs_and_get_outputs(sessions, linear_model):
    _, path = linear_model
    backend = OmBackend(path, mode="dymshape")
    assert backend.inputs == [
        IOSpec(name="x", shape=["?", 4], dtype="float32"),
        IOSpec(name="ids", shape=[5], dtype="int64"),
    ]
    assert [o.name for o in backend.outputs] == ["y", "ids2"]
    backend.close()


@pytest.mark.parametrize(
    ("strategy", "mode"),
    [
        ("static", "static"),
        ("dynamic_batch_size", "dymbatch"),
        ("dynamic_image_size", "dymhw"),
        ("dynamic_dims", "dymdims"),
        ("dynamic_shape", "dymshape"),
    ],
)
def test_om_mode_follows_the_atc_shape_strategy(strategy, mode):
    assert om_mode_for_strategy(strategy) == mode


def test_unknown_shape_strategy_is_refused():
    with pytest.raises(BackendError, match="shape strategy: unknown kind 'dynamic'"):
        om_mode_for_strategy("dynamic")


def test_om_backend_passes_mode_and_custom_sizes_to_infer(sessions, linear_model):
    _, path = linear_model
    with open_backend(path, "om", mode=om_mode_for_strategy("dynamic_shape"), custom_sizes=[4096, 512]) as backend:
        outputs = backend.run(feeds_for(3))
    call = sessions[0].calls[0]
    assert (call.mode, call.custom_sizes) == ("dymshape", [4096, 512])
    assert call.feed_shapes == [(3, 4), (5,)]
    assert outputs["y"].shape == (3, 3)

    with open_backend(path, "om", mode="dymbatch") as backend:
        # A gear model's descriptor may report the largest gear: only rank and dtype are checked.
        assert [spec.shape for spec in backend.inputs] == [["?", "?"], ["?"]]
        backend.run(feeds_for(2))
    assert sessions[1].calls[0].mode == "dymbatch"
    assert sessions[1].calls[0].custom_sizes == 100000  # InferSession's documented default, untouched


def test_om_backend_rejects_a_mode_that_is_not_an_infersession_mode(sessions, diff_model):
    with pytest.raises(BackendError, match=r"mode: 'dynamic_batch_size' is not an InferSession mode"):
        OmBackend(diff_model, mode="dynamic_batch_size")
    with pytest.raises(BackendError, match="custom_sizes: only used with mode='dymshape'"):
        OmBackend(diff_model, mode="static", custom_sizes=1024)
    assert sessions == []  # refused before any session was opened


def test_om_backend_rejects_static_mode_on_a_model_with_dynamic_dims(sessions, linear_model):
    _, path = linear_model
    with pytest.raises(BackendError, match=r"mode: 'static' does not match linear.onnx, whose input\(s\) \['x'\]"):
        open_backend(path, "om", mode="static")


def test_om_backend_checks_feeds_like_every_backend(sessions, diff_model):
    with open_backend(diff_model, "om") as backend, pytest.raises(BackendInputError, match="input 'a' has dtype int32"):
        backend.run({"a": np.zeros((2, 3), dtype=np.int32), "b": np.zeros((2, 3), dtype=np.float32)})
    assert sessions[0].calls == []  # the bad feed never reached the runtime
