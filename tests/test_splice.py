"""omskills.splicing.splice: put a compiled candidate back into the live model, and take it out again.

A spliced module answers the calls its contract covers from the backend and gives the caller the
structure it expects (dicts, tuples, constants, dtypes, device); any other call runs the original
PyTorch module and is counted with its reason and logged; unsplice puts the original object back.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import pytest
import torch
from export_helpers import BATCH_DIMS, OBSERVED_BATCHES, capture_head_contract, head_inputs, make_host
from omskills.contracts import capture_contracts
from omskills.convert.export import ContractWrapper, export_onnx
from omskills.records.contracts import ShapeStrategy
from omskills.runtime import IOSpec, open_backend
from omskills.splicing.splice import SplicedModule, SpliceError, splice


class TorchBackendDouble:
    """Test double of a runtime backend: runs the contract wrapper in PyTorch on numpy feeds.

    It returns float64 arrays (as a runtime with another precision might) so the spliced module's
    dtype restoration shows, and keeps every feed it was given.
    """

    kind = "torch-double"
    device = "cpu"

    def __init__(self, module: torch.nn.Module, contract) -> None:
        self.wrapper = ContractWrapper(module, contract)
        self.inputs = [IOSpec(name=s.name, shape=s.shape, dtype=s.dtype) for s in contract.inputs]
        self.outputs = [IOSpec(name=s.name, shape=s.shape, dtype=s.dtype) for s in contract.outputs]
        self.feeds: list[dict[str, np.ndarray]] = []

    def describe(self) -> str:
        return f"{self.kind}:{self.device}"

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.feeds.append(dict(feeds))
        with torch.no_grad():
            flat = self.wrapper(*(torch.from_numpy(feeds[io.name]) for io in self.inputs))
        return {io.name: t.numpy().astype(np.float64) for io, t in zip(self.outputs, flat)}


@pytest.fixture
def host():
    return make_host()


@pytest.fixture
def contract(host):
    return capture_head_contract(host)


@pytest.fixture
def double(host, contract):
    return TorchBackendDouble(host.head, contract)


def assert_same_output(got: dict, want: dict) -> None:
    assert list(got) == list(want) and isinstance(got["extra"], tuple)
    assert got["n"] == want["n"] == 3
    for key in ("y", "best"):
        assert got[key].dtype == want[key].dtype
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)
    for g, w in zip(got["extra"], want["extra"]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_a_spliced_model_runs_the_candidate_in_onnxruntime_with_the_same_results(host, contract, tmp_path):
    exported = export_onnx(host.head, contract, head_inputs(2), tmp_path / "head.onnx", dynamic_dims=BATCH_DIMS)
    x = torch.randn(5, 4)
    with torch.no_grad():
        want = host(x)
    with open_backend(exported.path, "onnxruntime") as backend, splice(host, [(contract, backend)]) as handle:
        with torch.no_grad():
            got = host(x)
        [stats] = handle.stats()

    assert_same_output(got, want)
    assert (stats.backend_kind, stats.backend_device) == ("onnxruntime", backend.device)
    assert (stats.calls, stats.backend_calls, stats.fallbacks) == (1, 1, 0)
    assert stats.total_backend_seconds > 0 and stats.mean_backend_seconds == stats.total_backend_seconds


def test_outputs_come_back_in_the_contract_dtype_on_the_callers_device(host, contract, double):
    with splice(host, [(contract, double)]), torch.no_grad():
        got = host(torch.randn(2, 4))
    assert got["y"].dtype == torch.float32 and got["best"].dtype == torch.int64
    assert got["y"].device == torch.device("cpu")
    assert set(double.feeds[0]) == {"x", "pair_0", "pair_1"}


def test_a_call_with_another_constant_falls_back_to_pytorch_and_is_counted(host, contract, double, caplog):
    x = torch.randn(2, 4)
    with torch.no_grad():
        want = host(x, mode="max")
    with splice(host, [(contract, double)]) as handle, torch.no_grad(), caplog.at_level(logging.WARNING):
        got = host(x, mode="max")
        [stats] = handle.stats()
        [event] = handle.fallbacks()

    assert_same_output(got, want)  # PyTorch ran it: amax, not the bound sum
    assert double.feeds == []
    assert (stats.calls, stats.backend_calls, stats.fallbacks) == (1, 0, 1)
    assert stats.fallback_kinds == {"constant": 1}
    assert (event.kind, event.call) == ("constant", 1)
    assert event.reason == "kwargs['mode'] is 'max', the contract binds 'sum'"
    assert "head call 1 runs in PyTorch (fallback, constant)" in caplog.text


def test_a_batch_never_observed_falls_back_without_a_strategy(host, contract, double):
    assert 3 not in OBSERVED_BATCHES
    with splice(host, [(contract, double)]) as handle, torch.no_grad():
        host(torch.randn(OBSERVED_BATCHES[1], 4))
        host(torch.randn(3, 4))
    [event] = handle.fallbacks()
    assert (event.kind, event.call) == ("shape", 2)
    assert event.reason == f"input x dim 0 is 3, the contract allows {list(OBSERVED_BATCHES)}"
    assert handle.stats()[0].backend_calls == 1


def test_a_shape_strategy_decides_which_sizes_the_backend_takes(host, contract, double):
    shapes = {"x": [-1, 4], "pair_0": [-1, 3], "pair_1": [-1, 3]}
    gears = ShapeStrategy(kind="dynamic_batch_size", input_shapes=shapes, gears=[[3], [8]], rationale="test")
    with splice(host, [(contract, double)], strategies={"head": gears}) as handle, torch.no_grad():
        for batch in (3, 8, 2):
            host(torch.randn(batch, 4))
    [stats] = handle.stats()
    assert (stats.backend_calls, stats.fallbacks) == (2, 1)
    assert stats.fallback_reasons == [
        "dynamic dims x[0]=2, pair_0[0]=2, pair_1[0]=2 match no dynamic_batch_size gear of [[3], [8]]"
    ]

    ranges = ShapeStrategy(
        kind="dynamic_shape",
        input_shapes=shapes,
        ranges={name: [[1, 4], [shape[1], shape[1]]] for name, shape in shapes.items()},
        rationale="test",
    )
    with splice(host, [(contract, double)], strategies={"head": ranges}) as handle, torch.no_grad():
        for batch in (1, 4, 5):
            host(torch.randn(batch, 4))
    [stats] = handle.stats()
    assert (stats.backend_calls, stats.fallbacks) == (2, 1)
    assert stats.fallback_reasons == ["input x dim 0 is 5, outside the strategy's range [1, 4]"]


def test_wrong_dtype_structure_or_autograd_fall_back_each_with_its_kind(host, contract, double):
    x, pair_0, pair_1 = head_inputs(2, torch.float64)
    with splice(host, [(contract, double)]) as handle:
        with torch.no_grad():
            host(torch.randn(2, 4))  # inside the contract
            with pytest.raises(RuntimeError, match="same dtype"):  # PyTorch itself refuses float64 here
                host.head(x, (pair_0, pair_1), scale=2.0, mode="sum")
            host.head(x.float(), (pair_0.float(), pair_1.float()), scale=2.0)  # mode left out
        host(torch.randn(2, 4, requires_grad=True))
    assert [e.kind for e in handle.fallbacks()] == ["dtype", "structure", "autograd"]
    assert handle.fallbacks()[0].reason == "input x is float64, the contract's is float32"
    [stats] = handle.stats()
    assert stats.fallback_kinds == {"dtype": 1, "structure": 1, "autograd": 1}
    assert (stats.calls, stats.backend_calls) == (4, 1)


def test_unsplice_puts_the_original_object_back(host, contract, double):
    original = host.head
    handle = splice(host, [(contract, double)])
    assert isinstance(host.head, SplicedModule) and host.head.original is original
    assert host.head.lin is original.lin  # the caller still reaches the candidate's attributes
    handle.unsplice()
    assert host.head is original

    with splice(host, [(contract, double)]):
        assert host.head is not original
    assert host.head is original


def test_a_candidate_that_is_not_the_contracts_class_or_already_spliced_is_refused(host, contract, double):
    wrong = contract.model_copy(update={"module_class": "sam3.model.Other"})
    with pytest.raises(SpliceError, match=r"head: <root>\.head is a Head, the contract is for sam3\.model\.Other"):
        splice(host, [(wrong, double)])
    assert not isinstance(host.head, SplicedModule)

    original = host.head
    with pytest.raises(SpliceError, match="already spliced"):
        splice(host, [(contract, double), (contract, double)])
    assert host.head is original  # all or nothing: the first splice was undone


def test_a_backend_that_lacks_a_contract_output_is_refused(host, contract, double):
    double.outputs = double.outputs[:-1]
    with pytest.raises(SpliceError, match=r"has no output\(s\) \['best'\] of the contract"):
        splice(host, [(contract, double)])


class Scaler(torch.nn.Module):
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encode(x) + 1


def test_a_contract_on_another_method_splices_that_method_only():
    host = torch.nn.Sequential(Scaler())
    [captured] = capture_contracts(host, {"scaler": "0"}, lambda: host(torch.randn(2, 3)))
    contract = captured.model_copy(update={"method": "encode"})  # the caller uses host[0].encode(x)
    double = TorchBackendDouble(host[0], contract)
    x = torch.randn(2, 3)
    with splice(host, [(contract, double)]) as handle:
        torch.testing.assert_close(host[0].encode(x), x * 2)
        torch.testing.assert_close(host[0](x), x * 2 + 1)  # forward is not in the contract: PyTorch runs it
    assert len(double.feeds) == 1
    assert [e.kind for e in handle.fallbacks()] == ["method"]


class Repeats(torch.nn.Module):
    """Its output's shape depends on a Python int: one graph cannot serve every value."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, times: int) -> torch.Tensor:
        return self.lin(x).repeat(times, 1)


def test_a_candidate_dispatched_on_an_argument_sends_each_call_to_the_graph_of_its_value():
    host = torch.nn.Sequential(Repeats())
    x = torch.randn(2, 3)

    def run():
        with torch.no_grad():
            for times in (1, 2, 1):
                host[0](x, times)

    one, two = capture_contracts(host, {"repeats": "0"}, run)
    assert (one.candidate, two.candidate) == ("repeats-times_1", "repeats-times_2")
    doubles = TorchBackendDouble(host[0], one), TorchBackendDouble(host[0], two)
    with torch.no_grad():
        want = [host[0](x, times) for times in (2, 1, 3)]
    with splice(host, [(one, doubles[0]), (two, doubles[1])]) as handle, torch.no_grad():
        assert isinstance(host[0], SplicedModule) and len(host[0].routes) == 2
        got = [host[0](x, times) for times in (2, 1, 3)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert [len(d.feeds) for d in doubles] == [1, 1]
    stats = {s.candidate: s for s in handle.stats()}
    assert stats["repeats-times_2"].backend_calls == 1 and stats["repeats-times_1"].backend_calls == 1
    [event] = handle.fallbacks()  # 3 was never observed: no graph serves it, PyTorch does
    assert (event.kind, event.call) == ("constant", 3) and "args[1] is 3" in event.reason
    assert host[0].__class__ is Repeats  # unspliced as one


def test_graphs_of_different_candidates_cannot_share_a_replacement_point(host, contract, double):
    other = contract.model_copy(update={"candidate": "head-copy"})
    with pytest.raises(SpliceError, match="already spliced"):
        splice(host, [(contract, double), (other, double)])


class Timestep(torch.nn.Module):
    """A denoiser's call: a latent and a 0-d timestep."""

    def forward(self, latent: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return latent * t


class Host(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.step = Timestep()


def test_a_0_d_input_reaches_the_backend_0_d_and_a_backend_error_falls_back_with_its_reason():
    host = Host()
    latent, t = torch.ones(2, 3), torch.tensor(0.5)
    [contract] = capture_contracts(host, {"step": "step"}, lambda: host.step(latent, t))
    double = TorchBackendDouble(host.step, contract)
    with splice(host, [(contract, double)]) as handle:
        torch.testing.assert_close(host.step(latent, t), latent * 0.5)
        assert double.feeds[0]["t"].shape == ()
        double.run = lambda feeds: (_ for _ in ()).throw(RuntimeError("device lost\nmore detail"))
        torch.testing.assert_close(host.step(latent, t), latent * 0.5)  # PyTorch answered
    [event] = handle.fallbacks()
    assert (event.kind, event.call) == ("backend", 2)
    assert event.reason == "the torch-double backend failed: RuntimeError: device lost"
