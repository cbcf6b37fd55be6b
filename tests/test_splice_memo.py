"""A graph fed from user inputs alone answers a call with inputs it has seen from memory: the
backend runs once per distinct input, the caller gets the same values and may write into them."""

from __future__ import annotations

import numpy as np
import torch
from omskills.contracts import capture_contracts
from omskills.records.contracts import Provenance
from omskills.splicing.splice import splice
from test_splice import TorchBackendDouble
from test_splice_traffic import Pipeline


def _contracts(host, x, encoder_inputs):
    with torch.no_grad():
        enc, dec = capture_contracts(host, {"enc": "enc", "dec": "dec"}, lambda: host(x))
    tagged = [s.model_copy(update={"provenance": Provenance(kind=encoder_inputs)}) for s in enc.inputs]
    return enc.model_copy(update={"inputs": tagged}), dec


def test_a_graph_fed_from_user_inputs_runs_once_per_distinct_input():
    host, x = Pipeline(), torch.randn(2, 3)
    enc, dec = _contracts(host, x, "input")
    double = TorchBackendDouble(host.enc, enc)
    with splice(host, [(enc, double)]) as handle, torch.no_grad():
        first = host.enc(x)
        first.add_(100)  # the caller writes into what it got: the memory must not change
        again = host.enc(x.clone())
        other = host.enc(x + 1)
    torch.testing.assert_close(again, x * 2 + 1)
    torch.testing.assert_close(other, (x + 1) * 2 + 1)
    [stats] = handle.stats()
    assert (stats.calls, stats.backend_calls, stats.memo_hits) == (3, 2, 1) and len(double.feeds) == 2
    assert [g.calls for s in handle.traffic.steps() for g in s.graphs] == [2]  # a call from memory moves nothing


def test_a_graph_fed_from_another_modules_output_always_runs():
    host, x = Pipeline(), torch.randn(2, 3)
    enc, dec = _contracts(host, x, "module_output")
    double = TorchBackendDouble(host.enc, enc)
    with splice(host, [(enc, double)]) as handle, torch.no_grad():
        host.enc(x)
        host.enc(x)
    [stats] = handle.stats()
    assert (stats.backend_calls, stats.memo_hits) == (2, 0)


def test_outputs_computed_ahead_survive_a_save_and_stay_however_many_calls_follow(tmp_path):
    from omskills.splicing.memo import ENTRIES, OutputMemo, load_entries, save_entries

    computed = OutputMemo()
    feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
    key = computed.key(feeds)
    computed.put(key, {"y": feeds["x"] * 2, "n": np.array(3)})
    saved = save_entries(tmp_path / "memo" / "enc.npz", computed.entries())
    deployed = OutputMemo()
    deployed.preload(load_entries(saved))
    for k in range(ENTRIES + 2):  # more distinct calls than the memory keeps
        other = {"x": np.full((2, 3), k, np.float32)}
        deployed.put(deployed.key(other), {"y": other["x"]})
    got = deployed.get(key)
    np.testing.assert_array_equal(got["y"], feeds["x"] * 2)
    assert got["n"] == 3 and deployed.hits == 1
