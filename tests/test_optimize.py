"""optimize_variants: original / onnxslim / auto_optimizer, each checked and probed, one preferred."""

from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest
import torch
from omskills.convert.auto_optimizer import (
    DEFAULT_OFF,
    apply_knowledges,
    install_onnx_mapping,
    load_auto_optimizer,
    mapping_tables,
)
from omskills.convert.optimize import choose_preferred, optimize_variants
from omskills.errors import InputError
from omskills.records.toolchain import VariantResult
from onnx import TensorProto, helper


class Tiny(torch.nn.Module):
    """Conv + BN + pooling + a split/concat: the legacy exporter leaves Constant/Shape noise to slim."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3))
        a, b = y[:, :4], y[:, 4:]
        return self.head(torch.cat([a, b], 1)), (a * b).sum(1)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A TorchScript-exported tiny model and two PyTorch reference samples."""
    folder = tmp_path_factory.mktemp("tiny")
    model = Tiny().eval()
    path = folder / "tiny.onnx"
    x0 = torch.randn(2, 3, 8, 8)
    torch.onnx.export(
        model, (x0,), str(path), input_names=["x"], output_names=["logits", "score"], dynamo=False, opset_version=17
    )
    samples = []
    for seed in (1, 2):
        x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            logits, score = model(x)
        samples.append(({"x": x.numpy()}, {"logits": logits.numpy(), "score": score.numpy()}))
    return path, samples


def test_every_variant_is_built_checked_and_probed(exported, tmp_path, capfd):
    path, samples = exported

    result = optimize_variants(path, tmp_path, samples, variants=["original", "onnxslim"])
    auto = optimize_variants(path, tmp_path / "auto", samples, variants=["original", "auto_optimizer"])

    variants = {v.name: v for v in result.variants} | {"auto_optimizer": auto.variants[1]}
    for v in variants.values():
        assert v.status == "ok", v.reason
        assert [c.name for c in v.checks] == ["onnx_checker", "outputs_produced", "ort_load", "parity"]
        assert all(c.passed for c in v.checks)
        assert v.parity_verdict == "pass" and v.samples_probed == 2
        assert {p.name for p in v.parity} == {"logits", "score"}
    # onnxslim removes the exporter's Constant/Shape noise.
    assert variants["onnxslim"].node_count < variants["original"].node_count
    # auto_optimizer reports what each knowledge did; on the export as it is, KnowledgeTypeCast applies.
    assert {k.outcome for k in variants["auto_optimizer"].knowledges} <= {
        "applied",
        "not_matched",
        "failed",
        "rejected",
    }
    assert len(variants["auto_optimizer"].knowledges) >= 5
    assert "KnowledgeTypeCast" in [k.name for k in variants["auto_optimizer"].knowledges if k.outcome == "applied"]
    assert auto.preferred == "auto_optimizer" and auto.preferred_path == variants["auto_optimizer"].path
    assert result.preferred == "onnxslim"
    # Nothing reached stdout (onnxslim prints tables; stdout may be an MCP stream).
    assert capfd.readouterr().out == ""


def test_a_variant_that_changes_nothing_is_neither_saved_nor_probed(exported, tmp_path):
    path, samples = exported

    result = optimize_variants(path, tmp_path, samples)

    # auto_optimizer works on the slimmed model, where its one match (KnowledgeTypeCast) breaks the graph.
    auto = next(v for v in result.variants if v.name == "auto_optimizer")
    assert auto.built_from == next(v.path for v in result.variants if v.name == "onnxslim")
    assert auto.status == "unchanged" and auto.path is None and auto.samples_probed == 0 and not auto.checks
    assert "left the graph as it was" in auto.reason and "knowledges applied: none" in auto.reason
    assert not list(tmp_path.glob("*.auto_optimizer.onnx*"))
    assert result.preferred == "onnxslim" and "auto_optimizer: unchanged" in result.why


def test_on_a_big_graph_variants_changing_few_nodes_are_marginal_and_never_probed(exported, tmp_path, monkeypatch):
    from omskills.convert import optimize

    path, samples = exported
    slim = optimize._build("onnxslim", path, tmp_path / "tiny.onnxslim.onnx", None)
    auto = optimize._build("auto_optimizer", path, tmp_path / "tiny.auto_optimizer.onnx", None)
    assert slim.status == auto.status == "ok"  # both change this graph (auto_optimizer: KnowledgeTypeCast)
    # The same rewrites, with this graph counted as big and the bar set above what they change here.
    monkeypatch.setattr(optimize, "ISOLATE_MIN_BYTES", 0)
    monkeypatch.setattr(optimize, "MARGINAL_SHARE", 5.0)
    result = optimize_variants(path, tmp_path / "big", samples, isolate=False)

    for marginal in result.variants[1:]:
        assert marginal.status == "marginal" and marginal.path is None and marginal.samples_probed == 0, marginal
        assert "added or removed" in marginal.reason and "under the 500%" in marginal.reason
    assert "KnowledgeTypeCast" in result.variants[2].reason  # what applied is still said
    assert result.variants[2].built_from == str(path)  # nothing of onnxslim's was kept to build on
    assert not [p for p in (tmp_path / "big").iterdir() if ".onnxslim." in p.name or ".auto_optimizer." in p.name]
    assert result.preferred == "original"


def test_the_most_optimised_variant_is_probed_first_and_the_one_under_it_only_if_it_fails(exported, tmp_path):
    from omskills.convert import optimize

    path, samples = exported
    original = optimize.check_variant("original", path, samples)
    slim = optimize._build("onnxslim", path, tmp_path / "tiny.onnxslim.onnx", None)
    auto = optimize._build(
        "auto_optimizer", path, tmp_path / "tiny.auto_optimizer.onnx", None
    )  # KnowledgeTypeCast applies
    assert slim.status == auto.status == "ok" and not slim.checks and not auto.checks  # built, not yet probed

    checked = optimize._check_most_optimised_first([original, slim, auto], samples, None, isolate=False)

    assert [v.status for v in checked] == ["ok", "not_checked", "ok"]
    assert checked[2].samples_probed == 2 and checked[1].samples_probed == 0
    assert "auto_optimizer, which is built on it, passed" in checked[1].reason

    wrong = [(feeds, {k: v + 1.0 for k, v in reference.items()}) for feeds, reference in samples]
    checked = optimize._check_most_optimised_first([original, slim, auto], wrong, None, isolate=False)
    assert [v.status for v in checked] == ["ok", "failed", "failed"]  # auto failed, so onnxslim was probed too


class Weighty(torch.nn.Module):
    """Weights of several KB, as a real model's: they live in a .data file beside the graph."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x).reshape(x.shape[0], 4, 16).transpose(1, 2).reshape(x.shape[0], 64)  # shape arithmetic
        return self.b(torch.relu(y))


@pytest.mark.parametrize("stored", ["external", "inline"])
def test_a_big_graph_is_rewritten_without_its_weights_and_keeps_their_bytes(tmp_path, stored):
    from omskills.onnxfiles.onnx_io import save_onnx

    model = Weighty().eval()
    path = tmp_path / "weighty.onnx"
    torch.onnx.export(
        model, (torch.randn(2, 64),), str(path), input_names=["x"], output_names=["y"], dynamo=False, opset_version=17
    )
    if stored == "external":  # as a model too big for one protobuf is saved
        save_onnx(onnx.load(str(path)), path, size=2**31)
        assert path.with_name("weighty.onnx.data").is_file()
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        sample = ({"x": x.numpy()}, {"y": model(x).numpy()})

    result = optimize_variants(path, tmp_path, [sample], variants=["original", "onnxslim"])

    slim = result.variants[1]
    assert slim.status == "ok" and slim.parity_verdict == "pass", slim.reason
    assert slim.node_count < result.variants[0].node_count
    variant = onnx.load(slim.path, load_external_data=False)
    weights = [t for t in variant.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    assert {t.name for t in weights} == {"a.weight", "b.weight"} and {
        e.value for t in weights for e in t.external_data if e.key == "location"
    } == {"weighty.onnxslim.onnx.data"}
    assert {i.name for i in variant.graph.input} == {"x"}  # the detached weights are initializers again
    data = (tmp_path / "weighty.onnxslim.onnx.data").read_bytes()
    original = onnx.load(str(path))
    for tensor in weights:  # each weight's bytes where its entry says, equal to the original's
        entries = {e.key: int(e.value) for e in tensor.external_data if e.key in ("offset", "length")}
        expected = next(t for t in original.graph.initializer if t.name == tensor.name)
        assert (
            data[entries["offset"] : entries["offset"] + entries["length"]]
            == onnx.numpy_helper.to_array(expected).tobytes()
        )


def test_auto_optimizer_reports_unavailable_when_not_importable(exported, tmp_path, monkeypatch):
    path, samples = exported
    monkeypatch.setitem(sys.modules, "auto_optimizer", None)  # import auto_optimizer -> ImportError

    result = optimize_variants(path, tmp_path, samples)

    auto = next(v for v in result.variants if v.name == "auto_optimizer")
    assert auto.status == "unavailable" and "ait-surgeon" in auto.reason
    assert result.preferred == "onnxslim"
    assert "auto_optimizer: unavailable" in result.why


def test_wrong_reference_fails_parity_and_nothing_is_preferred(exported, tmp_path):
    path, samples = exported
    feeds, reference = samples[0]
    wrong = {name: value + 1.0 for name, value in reference.items()}

    result = optimize_variants(path, tmp_path, [(feeds, wrong)], variants=["original", "onnxslim"])

    assert [v.status for v in result.variants] == ["failed", "failed"]
    assert all(v.parity_verdict == "fail" for v in result.variants)
    assert result.preferred is None and "no variant passed" in result.why


def test_a_variant_that_cannot_run_a_sample_fails_and_the_others_are_still_checked(exported, tmp_path):
    path, samples = exported
    feeds, reference = samples[0]
    unrunnable = {"x": np.zeros((2, 5, 8, 8), np.float32)}  # 5 channels: the conv takes 3

    result = optimize_variants(path, tmp_path, [(unrunnable, reference)], variants=["original", "onnxslim"])

    assert [v.status for v in result.variants] == ["failed", "failed"]
    assert all("does not run a sample" in v.checks[-1].detail for v in result.variants)
    assert result.preferred is None


def test_graph_output_that_no_node_produces_fails_the_variant(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="relu")],
        "dangling",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("ghost", TensorProto.FLOAT, [2]),
        ],
    )
    path = tmp_path / "dangling.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)

    result = optimize_variants(path, tmp_path / "out", [], variants=["original"])

    original = result.variants[0]
    assert original.status == "failed"
    check = next(c for c in original.checks if c.name == "outputs_produced")
    assert not check.passed and "ghost" in check.detail


def test_corrupt_original_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.onnx"
    path.write_bytes(b"not an onnx file")
    with pytest.raises(InputError, match="bad.onnx"):
        optimize_variants(path, tmp_path / "out", [])


def test_a_less_accurate_variant_is_not_preferred():
    def variant(name, verdict):
        return VariantResult(name=name, status="ok", parity_verdict=verdict, path=f"{name}.onnx")

    chosen, why = choose_preferred(
        [variant("original", "pass"), variant("onnxslim", "pass"), variant("auto_optimizer", "review")]
    )

    assert chosen.name == "onnxslim"
    assert "auto_optimizer: parity review is worse than the original's" in why


# -- the compatibility layer ----------------------------------------------------------------


def test_onnx_mapping_tables_are_rebuilt_from_onnx_helper():
    tensor_to_np, np_to_tensor = mapping_tables()
    assert tensor_to_np[TensorProto.FLOAT] == np.dtype("float32")
    assert np_to_tensor[np.dtype("int64")] == TensorProto.INT64
    assert np_to_tensor[np.dtype("float32")] == TensorProto.FLOAT
    install_onnx_mapping()
    import onnx.mapping

    assert onnx.mapping.NP_TYPE_TO_TENSOR_TYPE[np.dtype("bool")] == TensorProto.BOOL
    assert install_onnx_mapping() is False  # already there: nothing replaced


def _consecutive_concat_model(path):
    """Slice -> Slice -> Concat -> Concat: knowledges to merge both pairs exist."""
    ints = lambda name, values: helper.make_tensor(name, TensorProto.INT64, [len(values)], values)  # noqa: E731
    nodes = [
        helper.make_node("Slice", ["x", "s1", "e1", "a1"], ["t"], name="slice1"),
        helper.make_node("Slice", ["t", "s2", "e2", "a2"], ["y"], name="slice2"),
        helper.make_node("Concat", ["y", "y"], ["c"], axis=1, name="concat1"),
        helper.make_node("Concat", ["c", "y"], ["z"], axis=1, name="concat2"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 8])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 12, 4])],
        [ints("s1", [1]), ints("e1", [5]), ints("a1", [1]), ints("s2", [2]), ints("e2", [6]), ints("a2", [2])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def test_knowledges_apply_one_by_one_and_the_result_computes_the_same(tmp_path):
    import onnxruntime as ort

    path = tmp_path / "concat.onnx"
    _consecutive_concat_model(path)
    api = load_auto_optimizer()

    model, outcomes = apply_knowledges(api, path)

    assert [o.name for o in outcomes] == [n for n in api.knowledge_pool if n not in DEFAULT_OFF]
    assert {o.name: o.outcome for o in outcomes}["KnowledgeMergeConsecutiveConcat"] == "applied"
    assert [n.op_type for n in model.graph.node].count("Concat") == 1
    x = np.random.default_rng(0).random((1, 8, 8), dtype=np.float32)
    before = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
    after = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_array_equal(before, after)


def test_a_knowledge_that_raises_is_recorded_and_the_next_one_still_applies(tmp_path):
    # ait-surgeon 0.1.1's KnowledgeMergeConsecutiveSlice raises IndexError on this graph.
    path = tmp_path / "concat.onnx"
    _consecutive_concat_model(path)

    _, outcomes = apply_knowledges(
        load_auto_optimizer(), path, ["KnowledgeMergeConsecutiveSlice", "KnowledgeMergeConsecutiveConcat"]
    )

    assert outcomes[0].outcome == "failed" and "IndexError" in outcomes[0].error
    assert outcomes[1].outcome == "applied"


def test_a_knowledge_that_breaks_the_graph_is_undone(tmp_path):
    # KnowledgeTypeCast casts the shared index constant for one Slice input only, leaving
    # int32 and int64 indices on one node: strict shape inference rejects it.
    ints = lambda name, values: helper.make_tensor(name, TensorProto.INT64, [len(values)], values)  # noqa: E731
    nodes = [
        helper.make_node("Slice", ["x", "zero", "four", "one", "one"], ["y"], name="slice"),
        helper.make_node("ReduceSum", ["y", "one"], ["z"], name="sum", keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2])],
        [ints("zero", [0]), ints("four", [4]), ints("one", [1])],
    )
    path = tmp_path / "shared_index.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)

    model, outcomes = apply_knowledges(load_auto_optimizer(), path, ["KnowledgeTypeCast"])

    assert outcomes[0].outcome == "rejected" and "Slice" in outcomes[0].error
    assert {i.name: i.data_type for i in model.graph.initializer}["one"] == TensorProto.INT64  # untouched
    onnx.checker.check_model(model, full_check=True)


def test_unknown_knowledge_name_is_an_error(tmp_path):
    path = tmp_path / "concat.onnx"
    _consecutive_concat_model(path)
    with pytest.raises(Exception, match="KnowledgeNope"):
        apply_knowledges(load_auto_optimizer(), path, ["KnowledgeNope"])


def test_a_variant_that_drops_an_unused_input_is_probed_on_the_inputs_it_takes(tmp_path):
    """onnxslim removes graph inputs nothing reads; the probe must not feed them (seen on SAM 3)."""
    from onnx import TensorProto, helper

    a, b, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("a", "b", "y"))
    graph = helper.make_graph([helper.make_node("Add", ["a", "a"], ["y"])], "unused_input", [a, b], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "m.onnx")
    x = np.ones(2, np.float32)
    result = optimize_variants(
        tmp_path / "m.onnx", tmp_path, [({"a": x, "b": x}, {"y": 2 * x})], variants=("original", "onnxslim")
    )
    assert [v.status for v in result.variants] == ["ok", "ok"]
    assert result.preferred == "onnxslim"


def test_the_original_reuses_the_probe_onnx_report_instead_of_running_again(exported, tmp_path, monkeypatch):
    from omskills import runtime
    from omskills.compare.parity import compare_outputs

    path, samples = exported
    feeds, reference = samples[0]
    probed = compare_outputs(reference, {k: v + 0.5 for k, v in reference.items()})  # a probe that failed
    opened: list[str] = []
    real_open = runtime.open_backend
    monkeypatch.setattr(runtime, "open_backend", lambda p, *a, **k: opened.append(str(p)) or real_open(p, *a, **k))

    result = optimize_variants(path, tmp_path, samples, variants=["original", "onnxslim"], original_probe=probed)

    original = result.variants[0]
    assert str(path) not in opened  # neither loaded nor run again
    assert original.parity_verdict == "fail" and original.status == "failed"
    assert "probe_onnx" in next(c.detail for c in original.checks if c.name == "parity")
    assert result.variants[1].samples_probed == 2  # the variant is still probed itself


def test_variants_of_a_big_model_are_built_in_child_processes_that_write_nothing_to_stdout(exported, tmp_path, capfd):
    path, samples = exported

    result = optimize_variants(path, tmp_path, samples, variants=["original", "onnxslim"], isolate=True)

    assert [v.status for v in result.variants] == ["ok", "ok"]
    assert result.variants[1].samples_probed == 2 and result.preferred == "onnxslim"
    assert capfd.readouterr().out == ""


def test_a_child_that_dies_fails_its_variant_and_the_caller_goes_on(exported, tmp_path, monkeypatch):
    from omskills.convert import optimize

    path, samples = exported
    monkeypatch.setattr(optimize, "_build", _die)  # what the OOM killer does to the child
    monkeypatch.setattr(optimize, "_check", _die)

    result = optimize.optimize_variants(path, tmp_path, samples, variants=["original", "onnxslim"], isolate=True)

    assert [v.status for v in result.variants] == ["failed", "failed"]
    assert "died" in result.variants[1].reason and result.preferred is None


def _die(*args):
    import os

    os._exit(137)


def test_captured_samples_are_probed_in_a_child_process_and_its_death_is_an_error(exported, tmp_path):
    from omskills.contracts.samples import save_sample
    from omskills.convert.optimize import probe_samples
    from omskills.isolation import ChildDied, run_in_child

    path, samples = exported
    saved = []
    for k, (feeds, reference) in enumerate(samples):
        saved.append(
            save_sample(
                tmp_path / f"tiny_{k}.npz",
                "tiny",
                k,
                inputs={n: torch.from_numpy(v) for n, v in feeds.items()},
                outputs={n: torch.from_numpy(v) for n, v in reference.items()},
            )
        )

    reports = run_in_child(probe_samples, path, saved)

    assert [r.verdict for r in reports] == ["pass", "pass"]
    with pytest.raises(ChildDied, match="out of memory"):
        run_in_child(_die)


def test_where_the_batch_goes_in_chunks_a_variant_is_checked_on_one_first_chunk_per_shape(tmp_path, monkeypatch):
    from omskills.contracts.samples import save_sample
    from omskills.convert import optimize
    from omskills.records.toolchain import BatchSplit

    model = Tiny().eval()
    path = tmp_path / "dynamic.onnx"
    torch.onnx.export(
        model,
        (torch.randn(2, 3, 8, 8),),
        str(path),
        input_names=["x"],
        output_names=["logits", "score"],
        dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}, "score": {0: "batch"}},
        dynamo=False,
        opset_version=17,
    )
    saved = []
    for k, batch in enumerate((1, 3, 4)):  # first chunks of 2: one of 1 item, two of 2 items
        x = torch.randn(batch, 3, 8, 8, generator=torch.Generator().manual_seed(k))
        with torch.no_grad():
            logits, score = model(x)
        saved.append(save_sample(tmp_path / f"tiny_{k}.npz", "tiny", k, {"x": x}, {"logits": logits, "score": score}))
    split = BatchSplit(max_batch=2, input_axes={"x": 0}, output_axes={"logits": 0, "score": 0}, reason="test")
    fed: list[tuple[int, ...]] = []
    real_open = optimize.open_onnxruntime

    def spying_open(model, batch_split=None):
        backend = real_open(model, batch_split)
        real_run = backend.run
        backend.run = lambda feeds: fed.append(feeds["x"].shape) or real_run(feeds)
        return backend

    monkeypatch.setattr(optimize, "open_onnxruntime", spying_open)

    result = optimize.optimize_variants(
        path, tmp_path / "out", saved, variants=["original", "onnxslim"], isolate=False, batch_split=split
    )

    slim = result.variants[1]
    assert slim.status == "ok" and slim.parity_verdict == "pass" and result.preferred == "onnxslim"
    # The original and the variant each run a chunk of 1 and one of 2 (the batch of 4's is the batch of 3's shape).
    assert fed == [(1, 3, 8, 8), (2, 3, 8, 8)] * 2
    assert "first batch chunk of each" in next(c.detail for c in slim.checks if c.name == "parity")
