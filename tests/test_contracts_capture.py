"""Stage 2: capturing candidate contracts on a toy main path (pytree, provenance, samples, errors)."""

from __future__ import annotations

import dataclasses
import re
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch
from omskills.contracts import ProvenanceTracker, capture_contracts, load_sample, pytree
from omskills.contracts.samples import save_sample
from omskills.errors import OmskillsError
from torch import nn

ONNX_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


# --------------------------------------------------------------------------- structures SAM-like code passes


@dataclasses.dataclass
class Features:
    maps: list
    pos: torch.Tensor
    level: int = 0


@dataclasses.dataclass(frozen=True)
class FrozenBox:
    xyxy: torch.Tensor
    label: str


class NestedTensor:
    """Same shape as SAM 3.1's sam3.model.data_misc.NestedTensor: a plain class with tensors + mask."""

    def __init__(self, tensors, mask):
        self.tensors = tensors
        self.mask = mask


Pair = namedtuple("Pair", "left right")


def _same_structure(a, b) -> bool:
    flat_a, flat_b = pytree.flatten(a), pytree.flatten(b)
    if flat_a.spec != flat_b.spec or flat_a.paths != flat_b.paths:
        return False
    for x, y in zip(flat_a.leaves, flat_b.leaves):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor) and not torch.equal(x, y):
            return False
        if not isinstance(x, torch.Tensor) and x != y:
            return False
    return True


def test_nested_dict_list_dataclass_nestedtensor_round_trip_through_a_serialised_spec():
    tree = {
        "feats": Features([torch.randn(1, 4, 8, 8), torch.randn(1, 4, 4, 4)], torch.randn(1, 4), level=2),
        "nested": NestedTensor(torch.randn(1, 4, 8, 8), None),
        "box": FrozenBox(torch.tensor([0.0, 0.0, 1.0, 1.0]), "dog"),
        "pair": Pair(torch.ones(2), 3.5),
        "flags": [True, None, "bilinear"],
    }
    pytree.register_struct(NestedTensor)  # a driver names such containers (ModelDriver.pytree_types)
    flat = pytree.flatten(tree)

    spec = pytree.spec_from_str(pytree.spec_to_str(flat.spec))
    rebuilt = pytree.unflatten(flat.leaves, spec)

    assert _same_structure(rebuilt, tree)
    assert isinstance(rebuilt["feats"], Features) and rebuilt["feats"].level == 2
    assert isinstance(rebuilt["nested"], NestedTensor) and rebuilt["nested"].mask is None
    assert rebuilt["box"].label == "dog"
    assert isinstance(rebuilt["pair"], Pair)
    assert "out['feats'].maps[1]" in flat.paths
    assert "out['nested'].tensors" in flat.paths
    assert len(flat.tensors()) == 6  # 2 maps, pos, nested.tensors, box.xyxy, pair.left
    assert pytree.leaf_paths(spec, root="out") == flat.paths


def test_call_paths_name_args_and_kwargs_and_rebuild_the_call():
    args = ([torch.zeros(2), torch.ones(3)], 7)
    kwargs = {"mask": torch.ones(2, dtype=torch.bool), "mode": "nearest"}
    flat = pytree.flatten_call(args, kwargs)

    assert flat.paths == ["args[0][0]", "args[0][1]", "args[1]", "kwargs['mask']", "kwargs['mode']"]
    spec = pytree.spec_from_str(pytree.spec_to_str(flat.spec))
    rebuilt_args, rebuilt_kwargs = pytree.unflatten_call(flat.leaves, spec)
    assert rebuilt_args[1] == 7 and rebuilt_kwargs["mode"] == "nearest"
    assert torch.equal(rebuilt_args[0][1], args[0][1])


def test_leaf_names_are_readable_unique_onnx_names_derived_from_parameters_and_paths():
    paths = ["args[0][0]", "args[0][1]", "args[1]['a b']", "args[4]", "kwargs['mask']", "kwargs['mask_']"]
    inputs = pytree.input_names(paths, ["img_feats", "extra"])
    assert inputs[:2] == ["img_feats_0", "img_feats_1"]
    assert inputs[2] == "extra_a_b"
    assert inputs[3] == "in_4"  # no parameter name known for position 4
    assert len(set(inputs)) == len(inputs) and all(ONNX_NAME.match(n) for n in inputs)

    outputs = pytree.output_names(["out", "out[0]", "out['mask']"], taken=set(inputs))
    assert outputs == ["out", "out_0", "out_mask"]  # "mask" is an input name already
    assert all(ONNX_NAME.match(n) for n in outputs)


# --------------------------------------------------------------------------- a toy main path


class Tokenizer:
    """Python-side tokenizer (like SAM's): not a module, returns a tensor."""

    def __call__(self, text: str) -> torch.Tensor:
        return torch.tensor([[len(word) for word in text.split()]], dtype=torch.int64)


class TextEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 4)

    def forward(self, tokens):
        return self.embed(tokens).mean(1)


class Trunk(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, img):
        return self.conv(img)


class VisionBackbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = Trunk()
        self.pos = nn.Parameter(torch.randn(1, 4))

    def forward(self, img):
        x = self.trunk(img)
        return {"feats": Features([x, x[:, :, ::2, ::2]], self.pos.expand(img.shape[0], 4))}


class Backbone(nn.Module):
    """Wraps the vision backbone: its output is also the wrapper's output (a nested producer)."""

    def __init__(self):
        super().__init__()
        self.vision = VisionBackbone()

    def forward(self, img):
        return self.vision(img)


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.query = nn.Parameter(torch.randn(5, 4))
        self.proj = nn.Linear(4, 4)

    def forward(self, feats: Features, text, queries, num_objects: int, memory=None):
        pooled = feats.maps[0].mean((2, 3)) + text
        scores = self.proj(queries) @ pooled.T
        masks = scores[:num_objects].unsqueeze(-1).expand(num_objects, scores.shape[1], 3)
        if memory is not None:
            masks = masks + memory.mean()
        return masks, {"scores": scores, "count": num_objects}


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = Backbone()
        self.text = TextEncoder()
        self.head = Head()
        self.tokenizer = Tokenizer()

    def forward(self, img, prompt: str, num_objects: int, memory):
        feats = self.backbone(img)["feats"]
        text = self.text(self.tokenizer(prompt))
        return self.head(feats, text, self.head.query, num_objects, memory=memory)


class Driver:
    """A toy model-family driver: loads frames, tags what it creates, keeps a session state."""

    def __init__(self, model: Model, tracker: ProvenanceTracker, objects_per_frame=(1, 2, 3), sizes=(8, 8, 8)):
        self.model, self.tracker = model, tracker
        self.objects_per_frame, self.sizes = objects_per_frame, sizes
        self.frames_done = 0

    def run(self):
        torch.manual_seed(0)
        memory = self.tracker.tag(torch.zeros(2, 2), "session", "session.memory_bank")
        with self.tracker.wrap_callable(self.model, "tokenizer", "input", "tokenizer"), torch.no_grad():
            for num_objects, size in zip(self.objects_per_frame, self.sizes):
                frame = self.tracker.tag(torch.randn(1, 3, size, size), "input", "video frames")
                masks, _ = self.model(frame, "a small dog", num_objects, memory)
                memory = self.tracker.tag(masks.detach()[:1, :2, :2].clone(), "session", "session.memory_bank")
                self.frames_done += 1


CANDIDATES = {"vision": "backbone.vision", "text": "text", "head": "head"}


def _capture(tmp_path: Path, candidates=CANDIDATES, **driver_kwargs):
    model = Model().eval()
    tracker = ProvenanceTracker()
    driver = Driver(model, tracker, **driver_kwargs)
    contracts = capture_contracts(
        model,
        candidates,
        driver.run,
        tracker,
        samples_dir=tmp_path / "samples",
        max_samples=2,
        frame_counter=lambda: driver.frames_done,
        relative_to=tmp_path,
    )
    return model, {c.candidate: c for c in contracts}


def test_contract_records_structure_names_replacement_point_and_calls(tmp_path):
    _, contracts = _capture(tmp_path)
    vision = contracts["vision"]

    assert (vision.parent_path, vision.attribute, vision.method) == ("backbone", "vision", "forward")
    assert vision.module_class.endswith("VisionBackbone")
    assert vision.calls == 3 and vision.calls_per_frame == 1.0
    assert [s.name for s in vision.inputs] == ["img"]
    assert [s.tree_path for s in vision.outputs] == ["out['feats'].maps[0]", "out['feats'].maps[1]", "out['feats'].pos"]
    assert [s.name for s in vision.outputs] == ["feats_maps_0", "feats_maps_1", "feats_pos"]
    assert vision.non_tensor_outputs[0].tree_path == "out['feats'].level"
    assert vision.non_tensor_outputs[0].constant and vision.non_tensor_outputs[0].value == 0
    assert pytree.spec_from_str(vision.out_spec).num_leaves == 4

    head = contracts["head-num_objects_1"]  # one graph per value of num_objects (1, 2, 3)
    assert [s.name for s in head.inputs] == ["feats_maps_0", "feats_maps_1", "feats_pos", "text", "queries", "memory"]
    assert all(ONNX_NAME.match(s.name) for s in head.inputs + head.outputs)
    assert len({s.name for s in head.inputs + head.outputs}) == len(head.inputs) + len(head.outputs)


def test_dims_that_vary_across_calls_are_dynamic_with_observed_values(tmp_path):
    _, contracts = _capture(tmp_path, sizes=(8, 16, 12))
    image = contracts["vision"].inputs[0]

    assert image.dynamic_dims == {"2": [8, 12, 16], "3": [8, 12, 16]}
    assert image.shape == [1, 3, 8, 8]  # the first call's
    assert [shape.inputs[0][-1] for shape in contracts["vision"].call_shapes] == [8, 16, 12]


def test_a_python_int_that_changes_per_call_gets_one_graph_per_value(tmp_path):
    _, contracts = _capture(tmp_path, objects_per_frame=(1, 3, 1))
    graphs = {name: c for name, c in contracts.items() if c.plan_candidate == "head"}

    assert sorted(graphs) == ["head-num_objects_1", "head-num_objects_3"]
    for value, graph in ((1, graphs["head-num_objects_1"]), (3, graphs["head-num_objects_3"])):
        assert graph.dispatch.on == {"args[3]": value} and graph.dispatch.candidate == "head"
        num_objects = next(a for a in graph.non_tensor_args if a.tree_path == "args[3]")
        assert num_objects.constant and num_objects.value == value
        assert graph.outputs[0].shape[0] == value  # the masks of that many objects
        assert graph.samples and all(Path(tmp_path / s).name.startswith(graph.candidate) for s in graph.samples)
    assert graphs["head-num_objects_1"].calls == 2 and graphs["head-num_objects_3"].calls == 1


def test_an_argument_with_too_many_values_to_dispatch_stays_varying_with_its_path(tmp_path):
    from omskills.contracts.capture import MAX_DISPATCH_VALUES

    counts = tuple(range(1, MAX_DISPATCH_VALUES + 2))
    _, contracts = _capture(tmp_path, objects_per_frame=counts, sizes=(8,) * len(counts))
    num_objects = next(a for a in contracts["head"].non_tensor_args if a.tree_path == "args[3]")

    assert contracts["head"].dispatch is None and not num_objects.constant
    assert num_objects.value_repr == ", ".join(map(str, counts))
    count = next(a for a in contracts["head"].non_tensor_outputs if a.tree_path == "out[1]['count']")
    assert not count.constant


def test_provenance_names_inputs_session_parameter_and_producing_candidate(tmp_path):
    _, contracts = _capture(tmp_path, objects_per_frame=(2, 2, 2))

    vision_in = contracts["vision"].inputs[0].provenance
    assert (vision_in.kind, vision_in.source) == ("input", "video frames")
    text_in = contracts["text"].inputs[0].provenance
    assert (text_in.kind, text_in.source) == ("input", "tokenizer")

    head = {s.name: s.provenance for s in contracts["head"].inputs}
    # The outer wrapper `backbone` returns the same tensors; the candidate is the useful answer.
    assert (head["feats_maps_0"].kind, head["feats_maps_0"].source) == ("module_output", "backbone.vision")
    assert (head["text"].kind, head["text"].source) == ("module_output", "text")
    assert (head["queries"].kind, head["queries"].source) == ("parameter", "head.query")
    assert (head["memory"].kind, head["memory"].source) == ("session", "session.memory_bank")


def test_producer_without_candidate_preference_is_the_outermost_non_ancestor():
    model = Model().eval()
    tracker = ProvenanceTracker()
    seen = {}

    def remember(module, args, kwargs):
        seen["feats"] = tracker.origin(args[0].maps[0], consumer="head")

    hook = model.head.register_forward_pre_hook(remember, with_kwargs=True)
    with tracker.attached(model), torch.no_grad():
        model(torch.randn(1, 3, 8, 8), "dog", 1, None)
    hook.remove()

    # trunk -> vision -> backbone all returned it; with no candidate preference, the outermost wins.
    assert seen["feats"].source == "backbone"


def test_outputs_list_the_modules_that_consume_them(tmp_path):
    _, contracts = _capture(tmp_path, objects_per_frame=(2, 2, 2))
    vision_out = {s.name: s.consumers for s in contracts["vision"].outputs}
    assert vision_out["feats_maps_0"] == ["head"]
    assert contracts["text"].outputs[0].consumers == ["head"]
    assert contracts["head"].outputs[0].consumers == []  # read by Python (the driver), no module


def test_samples_reload_bit_exactly_and_prefer_distinct_shapes(tmp_path):
    model, contracts = _capture(tmp_path, sizes=(8, 8, 12))
    vision = contracts["vision"]

    assert len(vision.samples) == 2
    samples = [load_sample(tmp_path / path) for path in vision.samples]
    # 3 calls, room for 2: the 12x12 call replaces a second 8x8 one.
    assert sorted(s.inputs["img"].shape[-1] for s in samples) == [8, 12]
    for sample in samples:
        assert list(sample.inputs) == ["img"]
        assert list(sample.outputs) == ["feats_maps_0", "feats_maps_1", "feats_pos"]
        with torch.no_grad():
            again = model.backbone.vision(sample.inputs["img"])["feats"]
        assert torch.equal(again.maps[0], sample.outputs["feats_maps_0"])
    with np.load(tmp_path / vision.samples[0], allow_pickle=False) as raw:
        assert {"in:img", "out:feats_maps_0", "out:feats_maps_1", "out:feats_pos", "meta"} == set(raw.files)


def test_bfloat16_and_bool_samples_keep_their_bits(tmp_path):
    tensors = {"x": torch.randn(3, 5).to(torch.bfloat16), "m": torch.rand(4) > 0.5, "i": torch.arange(6)}
    path = save_sample(tmp_path / "s.npz", "toy", 4, inputs=tensors, outputs={"y": tensors["x"] * 2})
    sample = load_sample(path)
    for name, tensor in tensors.items():
        assert sample.inputs[name].dtype == tensor.dtype
        assert torch.equal(sample.inputs[name], tensor)
    assert sample.outputs["y"].dtype == torch.bfloat16 and sample.call_index == 4


def test_a_sample_read_as_arrays_holds_what_torch_reads_and_torch_only_dtypes_go_through_torch(tmp_path):
    from omskills.contracts.samples import read_arrays

    tensors = {"x": torch.randn(3, 5), "m": torch.rand(4) > 0.5, "i": torch.arange(6), "h": torch.randn(2).half()}
    path = save_sample(tmp_path / "s.npz", "toy", 0, inputs=tensors, outputs={"y": tensors["x"] * 2})
    inputs, outputs = read_arrays(path)
    assert {k: (v.dtype, v.tobytes()) for k, v in inputs.items()} == {
        k: (v.numpy().dtype, v.numpy().tobytes()) for k, v in tensors.items()
    }
    assert np.array_equal(outputs["y"], tensors["x"].numpy() * 2)
    odd = save_sample(
        tmp_path / "u.npz", "toy", 0, inputs={"u": torch.tensor([1, 2, 40000]).to(torch.uint16)}, outputs={}
    )
    u = read_arrays(odd)[0]["u"]  # stored as int16 bits: read through torch
    assert u.dtype == np.uint16 and u.tolist() == [1, 2, 40000]


class InPlace(nn.Module):
    def forward(self, x):
        x.mul_(2)  # modifies its input, as some SAM helpers do
        return x + 1


class InPlaceModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.step = InPlace()

    def forward(self, x):
        return self.step(x)


def test_samples_hold_the_inputs_as_received_before_in_place_changes(tmp_path):
    model = InPlaceModel()
    x = torch.ones(2, 2)
    contracts = capture_contracts(model, {"step": "step"}, lambda: model(x), samples_dir=tmp_path)
    sample = load_sample(Path(contracts[0].samples[0]))
    assert torch.equal(sample.inputs["x"], torch.ones(2, 2))
    assert torch.equal(sample.outputs["out"], torch.full((2, 2), 3.0))


def test_optional_input_none_in_some_calls_counts_as_another_structure(tmp_path):
    model = Model().eval()
    tracker = ProvenanceTracker()

    def run():
        with torch.no_grad():
            for memory in (None, torch.zeros(2, 2), torch.zeros(2, 2)):
                model(torch.randn(1, 3, 8, 8), "dog", 1, memory)

    (head,) = capture_contracts(model, {"head": "head"}, run, tracker)
    assert head.structure_variants == 2
    assert head.calls == 3
    assert "memory" in [s.name for s in head.inputs]  # the most frequent structure is described


def test_a_candidate_never_called_on_the_main_path_is_an_error_naming_it(tmp_path):
    model = Model().eval()
    with pytest.raises(OmskillsError, match=r"candidate text \(text\) was never called on the main path"):
        capture_contracts(
            model, {"vision": "backbone.vision", "text": "text"}, lambda: model.backbone(torch.randn(1, 3, 8, 8))
        )


def test_a_candidate_path_that_does_not_exist_is_an_error_naming_it():
    model = Model().eval()
    with pytest.raises(OmskillsError, match=r"candidate decoder: module path 'head\.decoder' does not exist"):
        capture_contracts(model, {"decoder": "head.decoder"}, lambda: None)


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def test_hooks_are_removed_after_the_run_even_when_it_fails():
    model = Model().eval()

    def failing_run():
        model.backbone(torch.randn(1, 3, 8, 8))
        raise RuntimeError("driver crashed")

    with pytest.raises(RuntimeError, match="driver crashed"):
        capture_contracts(model, {"vision": "backbone.vision"}, failing_run)
    assert _hook_count(model) == 0


def test_wrap_callable_restores_the_original_attribute():
    model = Model()
    tracker = ProvenanceTracker()
    original = model.tokenizer
    with tracker.wrap_callable(model, "tokenizer", "input", "tokenizer"):
        tokens = model.tokenizer("two words")
    assert tracker.origin(tokens).kind == "input"
    assert tracker.origin(tokens[:, :1]).kind == "input"  # views share the origin
    assert model.tokenizer is original


def test_a_freed_storage_does_not_lend_its_origin_to_a_new_tensor():
    tracker = ProvenanceTracker()
    tagged = tracker.tag(torch.randn(64), "input", "frames")
    del tagged
    fresh = torch.randn(64)  # may reuse the same address
    assert tracker.origin(fresh).kind == "unknown"


def test_a_spec_written_in_one_process_loads_in_another_that_imports_the_classes(tmp_path):
    import subprocess
    import sys
    import textwrap

    (tmp_path / "toy_structs.py").write_text(
        textwrap.dedent("""
        import dataclasses, collections, torch
        @dataclasses.dataclass
        class Out:
            masks: torch.Tensor
            scores: list
        Pair = collections.namedtuple("Pair", "a b")
    """)
    )
    script = textwrap.dedent("""
        import sys, torch
        from omskills.contracts import pytree
        if sys.argv[1] == "write":
            from toy_structs import Out, Pair
            print(pytree.spec_to_str(pytree.flatten(Out(torch.ones(1), [Pair(torch.ones(2), 3)])).spec))
        else:
            spec = pytree.spec_from_str(sys.stdin.read())
            rebuilt = pytree.unflatten([torch.zeros(1), torch.zeros(2), 3], spec)
            print(type(rebuilt).__name__, type(rebuilt.scores[0]).__name__, rebuilt.scores[0].b)
    """)
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    written = subprocess.run(
        [sys.executable, "-c", script, "write"], env=env, capture_output=True, text=True, check=True
    )
    loaded = subprocess.run(
        [sys.executable, "-c", script, "read"],
        input=written.stdout,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert loaded.stdout.split() == ["Out", "Pair", "3"]


def test_a_spec_naming_a_class_that_cannot_be_imported_is_a_clear_error():
    text = '[1, {"type": "no_such_module:Thing", "context": "[]", "children_spec": []}]'
    with pytest.raises(OmskillsError, match="no_such_module:Thing"):
        pytree.spec_from_str(text)


class MaskDecoder(nn.Module):
    def forward(self, feats):
        return feats.mean(1, keepdim=True)


class MemoryEncoder(nn.Module):
    def forward(self, feats, mask):
        return feats * mask


class Tracker(nn.Module):
    """Computes the memory encoder's mask in Python between two modules, as SAM's tracker does."""

    def __init__(self):
        super().__init__()
        self.decoder, self.memory = MaskDecoder(), MemoryEncoder()

    def forward(self, feats):
        logits = self.decoder(feats)
        mask_for_memory = (torch.sigmoid(logits) > 0.5).float() * 20.0 - 10.0
        return self.memory(feats, mask_for_memory)


@pytest.mark.parametrize("trace_ops", [True, False])
def test_a_tensor_computed_in_python_from_a_module_output_is_traced_to_that_module(trace_ops):
    model = Tracker()
    tracker = ProvenanceTracker(trace_ops=trace_ops)

    def run():
        model(tracker.tag(torch.randn(1, 4, 3, 3), "input", "frames"))

    (memory,) = capture_contracts(model, {"memory": "memory"}, run, tracker)
    feats, mask = memory.inputs
    assert (feats.provenance.kind, feats.provenance.source, feats.provenance.derived) == ("input", "frames", False)
    if trace_ops:
        origin = mask.provenance
        assert (origin.kind, origin.source, origin.derived) == ("module_output", "decoder", True)
    else:
        assert mask.provenance.kind == "unknown"


def test_a_struct_the_model_registered_without_keys_is_re_registered_with_paths():
    """SAM 3.1 registers its NestedTensor as a pytree node without keys or a serialised name."""
    import torch.utils._pytree as pt
    from omskills.contracts.pytree import ensure_registered, flatten_call, spec_to_str

    class KeylessNested:
        def __init__(self, tensors, mask):
            self.tensors, self.mask = tensors, mask

    pt.register_pytree_node(KeylessNested, lambda x: ([x.tensors, x.mask], None), lambda v, _: KeylessNested(*v))
    call = ((KeylessNested(torch.ones(2), torch.zeros(2, dtype=torch.bool)),), {})
    ensure_registered(call)
    flat = flatten_call(*call)
    assert flat.paths == ["args[0].tensors", "args[0].mask"]
    assert spec_to_str(flat.spec)


def test_a_tensor_fed_back_into_itself_keeps_a_short_origin():
    """SAM 3.1's mask NMS runs keep = keep & ~(overlap[:, i] & keep[:, i]) once per detection:
    the origin of `keep` must not grow with each step (it doubled, and the study ran out of memory)."""
    tracker = ProvenanceTracker()
    overlap = tracker.tag(torch.rand(1, 40, 40) > 0.5, "module_output", "detector.segmentation_head")
    keep = tracker.tag(torch.ones(1, 40, dtype=torch.bool), "session", "session.detections")
    with tracker.attached(nn.Linear(1, 1)):
        for i in range(40):
            keep = keep & ~(overlap[:, i, :] & keep[:, i].unsqueeze(1))

    origin = tracker.origin(keep)
    assert origin.derived and len(origin.source) < 200, len(origin.source)
    assert "detector.segmentation_head" in origin.source and "session.detections" in origin.source


def test_samples_hold_what_forward_returned_even_when_another_hook_replaces_the_output(tmp_path):
    model = InPlaceModel()
    # Registered before the capture, as SAM's verification hooks are: it replaces the output.
    model.step.register_forward_hook(lambda _m, _a, out: -out)
    x = torch.ones(2, 2)
    contracts = capture_contracts(model, {"step": "step"}, lambda: model(x), samples_dir=tmp_path)
    sample = load_sample(Path(contracts[0].samples[0]))
    assert torch.equal(sample.outputs["out"], torch.full((2, 2), 3.0))


class CallsItsPartsBothWays(nn.Module):
    def __init__(self):
        super().__init__()
        self.called = InPlace()
        self.direct = InPlace()

    def forward(self, x):
        return self.called(x.clone()) + self.direct.forward(x.clone())  # SAM 3 calls some parts' forward


def test_routed_modules_are_recorded_once_per_call_however_they_are_called(tmp_path):
    from omskills.contracts.routing import route_forward_calls

    model = CallsItsPartsBothWays()
    model.called.register_forward_hook(lambda _m, _a, out: -out)  # e.g. a verification hook

    def run():
        with route_forward_calls([model.called, model.direct]):
            model(torch.ones(2, 2))
            model(torch.ones(2, 2))

    contracts = {
        c.candidate: c
        for c in capture_contracts(model, {"called": "called", "direct": "direct"}, run, samples_dir=tmp_path)
    }
    assert contracts["called"].calls == contracts["direct"].calls == 2
    for contract in contracts.values():
        for path in contract.samples:
            assert torch.equal(load_sample(Path(path)).outputs["out"], torch.full((2, 2), 3.0))
    assert "forward" not in model.called.__dict__ and not model.called._forward_pre_hooks


def test_sample_copies_wait_on_disk_during_the_run_and_only_the_samples_remain_after_it(tmp_path):
    import os
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left_by_a_killed_capture = tmp_path / f".capture-{dead.stdout.strip()}"
    left_by_a_killed_capture.mkdir()
    model = InPlaceModel()
    during: list[list[str]] = []

    def run() -> None:
        for size in (2, 2, 3, 3):
            model(torch.ones(size, 2))
            during.append(sorted(p.name for p in (tmp_path / f".capture-{os.getpid()}").iterdir()))

    [contract] = capture_contracts(model, {"step": "step"}, run, samples_dir=tmp_path, max_samples=2)

    # each kept call's inputs and outputs are one file each; a call evicted for a new shape loses its files
    assert [len(names) for names in during] == [2, 4, 4, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0.npz", "step_1.npz"]
    assert [load_sample(tmp_path / p).inputs["x"].shape[0] for p in contract.samples] == [2, 3]


def test_samples_are_kept_one_per_distinct_input_shape_read_from_their_headers(tmp_path):
    from omskills.contracts.samples import input_shapes, one_per_shape, save_sample

    def sample(name: str, batch: int) -> Path:
        x = torch.full((batch, 3), float(batch))
        return save_sample(tmp_path / name, "c", 0, inputs={"x": x, "scale": torch.ones(1)}, outputs={"y": 2 * x})

    paths = [sample("a.npz", 1), sample("b.npz", 4), sample("c.npz", 1), sample("d.npz", 4)]

    assert input_shapes(paths[1]) == (("scale", (1,)), ("x", (4, 3)))
    assert one_per_shape(paths) == [paths[0], paths[1]]
