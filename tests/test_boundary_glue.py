"""The host code between two deployed graphs (a hop's glue): captured from a spliced run, classified,
costed, exported as a graph of its own and composed with its two graphs, whose one call then answers
both (`boundary.glue`, `boundary.hops`, `boundary.glue_graph`, `splicing.deferred_chain`).

The first test is the whole thing as a user runs it: `omskills adapt` of a two-function driver whose
encoder and decoder are joined by a reshape, a scale and a concatenation with a constant.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import omskills
from omskills.contracts import capture_contracts
from omskills.records.traffic import LinkCost
from omskills.splicing.splice import splice

GLUED_DRIVER = """\
import torch

STEP_NAME = "frame"
SEED_CANDIDATES = [("encoder", "encoder"), ("decoder", "decoder")]


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 32)

    def forward(self, x):
        return torch.tanh(self.proj(x))


class Decoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 4)

    def forward(self, tokens):
        return self.proj(tokens).relu()


class Pipeline(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder, self.decoder = Encoder(), Decoder()
        self.register_buffer("start", torch.full((1, 8), 0.25))

    def forward(self, x):
        features = self.encoder(x)
        tokens = torch.cat([self.start, features.reshape(-1, 8) * 0.5], dim=0)  # the glue
        return self.decoder(tokens)


def build_model(spec):
    return Pipeline()


def run_main_path(model, inputs):
    for frame in range(3):
        x = torch.linspace(-1, 1, 64).reshape(4, 16) * (frame + 1)
        yield {"scores": model(x)}
"""


@pytest.fixture(scope="module")
def adapted(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("glued")
    (folder / "glued_driver.py").write_text(GLUED_DRIVER)
    (folder / "task.yaml").write_text("id: glued\nintake:\n  model:\n    driver: glued_driver.py\n  inputs: {}\n")
    result = omskills("adapt", str(folder / "task.yaml"), "--out", str(folder / "run"))
    assert result.returncode == 0, result.stderr[-3000:]
    return folder / "run"


def test_two_graphs_joined_by_tensor_only_glue_end_as_one_composed_graph_and_one_call_per_step(adapted):
    report = json.loads((adapted / "verify" / "report.json").read_text())
    [hop] = report["glue"]["hops"]
    assert (hop["producer"], hop["consumer"], hop["kind"], hop["decision"]) == (
        "encoder",
        "decoder",
        "tensor-only",
        "widened",
    )
    assert hop["ops"] == ["reshape", "mul", "cat"] and hop["glue_onnx"] == "onnx/merged/encoder_glue_decoder.onnx"
    assert hop["cost"]["link_saved_ms_per_step"] > hop["cost"]["device_ms_per_step"]
    [graph] = report["merged"]["graphs"]
    assert (graph["name"], graph["status"], report["merged"]["verdict"], report["merged"]["fallbacks"]) == (
        "encoder_to_decoder",
        "verified",
        "pass",
        0,
    )
    assert report["merged"]["checks"].startswith("scores (tensor) worst ")  # judged by the same checks
    assert report["traffic"]["calls_per_step"] == 2.0 and report["merged"]["traffic"]["calls_per_step"] == 1.0
    # Neither the encoder's output nor the decoder's input crosses: only x in and the scores out.
    assert report["merged"]["traffic"]["bytes_per_step"] == (4 * 16 + 17 * 4) * 4
    assert (adapted / graph["atc_script"]).is_file()
    delivery = (adapted / "DELIVERY.md").read_text()
    assert "| encoder → decoder | reshape, mul, cat | tensor-only |" in delivery
    assert "**widened**" in delivery


def test_a_bundle_serves_the_widened_chain_in_one_call(adapted, tmp_path):
    from omskills.deploy.adapted import load_adapted
    from omskills.deploy.bundle import write_bundle
    from omskills.deploy.manifest import read_bundle

    bundle = write_bundle(adapted / "task.yaml", tmp_path / "bundle")
    [merged] = read_bundle(Path(bundle.path)).merged
    assert merged.graphs == ["encoder", "decoder"] and merged.recipes[0]
    with load_adapted(Path(bundle.path), backend="onnxruntime", strict=True) as model:
        model.run_main_path()
        stats = {s.candidate: s for s in model.stats()}
    assert stats["decoder"].merged_hits == stats["decoder"].calls == 3 and stats["decoder"].backend_calls == 0
    assert stats["encoder"].backend_calls == 3  # each a call of the composed graph


# --------------------------------------------------------------------------- the capture, by kind of glue


class Enc(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Dec(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(h).relu()


class Host(torch.nn.Module):
    """Two graphs and, between them, glue of the kind a test picks."""

    def __init__(self):
        super().__init__()
        self.enc, self.dec = Enc(), Dec()
        self.register_buffer("extra", torch.ones(1, 8))
        self.kind, self.step, self.earlier = "tensor-only", 0, torch.zeros(1, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enc(x).reshape(-1, 8)
        if self.kind == "data-dependent" and h.sum().item() > 1e9:  # a branch on a value
            h = h * 2
        if self.kind == "varies-per-call":
            h = h * (self.step + 1)  # a Python number that changes with the step
        if self.kind == "earlier-value":
            h = h + self.earlier  # a value the host made before the encoder's call
        if self.kind == "first-call-differs" and self.step == 0:
            h = h + 0.0  # one more operation in the first call only
        if self.kind == "read-before":
            self.peeked = float(h[0, 0])  # the host reads the glue's result before the decoder's call
        return self.dec(torch.cat([h * 0.5, self.extra], 0))


def _link() -> LinkCost:
    return LinkCost(soc="Ascend910B4", bandwidth_gb_s=31.5, round_trip_us=9.5, source="test")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from omskills.runtime import open_backend

    folder = tmp_path_factory.mktemp("pair")
    torch.manual_seed(0)
    host, x = Host().eval(), torch.randn(4, 16)
    with torch.no_grad():
        enc, dec = capture_contracts(host, {"enc": "enc", "dec": "dec"}, lambda: host(x))
    for contract, module, example in ((enc, host.enc, x), (dec, host.dec, torch.randn(17, 8))):
        torch.onnx.export(
            module,
            (example,),
            str(folder / f"{contract.candidate}.onnx"),
            dynamo=False,
            input_names=[contract.inputs[0].name],
            output_names=[contract.outputs[0].name],
        )
    backends = {name: open_backend(folder / f"{name}.onnx", "onnxruntime") for name in ("enc", "dec")}
    return folder, host, x, (enc, dec), backends


def _run(pair, kind: str, recorder=None, merge=None):
    _, host, x, (enc, dec), backends = pair
    host.kind = kind
    with splice(host, [(enc, backends["enc"]), (dec, backends["dec"])]) as handle, torch.no_grad():
        handle.traffic.observer = recorder
        if merge is not None:
            merge(handle)
        results = []
        for index in range(3):
            host.step, host.earlier = index, torch.full((1, 8), float(index))
            if recorder is not None:
                with recorder:
                    results.append(host(x).clone())
            else:
                results.append(host(x).clone())
            handle.traffic.step_done(index)
    return results, handle


def _hop(pair, kind: str):
    from omskills.boundary.glue import GlueRecorder
    from omskills.boundary.hops import hops

    recorder = GlueRecorder()
    _run(pair, kind, recorder)
    [hop] = hops(recorder, _link())
    return hop


@pytest.mark.parametrize(
    ("kind", "expected", "why"),
    [
        ("tensor-only", "tensor-only", "torch operations on enc's outputs, the same in every call (reshape, mul, cat)"),
        ("data-dependent", "data-dependent", "host code reads enc's outputs into Python before the call: item at"),
        ("varies-per-call", "varies-per-call", "the host code differs between calls (3 calls, no two alike"),
        ("earlier-value", "tensor-only", "torch operations on enc's outputs, the same in every call"),
        ("first-call-differs", "tensor-only", "torch operations on enc's outputs, the same in 2 of 3 calls"),
    ],
)
def test_the_capture_says_whether_the_glue_can_go_into_a_graph_and_why(pair, kind, expected, why):
    hop = _hop(pair, kind)
    assert (hop.glue.producer, hop.glue.consumer, hop.glue.kind) == ("enc", "dec", expected)
    assert hop.glue.why.startswith(why), hop.glue.why
    assert (hop.program is not None) == (expected == "tensor-only")
    if kind == "earlier-value":  # the host's tensor is fed to the widened graph; the buffer is a constant
        assert [(s.shape, s.constant) for s in hop.glue.slots] == [([1, 8], False), ([1, 8], True)]


def _widened(pair, kind: str, tmp_path: Path):
    """The hop's glue exported and composed between the two graphs, served by one deferred call."""
    from omskills.boundary.glue_graph import export_glue
    from omskills.convert.compose import compose_chain, composed_prefix
    from omskills.records.glue import glue_name
    from omskills.runtime import open_backend

    folder, _, _, (enc, dec), _ = pair
    hop = _hop(pair, kind)
    glue = glue_name("enc", "dec")
    reads = export_glue(hop.program, [s.constant for s in hop.glue.slots], [dec.inputs[0].name], tmp_path / "g.onnx")
    fed = [r for r in reads if r.startswith("slot_")]
    compose_chain(
        [folder / "enc.onnx", tmp_path / "g.onnx", folder / "dec.onnx"],
        ["enc", glue, "dec"],
        [{r: r.removeprefix("from_") for r in reads if r not in fed}, {dec.inputs[0].name: dec.inputs[0].name}],
        tmp_path / "composed.onnx",
        internal=[glue],
        free=[set(fed), set()],
    )
    composed = open_backend(tmp_path / "composed.onnx", "onnxruntime")

    def merge(handle):
        handle.merge(["enc", "dec"], composed, [{}], [composed_prefix("dec")], [hop.glue.recipes], [hop.glue.slots])

    return merge


@pytest.mark.parametrize("kind", ["tensor-only", "earlier-value"])
def test_a_widened_hop_is_one_call_per_step_with_the_same_values(pair, kind, tmp_path):
    apart, before = _run(pair, kind)
    merged, after = _run(pair, kind, merge=_widened(pair, kind, tmp_path))
    stats = {s.candidate: s for s in after.stats()}
    # Each step: one launch, the composed graph's, counted as the encoder's; the decoder answered inside it.
    assert (stats["dec"].merged_hits, stats["dec"].backend_calls, stats["enc"].backend_calls) == (3, 0, 3)
    for a, b in zip(merged, apart):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    calls = [sum(g.calls for g in step.graphs) for step in after.traffic.steps()]
    assert calls == [1, 1, 1]


def test_calls_whose_host_code_is_not_the_commonest_run_apart_and_the_others_in_one_call(pair, tmp_path):
    apart, _ = _run(pair, "first-call-differs")
    merged, handle = _run(pair, "first-call-differs", merge=_widened(pair, "first-call-differs", tmp_path))
    stats = {s.candidate: s for s in handle.stats()}
    assert (stats["dec"].merged_hits, stats["dec"].backend_calls) == (2, 1)
    for a, b in zip(merged, apart):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_value_the_host_reads_before_the_consumers_call_runs_the_graphs_apart_with_the_same_values(pair, tmp_path):
    merge = _widened(pair, "tensor-only", tmp_path)
    apart, _ = _run(pair, "read-before")
    merged, handle = _run(pair, "read-before", merge=merge)
    stats = {s.candidate: s for s in handle.stats()}
    assert stats["dec"].merged_hits == 0 and (stats["enc"].backend_calls, stats["dec"].backend_calls) == (3, 3)
    for a, b in zip(merged, apart):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_host_code_that_differs_from_the_capture_runs_the_consumers_own_graph(pair, tmp_path):
    merge = _widened(pair, "tensor-only", tmp_path)
    apart, _ = _run(pair, "varies-per-call")
    merged, handle = _run(pair, "varies-per-call", merge=merge)
    stats = {s.candidate: s for s in handle.stats()}
    assert stats["dec"].merged_hits == 0 and stats["dec"].backend_calls == 3
    for a, b in zip(merged, apart):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_deferred_write_in_place_is_seen_by_every_holder_of_the_value():
    import numpy as np
    from omskills.splicing.unfetched import Deferred, GlueWindow, Unfetched

    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    output = Unfetched((3, 4), torch.float32, torch.device("cpu"), lambda: values, lambda _t: None)
    GlueWindow("g").add_root(output, "out")
    scores = output.transpose(0, 1)
    scores *= 2.0
    scores[0] = -1.0
    assert isinstance(scores, Deferred) and not output.fetched
    expected = torch.from_numpy(values).transpose(0, 1) * 2.0
    expected[0] = -1.0
    torch.testing.assert_close(scores + 0, expected)


def test_a_recipe_thousands_of_operations_deep_has_a_digest():
    from omskills.boundary.glue import GlueRecorder

    recorder = GlueRecorder()
    out = torch.ones(4)
    recorder.graph_call("a", {}, {"out": out})
    with recorder:
        h = out
        for _ in range(3000):
            h = h + 1.0
    recorder.graph_call("b", {"h": h}, {})
    assert recorder.error is None and recorder.observations[-1].glued == ["h"]


def test_a_scalar_has_a_value_digest():
    from omskills.contracts.recipes import value_digest

    assert value_digest(torch.tensor(0.5)) == value_digest(torch.tensor(0.5)) != value_digest(torch.tensor(0.25))
