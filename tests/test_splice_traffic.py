"""What spliced graphs move between host and device: calls, bytes in and out per step and per
graph, and which inputs were another graph's output passed on unchanged (a hand-off that could
stay on the device); and the link time those counts predict."""

from __future__ import annotations

import pytest
import torch
from omskills.contracts import capture_contracts
from omskills.records.traffic import LinkCost
from omskills.splicing.splice import splice
from omskills.splicing.traffic import traffic_report
from test_splice import TorchBackendDouble


class Encoder(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1


class Decoder(torch.nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.sum(-1)


class Pipeline(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.dec = Encoder(), Decoder()

    def forward(self, x: torch.Tensor, glue: str = "none") -> torch.Tensor:
        h = self.enc(x)
        if glue == "in_place":
            h.add_(1)  # the host changed it: the decoder's input is not the encoder's output any more
        elif glue == "transposed":
            h = h.t().contiguous().t()  # same values, a new buffer made on the host
        return self.dec(h)


@pytest.fixture(params=["no_grad", "inference_mode"])
def spliced_pipeline(request):
    """Three steps; in inference mode tensors keep no version counter, and in-place writes must show all the same."""
    host = Pipeline()
    x = torch.randn(4, 8)
    with torch.no_grad():
        enc, dec = capture_contracts(host, {"enc": "enc", "dec": "dec"}, lambda: host(x))
    mode = torch.no_grad if request.param == "no_grad" else torch.inference_mode
    with splice(host, [(enc, TorchBackendDouble(host.enc, enc)), (dec, TorchBackendDouble(host.dec, dec))]) as handle:
        with mode():
            for index, glue in enumerate(("none", "in_place", "transposed")):
                host(x, glue)
                handle.traffic.step_done(index)
    return handle, x


def test_each_step_counts_the_calls_and_bytes_of_every_graph(spliced_pipeline):
    handle, x = spliced_pipeline
    steps = handle.traffic.steps()
    assert [s.step for s in steps] == [0, 1, 2]
    for step in steps:
        enc, dec = step.graphs
        assert (enc.graph, enc.calls, enc.bytes_in, enc.bytes_out) == ("enc", 1, x.nbytes, x.nbytes)
        assert (dec.graph, dec.calls, dec.bytes_in, dec.bytes_out) == ("dec", 1, x.nbytes, x.nbytes // 8)
        assert step.calls == 2 and step.bytes_crossing == 3 * x.nbytes + x.nbytes // 8


def test_an_output_passed_on_unchanged_is_a_hand_off_and_one_the_host_changed_or_copied_is_not(spliced_pipeline):
    handle, x = spliced_pipeline
    untouched, changed, copied = (s.graphs[1] for s in handle.traffic.steps())
    assert (untouched.handed_in, untouched.handed_from) == (x.nbytes, {"enc": x.nbytes})
    assert (changed.handed_in, changed.handed_from) == (0, {})
    assert (copied.handed_in, copied.handed_from) == (0, {})


def test_calls_after_the_last_step_are_a_step_of_their_own():
    host = Pipeline()
    x = torch.randn(2, 3)
    with torch.no_grad():
        enc, dec = capture_contracts(host, {"enc": "enc", "dec": "dec"}, lambda: host(x))
    with splice(host, [(enc, TorchBackendDouble(host.enc, enc))]) as handle, torch.no_grad():
        host(x)
        handle.traffic.step_done(0)
        host.enc(x)  # teardown work after the last step
    assert [(s.step, s.calls) for s in handle.traffic.steps()] == [(0, 1), (None, 1)]


def test_the_link_time_is_predicted_from_calls_and_bytes_and_hand_offs_on_the_device_lower_it(spliced_pipeline):
    handle, x = spliced_pipeline
    link = LinkCost(soc="Ascend310P3", bandwidth_gb_s=10.0, round_trip_us=100.0, source="test")
    report = traffic_report(handle.traffic.steps(), link)
    crossing = 3 * x.nbytes + x.nbytes // 8
    # Per step: two launches and four copies (each graph one tensor in, one out).
    assert (report.calls_per_step, report.copies_per_step, report.bytes_per_step) == (2, 4, crossing)
    assert report.predicted_link_s_per_step == pytest.approx(6 * 100e-6 + crossing / 10e9, abs=1e-6)
    handed = x.nbytes / 3  # one step in three hands the encoder's output on unchanged
    assert report.handed_in_per_step == pytest.approx(handed, abs=0.1)
    kept_on_device = 6 - 1 / 3
    assert report.predicted_link_s_per_step_handed_off == pytest.approx(
        kept_on_device * 100e-6 + (crossing - handed) / 10e9, abs=1e-6
    )
    shared_memory = traffic_report(handle.traffic.steps(), link.model_copy(update={"bandwidth_gb_s": None}))
    assert shared_memory.predicted_link_s_per_step == pytest.approx(6 * 100e-6, abs=1e-9)
    assert [(g.graph, g.calls) for g in report.per_graph] == [("enc", 3), ("dec", 3)]


def test_a_count_that_fails_leaves_the_call_to_the_backend_and_says_why(monkeypatch):
    host = Pipeline()
    x = torch.randn(2, 3)
    with torch.no_grad():
        [enc] = capture_contracts(host, {"enc": "enc"}, lambda: host(x))
    double = TorchBackendDouble(host.enc, enc)
    with splice(host, [(enc, double)]) as handle, torch.no_grad():
        monkeypatch.setattr(handle.traffic, "_count", lambda *a: (_ for _ in ()).throw(ValueError("odd tensor")))
        torch.testing.assert_close(host.enc(x), x * 2 + 1)
    assert len(double.feeds) == 1 and not handle.fallbacks()
    assert handle.traffic.error == "enc: ValueError: odd tensor"


def _link() -> LinkCost:
    return LinkCost(soc="Ascend910B4", bandwidth_gb_s=31.5, round_trip_us=9.5, source="test")


def test_a_graph_that_reads_only_another_graphs_outputs_unchanged_is_proposed_for_a_merge():
    host = Pipeline()
    x = torch.randn(4, 8)
    with torch.no_grad():
        enc, dec = capture_contracts(host, {"enc": "enc", "dec": "dec"}, lambda: host(x))
    with splice(host, [(enc, TorchBackendDouble(host.enc, enc)), (dec, TorchBackendDouble(host.dec, dec))]) as handle:
        with torch.no_grad():
            for index in range(2):
                host(x)
                handle.traffic.step_done(index)
    merges = {m.graph: m for m in traffic_report(handle.traffic.steps(), _link()).merges}
    assert merges["dec"].mergeable and merges["dec"].upstream == "enc"
    assert (merges["dec"].calls_saved_per_step, merges["dec"].bytes_saved_per_step) == (1.0, x.nbytes)
    assert not merges["enc"].mergeable and merges["enc"].upstream is None and "host code" in merges["enc"].reason


def test_a_graph_fed_by_host_code_between_the_calls_is_not_proposed_and_the_reason_gives_the_bytes(spliced_pipeline):
    handle, x = spliced_pipeline  # two steps in three, the host changed or copied the encoder's output
    dec = next(m for m in traffic_report(handle.traffic.steps(), _link()).merges if m.graph == "dec")
    assert not dec.mergeable and dec.upstream == "enc" and dec.calls_saved_per_step == 0.0
    assert f"{2 * x.nbytes / 3 / 1e6:.2f} MB per step of its inputs come from host code" in dec.reason


def test_graphs_called_unequally_or_fed_by_several_graphs_are_not_proposed():
    from omskills.records.traffic import GraphTraffic, StepTraffic

    def graph(name, calls, handed_from=None):
        handed = handed_from or {}
        return GraphTraffic(
            graph=name,
            calls=calls,
            bytes_in=sum(handed.values()) or 8,
            bytes_out=8,
            handed_in=sum(handed.values()),
            handed_from=handed,
        )

    steps = [
        StepTraffic(
            step=0, graphs=[graph("a", 1), graph("b", 1), graph("c", 3, {"a": 8}), graph("d", 1, {"a": 8, "b": 8})]
        )
    ]
    merges = {m.graph: m for m in traffic_report(steps, _link()).merges}
    assert not merges["c"].mergeable and merges["c"].reason == "called 3 times against 1 calls of a"
    assert not merges["d"].mergeable and merges["d"].reason.startswith("fed by several graphs (a, b)")


# --------------------------------------------------------------------------- device-resident hand-offs


class Scale(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 3.0


class Shift(torch.nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h - 1.0


class TwoGraphs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = Scale(), Shift()

    def forward(self, x: torch.Tensor, glue: bool = False) -> torch.Tensor:
        h = self.first(x)
        return self.second(h + 0 if glue else h)


@pytest.fixture(scope="module")
def onnx_pair_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("pair")


@pytest.fixture(scope="module")
def onnx_pair(onnx_pair_folder):
    """Two real ONNX Runtime sessions and their contracts."""
    from omskills.runtime import open_backend

    folder = onnx_pair_folder
    host, x = TwoGraphs(), torch.randn(4, 16)
    with torch.no_grad():
        first, second = capture_contracts(host, {"first": "first", "second": "second"}, lambda: host(x))
    for contract, module in ((first, host.first), (second, host.second)):
        torch.onnx.export(
            module,
            (x,),
            str(folder / f"{contract.candidate}.onnx"),
            dynamo=False,
            input_names=[contract.inputs[0].name],
            output_names=[contract.outputs[0].name],
        )
    backends = {name: open_backend(folder / f"{name}.onnx", "onnxruntime") for name in ("first", "second")}
    return host, x, (first, second), backends


def _run_pair(onnx_pair, resident: bool, glue: bool = False):
    host, x, (first, second), backends = onnx_pair
    with (
        splice(host, [(first, backends["first"]), (second, backends["second"])], resident=resident) as handle,
        torch.no_grad(),
    ):
        results = []
        for index in range(3):
            results.append(host(x, glue).clone())
            handle.traffic.step_done(index)
    return results, traffic_report(handle.traffic.steps(), _link())


def test_an_output_read_unchanged_by_the_next_graph_is_handed_on_as_the_sessions_own_value(onnx_pair):
    x = onnx_pair[1]
    resident, report = _run_pair(onnx_pair, resident=True)
    host_arrays, plain = _run_pair(onnx_pair, resident=False)
    assert report.resident_copies_per_step == 1.0 and plain.resident_copies_per_step == 0.0
    second = next(g for g in report.per_graph if g.graph == "second")
    assert (second.resident_copies, second.resident_in) == (3, 3 * x.nbytes)
    # Parity unchanged: the same values, bit for bit, with and without the hand-offs.
    for a, b in zip(resident, host_arrays):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(resident[0], x * 3.0 - 1.0)
    # Everything else counted as before: calls, copies and bytes that would cross a link.
    assert (report.calls_per_step, report.copies_per_step, report.bytes_per_step) == (
        plain.calls_per_step,
        plain.copies_per_step,
        plain.bytes_per_step,
    )


def test_an_output_the_host_computed_on_is_given_as_a_host_array(onnx_pair):
    _, report = _run_pair(onnx_pair, resident=True, glue=True)
    assert report.resident_copies_per_step == 0.0 and report.handed_in_per_step == 0.0


def test_the_probe_of_a_tensor_too_long_for_float_indices_stays_inside_it():
    from omskills.splicing.traffic import PROBE_VALUES, _probe

    tensor = torch.zeros(21233664, dtype=torch.uint8)  # a float32 linspace of its indices ends past it
    tensor[-1] = 7
    probe = _probe(tensor)
    assert len(probe) == PROBE_VALUES and probe[-1] == 7 and probe[0] == 0


def test_a_kept_value_is_let_go_once_its_tensor_is_gone_and_the_step_ends(onnx_pair):
    host, x, (first, second), backends = onnx_pair
    with splice(host, [(first, backends["first"])]) as handle, torch.no_grad():
        out = host.first(x)
        assert handle.traffic.resident_value(out) is not None
        del out
        handle.traffic.step_done(0)
    assert handle.traffic._produced == {}


class Recurrent(torch.nn.Module):
    """A step that reads its own previous output, as an optical-flow update or a tracker's state does."""

    def __init__(self):
        super().__init__()
        self.first = Scale()

    def forward(self, x: torch.Tensor, steps: int = 3) -> torch.Tensor:
        for _ in range(steps):
            x = self.first(x)
        return x


def test_a_graph_reading_its_own_previous_output_counts_it_as_a_hand_off_but_proposes_no_merge(onnx_pair):
    host, x, (first, _), backends = onnx_pair
    loop = Recurrent()
    with splice(loop, [(first, backends["first"])]) as handle, torch.no_grad():
        result = loop(x)
        handle.traffic.step_done(0)
    torch.testing.assert_close(result, x * 27.0)
    report = traffic_report(handle.traffic.steps(), _link())
    [graph] = report.per_graph
    assert (
        graph.handed_from == {"first": 2 * x.nbytes}
        and graph.resident_copies == 2
        and graph.resident_in == 2 * x.nbytes
    )
    [merge] = report.merges
    assert not merge.mergeable and merge.upstream is None and "its own earlier outputs" in merge.reason


# --------------------------------------------------------------------------- merged graphs


def test_a_graph_fed_only_by_anothers_unchanged_outputs_runs_inside_its_call_once_merged(
    onnx_pair, onnx_pair_folder, tmp_path
):
    from omskills.convert.compose import compose_chain, composed_prefix
    from omskills.runtime import open_backend

    host, x, (first, second), backends = onnx_pair
    plain, before = _run_pair(onnx_pair, resident=True)
    proposal = next(m for m in before.merges if m.graph == "second")
    assert proposal.mergeable and proposal.upstream == "first"
    assert proposal.io_map == {second.inputs[0].name: first.outputs[0].name}

    prefix = composed_prefix("second")
    outputs = compose_chain(
        [onnx_pair_folder / "first.onnx", onnx_pair_folder / "second.onnx"],
        ["first", "second"],
        [proposal.io_map],
        tmp_path / "first_to_second.onnx",
    )
    assert outputs == [first.outputs[0].name, prefix + second.outputs[0].name]
    composed = open_backend(tmp_path / "first_to_second.onnx", "onnxruntime")
    for glue, answered in ((False, 3), (True, 0)):
        with splice(host, [(first, backends["first"]), (second, backends["second"])]) as handle, torch.no_grad():
            handle.merge(["first", "second"], composed, [proposal.io_map], [prefix])
            results = []
            for index in range(3):
                results.append(host(x, glue).clone())
                handle.traffic.step_done(index)
        after = traffic_report(handle.traffic.steps(), _link())
        stats = {s.candidate: s for s in handle.stats()}
        assert stats["second"].merged_hits == answered and stats["second"].calls == 3
        for a, b in zip(results, plain):  # the same values as the two graphs apart, bit for bit
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        if glue:  # host code between the calls: the second graph runs its own graph, as before
            assert after.calls_per_step == 2.0 and stats["second"].backend_calls == 3
            continue
        # One launch per step instead of two, and the second graph's input never crosses.
        assert (before.calls_per_step, after.calls_per_step) == (2.0, 1.0) and stats["second"].backend_calls == 0
        assert after.bytes_per_step == before.bytes_per_step - x.nbytes
        merged = {m.graph: m for m in after.merges}["second"]
        assert not merged.mergeable and merged.reason == "runs inside first's calls: merged"


def test_mergeable_graphs_link_into_chains_and_a_graph_runs_inside_one_others_calls_at_most():
    from omskills.records.traffic import MergeProposal
    from omskills.stages.merged_graphs import merge_chains

    def proposal(graph, upstream, mergeable=True):
        return MergeProposal(
            graph=graph,
            upstream=upstream,
            mergeable=mergeable,
            reason="",
            io_map={"x": f"{upstream}_out"} if mergeable else {},
        )

    chains, not_taken = merge_chains(
        [
            proposal("a", None, False),
            proposal("b", "a"),
            proposal("c", "b"),
            proposal("d", "c"),
            proposal("e", "b"),
            proposal("g", "f"),
            proposal("q", "p"),
            proposal("p", "q"),
        ]
    )  # p and q: a loop, no first member
    assert [(names, [link.io_map for link in links]) for names, links in chains] == [
        (["a", "b", "c", "d"], [{"x": "a_out"}, {"x": "b_out"}, {"x": "c_out"}]),
        (["f", "g"], [{"x": "f_out"}]),
    ]
    assert not_taken == {"e": "b already runs c inside its calls"}


def test_a_chain_with_a_graph_run_in_batch_chunks_is_not_composed(tmp_path):
    from types import SimpleNamespace

    from omskills.records.toolchain import BatchSplit
    from omskills.records.traffic import MergeProposal
    from omskills.stages.merged_graphs import _composed

    chunked = {
        "b": BatchSplit(max_batch=2, input_axes={"x": 0}, output_axes={"y": 0}, reason="the whole batch does not fit")
    }
    record = SimpleNamespace(batch_split_of=chunked.get)
    link = MergeProposal(graph="b", upstream="a", mergeable=True, reason="", io_map={"x": "y"})
    graph = _composed(record, tmp_path, ["a", "b"], [link], {})
    assert graph.status == "refused" and graph.reason.startswith("b run(s) the batch in chunks on the CPU")
    assert not (tmp_path / "onnx").exists()  # nothing written
