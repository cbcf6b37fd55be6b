"""What an `omskills fleet` task asks Ray for before any run of it measured anything: the figure its
driver declares, else its model built in a fresh process and measured, with a margin (no Ray here).
`tests/test_fleet.py` checks the same on a real fleet run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from omskills.orchestrator.fleet_memory import (
    ESTIMATE_MARGIN,
    GB,
    MEASURED_MARGIN,
    SCALE_MEMORY_GB,
    driver_request,
    measured_request,
)
from test_drivers import TOY_DRIVER

MORE = """

class WideToyNet(ToyNet):
    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(4096, 4096)  # weights the toy does not have


class WideToyDriver(ToyDriver):
    family = "toy-wide"

    def load(self, spec):
        net = WideToyNet().eval()
        return LoadedModel(entry=net, root=net, source_root=self.source_root(spec), weights="random")


class DeclaringDriver(ToyDriver):
    family = "toy-declaring"
    adaptation_memory_gb = {"tiny": 7.5}


class BrokenDriver(ToyDriver):
    family = "toy-broken"

    def load(self, spec):
        from omskills.errors import InputError

        raise InputError("checkpoint: /nonexistent/toy.pt does not exist")
"""


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("records")
    (folder / "toy.py").write_text(TOY_DRIVER + MORE)
    made = {}
    for name in ("ToyDriver", "WideToyDriver", "DeclaringDriver", "BrokenDriver"):
        path = folder / f"{name}.yaml"
        model = {"driver": f"toy.py:{name}", "scale": "tiny"}
        path.write_text(yaml.safe_dump({"id": name.lower(), "intake": {"model": model, "inputs": {"batch": 4}}}))
        made[name] = path
    return made


def test_a_model_is_measured_in_a_fresh_process_and_the_request_follows_its_estimate(records):
    toy, wide = driver_request(records["ToyDriver"], None), driver_request(records["WideToyDriver"], None)
    for request in (toy, wide):
        assert request.estimate is not None and request.estimate.scale == "tiny"
        assert request.gb == round(request.estimate.need_bytes * ESTIMATE_MARGIN / GB, 2)
        assert f"{request.estimate.need_bytes / GB:.2f} GB predicted at scale tiny (client " in request.why
    extra = 4096 * 4096 * 4 + 4096 * 4  # the wide model's extra Linear in float32: weight and bias
    assert wide.estimate.weights_bytes - toy.estimate.weights_bytes == extra
    # The server holds the weights (its peak grew by them past the client's imports), and ONNX
    # Runtime's sessions hold them again: the wider model asks for more.
    assert wide.estimate.loaded_bytes - wide.estimate.imports_bytes >= wide.estimate.weights_bytes
    assert wide.estimate.sessions_bytes - toy.estimate.sessions_bytes >= extra
    assert wide.gb > toy.gb


def test_a_figure_the_driver_declares_is_asked_for_without_building_the_model(records):
    request = driver_request(records["DeclaringDriver"], None)
    assert (request.gb, request.estimate) == (7.5, None)
    assert request.why == "the toy-declaring driver's estimate for scale tiny"


def test_a_model_that_fails_to_build_gets_the_scales_default_saying_why(records):
    request = driver_request(records["BrokenDriver"], None)
    assert request.gb == SCALE_MEMORY_GB["tiny"] and request.estimate is None
    assert request.why.startswith("default for scale tiny (no estimate: ")
    assert "checkpoint: /nonexistent/toy.pt does not exist" in request.why


def test_a_run_folders_measured_peak_counts_once_an_attempt_finished(tmp_path):
    fleet = tmp_path / "fleet"
    fleet.mkdir()
    # An attempt that stopped at a bad input measured only the start of a run.
    (fleet / "peak-1.json").write_text(json.dumps({"peak_tree_gb": 0.8, "exit_code": 2}))
    assert measured_request(tmp_path) is None
    assert measured_request(tmp_path, 4.0).why == "--memory-gb"
    (fleet / "peak-2.json").write_text(json.dumps({"peak_tree_gb": 2.0, "exit_code": 0}))
    request = measured_request(tmp_path, 4.0)
    assert request.gb == round(2.0 * MEASURED_MARGIN, 2) and request.why == "measured peak 2.00 GB of a previous run"
