"""Weights of spliced candidates paged out to a file mapping: same values, out of the process's memory."""

from __future__ import annotations

import torch
from omskills.splicing.paged_weights import page_out
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


def test_tensors_sharing_a_storage_still_share_it_whatever_their_dtypes(tmp_path):
    """A complex table and its real view, a slice of a buffer and a tied weight: one storage each
    before and after, the same values, and the model computes the same."""
    module = nn.Module()
    module.freqs = nn.Parameter(torch.polar(torch.ones(6, 4), torch.randn(6, 4)), requires_grad=False)
    module.register_buffer("freqs_real", torch.view_as_real(module.freqs.data))
    module.register_buffer("table", torch.arange(40, dtype=torch.float32))
    module.register_buffer("table_tail", module.table[10:30:2])
    module.first = nn.Linear(3, 3)
    module.second = nn.Linear(3, 3)
    module.second.weight = module.first.weight
    before = {name: value.clone() for name, value in module.state_dict().items()}

    moved = page_out([module], tmp_path)

    after = module.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert module.freqs_real.untyped_storage().data_ptr() == module.freqs.untyped_storage().data_ptr()
    assert module.table_tail.untyped_storage().data_ptr() == module.table.untyped_storage().data_ptr()
    assert module.second.weight is module.first.weight
    assert ".paged-weights-" in _mapping_of(module.freqs.data_ptr())
    assert moved == 6 * 4 * 8 + 40 * 4 + 9 * 4 + 2 * 3 * 4
