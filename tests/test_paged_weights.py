"""Weights of spliced candidates paged out to a file mapping: same values, out of the process's memory."""

from __future__ import annotations

import torch
from omskills.runtime.paged_weights import page_out
from torch import nn


def _mapping_of(address: int) -> str:
    """The /proc/self/maps line whose range holds `address`."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span = line.split()[0]
            start, end = (int(x, 16) for x in span.split("-"))
            if start <= address < end:
                return line.strip()
    return ""


def test_paged_out_weights_compute_the_same_and_live_in_a_file_mapping(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 8)).eval()
    x = torch.randn(5, 64)
    with torch.no_grad():
        before = model(x)
        # The outer module and one inside it: each weight is written once.
        moved = page_out([model, model[0]], tmp_path)
        after = model(x)

    assert torch.equal(before, after)
    expected = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert moved == expected
    weight = model[3].weight
    assert isinstance(weight, nn.Parameter) and weight.requires_grad
    for tensor in (model[0].weight, model[1].running_mean, weight):
        assert ".paged-weights-" in _mapping_of(tensor.data_ptr())
    assert not list(tmp_path.iterdir())  # the file's name is gone; the mapping keeps its data


def test_nothing_to_page_out_writes_nothing(tmp_path):
    assert page_out([nn.ReLU()], tmp_path) == 0 and not list(tmp_path.iterdir())
