"""Stage 2: exportability verdicts, ATC shape strategies, merge suggestions, contract table."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omskills.boundary.analysis import (
    analyze_boundaries,
    analyze_boundary,
    propose_shape_strategy,
    render_contract_table,
    suggest_merges,
)
from omskills.contracts import ProvenanceTracker, capture_contracts
from omskills.errors import OmskillsError
from omskills.records.contracts import ContractSpec, DimRef, QuantityLimit, QuantitySchedule
from torch import nn


class Double(nn.Module):
    """Returns every tensor doubled; any number of tensor inputs."""

    def forward(self, *xs):
        return [x * 2 for x in xs]


class Root(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block


def _contract_for_calls(
    calls: list[tuple], block: nn.Module | None = None, tmp_path: Path | None = None
) -> ContractSpec:
    """Capture the contract of `block` called with each argument tuple in `calls`."""
    root = Root(block or Double())

    def run():
        with torch.no_grad():
            for args in calls:
                root.block(*args)

    (contract,) = capture_contracts(root, {"block": "block"}, run, samples_dir=tmp_path, relative_to=tmp_path)
    return contract


def _shapes(*shapes):
    return tuple(torch.zeros(*s) for s in shapes)


# --------------------------------------------------------------------------- shape strategy rules


def test_one_call_and_no_source_limit_gives_static_and_says_why():
    strategy = propose_shape_strategy(_contract_for_calls([_shapes((2, 8))]))
    assert strategy.kind == "static"
    assert strategy.input_shapes == {"in_0": [2, 8]}
    assert "only one call observed" in strategy.rationale


def test_identical_shapes_across_calls_give_static():
    strategy = propose_shape_strategy(_contract_for_calls([_shapes((2, 8))] * 3))
    assert strategy.kind == "static"
    assert "3 calls observed, no dimension varies" in strategy.rationale


def test_only_dim_0_varying_together_across_inputs_gives_dynamic_batch_size():
    calls = [_shapes((b, 8), (b, 3, 4)) for b in (1, 4, 2)]
    strategy = propose_shape_strategy(_contract_for_calls(calls))
    assert strategy.kind == "dynamic_batch_size"
    assert strategy.gears == [[1], [2], [4]]
    assert strategy.input_shapes == {"in_0": [-1, 8], "in_1": [-1, 3, 4]}
    # every output follows the batch, so a batch that is no gear runs as gear-sized calls
    assert "beyond the largest runs as gear-sized calls" in strategy.rationale


def test_only_h_and_w_of_an_image_varying_gives_dynamic_image_size():
    calls = [_shapes((1, 3, h, w)) for h, w in ((224, 224), (320, 480), (224, 224))]
    strategy = propose_shape_strategy(_contract_for_calls(calls))
    assert strategy.kind == "dynamic_image_size"
    assert strategy.gears == [[224, 224], [320, 480]]
    assert strategy.input_shapes == {"in_0": [1, 3, -1, -1]}


def test_calls_from_several_input_sets_make_every_size_between_their_extremes_a_gear_or_a_range():
    batches = _contract_for_calls([_shapes((b, 8), (b, 3, 4)) for b in (2, 6, 4)])
    batches.input_sets = 3  # the task's inputs and two shape inputs
    strategy = propose_shape_strategy(batches)
    assert strategy.kind == "dynamic_batch_size" and strategy.gears == [[b] for b in range(2, 7)]
    assert "between the sizes the 3 input sets showed" in strategy.rationale and "falls back" not in strategy.rationale
    assert strategy.serves() == "in_0 -1x8; in_1 -1x3x4; batch in {2, 3, 4, 5, 6} (5 gears)"

    images = _contract_for_calls(
        [_shapes((1, 3, h, w), (1, 8, h // 8, w // 8)) for h, w in ((96, 128), (160, 160), (224, 320))]
    )
    images.input_sets = 3
    strategy = propose_shape_strategy(images)
    assert strategy.kind == "dynamic_shape"
    assert strategy.ranges == {
        "in_0": [[1, 1], [3, 3], [96, 224], [128, 320]],
        "in_1": [[1, 1], [8, 8], [12, 28], [16, 40]],
    }
    assert strategy.serves() == "in_0 1x3x[96..224]x[128..320]; in_1 1x8x[12..28]x[16..40]"


def test_a_few_independent_dims_with_discrete_values_give_dynamic_dims_gears():
    calls = [_shapes((2, n), (m, 4)) for n, m in ((3, 1), (5, 1), (5, 2))]
    strategy = propose_shape_strategy(_contract_for_calls(calls))
    assert strategy.kind == "dynamic_dims"
    assert strategy.input_shapes == {"in_0": [2, -1], "in_1": [-1, 4]}
    assert strategy.gears == [[3, 1], [5, 1], [5, 2]]  # combinations seen together, input order


def test_a_declared_source_range_is_matched_to_the_dim_whose_observed_values_lie_in_it():
    calls = [_shapes((2, n, 4)) for n in (2, 3)]
    strategy = propose_shape_strategy(_contract_for_calls(calls), source_limits={"num_objects": [1, 16]})
    assert strategy.kind == "dynamic_dims"
    assert strategy.gears == [[n] for n in range(1, 17)]
    assert "num_objects in [1, 16]" in strategy.rationale


def test_a_dim_bound_to_a_source_quantity_is_dynamic_even_from_a_single_call():
    contract = _contract_for_calls([_shapes((2, 8))])
    limit = QuantityLimit(
        quantity="num_objects", low=1, high=16, evidence="bucket of 16 objects", dims=[DimRef(input="in_0", dim=0)]
    )
    strategy = propose_shape_strategy(contract, source_limits=[limit])
    assert strategy.kind == "dynamic_batch_size"
    assert strategy.gears == [[n] for n in range(1, 17)]
    assert "bucket of 16 objects" in strategy.rationale


def test_more_combinations_than_atc_gears_give_dynamic_shape_with_ranges():
    contract = _contract_for_calls([_shapes((2, 8)), _shapes((3, 8))])
    limit = QuantityLimit(quantity="tokens", low=1, high=1000, dims=[DimRef(input="args[0]", dim=0)])
    strategy = propose_shape_strategy(contract, source_limits=[limit])
    assert strategy.kind == "dynamic_shape"
    assert strategy.ranges == {"in_0": [[1, 1000], [8, 8]]}
    assert "exceed ATC's 100" in strategy.rationale


def test_a_source_limit_contradicted_by_observed_values_or_naming_no_input_is_an_error():
    contract = _contract_for_calls([_shapes((20, 8)), _shapes((3, 8))])
    too_small = QuantityLimit(quantity="num_objects", low=1, high=16, dims=[DimRef(input="in_0", dim=0)])
    with pytest.raises(OmskillsError, match=r"num_objects \[1, 16\] does not hold for in_0\[0\]"):
        propose_shape_strategy(contract, source_limits=[too_small])
    unknown = QuantityLimit(quantity="num_objects", low=1, high=32, dims=[DimRef(input="masks", dim=0)])
    with pytest.raises(OmskillsError, match="no tensor input named 'masks'"):
        propose_shape_strategy(contract, source_limits=[unknown])


def _memory_calls(frames_and_pointers, hw=4, per_pointer=2):
    """SAM 3.1-like memory inputs: memory_image has hw rows per memory frame; memory adds per_pointer
    rows per pointer frame (inputs in_0 = memory_image, in_1 = memory)."""
    return [_shapes((hw * m, 1, 3), (hw * m + per_pointer * p, 1, 3)) for m, p in frames_and_pointers]


def _memory_limits(max_frames=3, max_pointers=5, hw=4, per_pointer=2, schedule=True):
    frames = QuantityLimit(
        quantity="memory_frames",
        low=1,
        high=max_frames,
        dims=[DimRef(input="in_0", dim=0, scale=hw), DimRef(input="in_1", dim=0, scale=hw)],
    )
    pointers = QuantityLimit(
        quantity="pointer_frames", low=1, high=max_pointers, dims=[DimRef(input="in_1", dim=0, scale=per_pointer)]
    )
    rows = [[min(t, max_frames), min(t, max_pointers)] for t in range(1, max(max_frames, max_pointers) + 1)]
    tied = QuantitySchedule(quantities=["memory_frames", "pointer_frames"], rows=rows, evidence="frame t")
    return [frames, pointers] + ([tied] if schedule else [])


def test_a_dim_that_sums_scaled_quantities_gets_one_gear_per_scheduled_joint_value():
    contract = _contract_for_calls(_memory_calls([(1, 1), (2, 2)]))
    strategy = propose_shape_strategy(contract, source_limits=_memory_limits())
    assert strategy.kind == "dynamic_dims"
    assert strategy.input_shapes == {"in_0": [-1, 1, 3], "in_1": [-1, 1, 3]}
    # frame t: min(t, 3) memory frames (4 rows each) and min(t, 5) pointer frames (2 rows each)
    assert strategy.gears == [[4, 6], [8, 12], [12, 18], [12, 20], [12, 22]]
    assert "4 x memory_frames + 2 x pointer_frames" in strategy.rationale and "frame t" in strategy.rationale


def test_without_a_schedule_scaled_quantities_cross_their_ranges():
    contract = _contract_for_calls(_memory_calls([(1, 1), (2, 2)]))
    strategy = propose_shape_strategy(contract, source_limits=_memory_limits(schedule=False))
    assert len(strategy.gears) == 3 * 5
    assert [12, 14] in strategy.gears  # 3 memory frames with 1 pointer frame: allowed by the ranges alone


def test_an_observed_call_outside_the_schedule_is_an_error_naming_its_values():
    contract = _contract_for_calls(_memory_calls([(1, 1), (2, 1)]))  # 2 memory frames, 1 pointer frame
    with pytest.raises(OmskillsError, match=r"in_0\[0\]=8, in_1\[0\]=10 is none of the gears"):
        propose_shape_strategy(contract, source_limits=_memory_limits())


def test_a_quantity_with_a_single_value_leaves_its_dims_static():
    contract = _contract_for_calls([_shapes((1, 8))] * 2)
    one_bucket = QuantityLimit(quantity="num_buckets", low=1, high=1, dims=[DimRef(input="in_0", dim=0)])
    assert propose_shape_strategy(contract, source_limits=[one_bucket]).kind == "static"
    three = QuantityLimit(quantity="num_buckets", low=1, high=3, dims=[DimRef(input="in_0", dim=0)])
    strategy = propose_shape_strategy(contract, source_limits=[three])
    assert (strategy.kind, strategy.gears) == ("dynamic_batch_size", [[1], [2], [3]])


# --------------------------------------------------------------------------- exportability


class Repeat(nn.Module):
    def forward(self, x, times: int):
        return x.repeat(times, 1)


def test_a_non_tensor_argument_with_too_many_values_is_not_exportable_and_is_named():
    contract = _contract_for_calls([(torch.ones(1, 2), n) for n in (1, 2, 3, 4, 5)], block=Repeat())
    decision = analyze_boundary(contract)
    assert not decision.exportable
    assert any("non-tensor argument args[1] changes between calls (1, 2, 3, 4, 5)" in r for r in decision.reasons)
    assert decision.shape_strategy is None


def test_a_non_tensor_argument_with_a_few_values_gives_one_exportable_graph_per_value():
    root = Root(Repeat())

    def run():
        with torch.no_grad():
            for n in (1, 2, 1):
                root.block(torch.ones(1, 2), n)

    contracts = capture_contracts(root, {"block": "block"}, run)
    assert [(c.candidate, c.dispatch.on, c.calls) for c in contracts] == [
        ("block-times_1", {"args[1]": 1}, 2),
        ("block-times_2", {"args[1]": 2}, 1),
    ]
    assert all(analyze_boundary(c).exportable for c in contracts)


def test_a_tensor_only_module_with_constant_arguments_is_exportable_with_the_constants_listed():
    contract = _contract_for_calls([(torch.ones(1, 2), 2)] * 2, block=Repeat())
    decision = analyze_boundary(contract)
    assert decision.exportable
    assert decision.reasons[0].startswith("tensor-only after flattening: 1 tensor inputs, 1 tensor outputs")
    assert "args[1]=2" in decision.reasons[1]
    assert decision.shape_strategy.kind == "static"


class OptionalMask(nn.Module):
    def forward(self, x, mask=None):
        return x if mask is None else x * mask


def test_calls_with_different_structures_are_not_exportable_as_one_graph():
    calls = [(torch.ones(2), None), (torch.ones(2), torch.ones(2))]
    decision = analyze_boundary(_contract_for_calls(calls, block=OptionalMask()))
    assert not decision.exportable
    assert "2 different structures" in decision.reasons[0]


class DataDependentBranch(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # Python branch on tensor data
            return x * 2
        return x - 1


class CountingBranch(nn.Module):
    """Branches on a Python counter: traces fine, but the graph of call 0 is wrong for call 1."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * 2 if self.calls == 1 else x * 3


class Clean(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.lin(x))


def test_trial_export_reports_data_dependent_python_control_flow(tmp_path):
    block = DataDependentBranch()
    contract = _contract_for_calls([(torch.ones(2, 2),), (-torch.ones(2, 2),)], block=block, tmp_path=tmp_path)
    decision = analyze_boundary(contract, module=block, trial_export=True, samples_root=tmp_path)
    assert not decision.exportable
    assert any(r.startswith("trial torch.export failed") for r in decision.reasons)


def test_trial_export_replays_the_graph_on_other_calls_and_catches_a_changed_branch(tmp_path):
    block = CountingBranch()
    contract = _contract_for_calls([(torch.ones(2, 2),), (torch.ones(2, 2),)], block=block, tmp_path=tmp_path)
    decision = analyze_boundary(contract, module=block, trial_export=True, samples_root=tmp_path)
    assert not decision.exportable
    assert any("gives a different out on call 0" in r for r in decision.reasons)


def test_trial_export_of_a_clean_module_with_a_dynamic_batch_reproduces_every_sample(tmp_path):
    block = Clean().eval()
    contract = _contract_for_calls([(torch.randn(b, 4),) for b in (1, 3, 2)], block=block, tmp_path=tmp_path)
    decision = analyze_boundary(contract, module=block, trial_export=True, samples_root=tmp_path)
    assert decision.exportable, decision.reasons
    assert decision.shape_strategy.kind == "dynamic_batch_size"
    assert any("reproduces the outputs of calls [0, 1, 2]" in r for r in decision.reasons)


# --------------------------------------------------------------------------- merges, control plane, table


class Stem(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, img):
        return self.conv(img)


class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        return torch.relu(self.conv(x))


class Fuse(nn.Module):
    def forward(self, feats, img, prompt):
        return feats.mean((1, 2, 3)) + img.mean() + prompt.float().mean()


class Pipeline(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.body, self.fuse = Stem(), Body(), Fuse()

    def forward(self, img, prompt):
        return self.fuse(self.body(self.stem(img)), img, prompt)


def _pipeline_contracts():
    model = Pipeline().eval()
    tracker = ProvenanceTracker()

    def run():
        with torch.no_grad():
            for _ in range(2):
                img = tracker.tag(torch.randn(1, 3, 4, 4), "input", "frames")
                model(img, tracker.tag(torch.tensor([[3, 1]]), "input", "tokenizer"))

    return capture_contracts(model, {"stem": "stem", "body": "body", "fuse": "fuse"}, run, tracker)


def test_adjacent_candidates_that_exchange_tensors_only_with_each_other_are_suggested_for_merging():
    merges = suggest_merges(_pipeline_contracts())
    # fuse also reads the image and the prompt: it stays apart.
    assert merges == {"stem": ["body"], "body": ["stem"]}


def test_control_plane_lists_the_handling_of_user_inputs_with_evidence():
    fuse = _pipeline_contracts()[2]
    plane = analyze_boundary(fuse).control_plane
    assert any(p.startswith("input handling: prompt is made from the user's input by tokenizer") for p in plane)
    assert any(p.startswith("input handling: img is made from the user's input by frames") for p in plane)


def test_contract_table_has_one_row_per_candidate_with_origins_consumers_and_verdict():
    contracts = _pipeline_contracts()
    decisions = analyze_boundaries(contracts)
    assert [d.merge_with for d in decisions] == [["body"], ["stem"], []]
    table = render_contract_table(contracts, decisions)
    lines = table.splitlines()
    assert lines[0].startswith("| candidate | module | calls |")
    assert len(lines) == 2 + len(contracts)
    stem_row = next(line for line in lines if line.startswith("| stem "))
    assert "← input (frames)" in stem_row and "→ body" in stem_row and "| static |" in stem_row
    assert stem_row.endswith("| body |")


def test_a_declared_quantity_is_never_guessed_onto_a_dim_from_a_single_call():
    strategy = propose_shape_strategy(_contract_for_calls([_shapes((2, 8))]), source_limits={"num_objects": [1, 16]})
    assert strategy.kind == "static"
    assert "only one call observed" in strategy.rationale and "bind them with DimRef" in strategy.rationale


class CachedBlock(nn.Module):
    """Reads and fills a cache dict keyed by its own submodule, as whisper's kv-cache hooks do."""

    def __init__(self):
        super().__init__()
        self.key = nn.Linear(4, 4)

    def forward(self, x, cache=None):
        if cache is not None:
            cache[self.key] = torch.cat([cache[self.key], self.key(x)], dim=0) if self.key in cache else self.key(x)
            return cache[self.key].sum(0, keepdim=True)
        return self.key(x)


def test_a_cache_dict_keyed_by_modules_is_one_argument_a_graph_cannot_take():
    cache: dict = {}  # empty on the first call (no leaves), then keyed by the module: one opaque leaf
    contract = _contract_for_calls([(torch.ones(1, 4), cache)] * 3, CachedBlock())
    [arg] = contract.non_tensor_args
    assert arg.tree_path == "args[1]" and arg.holds_tensors and arg.value_repr == "a dict of 1 items"
    decision = analyze_boundary(contract)
    assert not decision.exportable
    assert any("argument args[1] holds tensors inside a Python object" in r for r in decision.reasons), decision.reasons
