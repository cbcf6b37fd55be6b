"""SAM 3.1 (Object Multiplex) from a user's checkout.

Fast tests (always run): where the checkout comes from and the error without one, the
portability stand-ins and fixes SAM 3.1 needs, and the verification settings on toy inputs.

Opt-in tests (`-m sam31`): the tiny SAM 3.1 main path on CPU, in a fresh process, from the
checkout named by OMSKILLS_SAM31_SOURCE (`git clone https://github.com/facebookresearch/sam3`
at a revision with SAM 3.1). Skipped, with the reason, when the variable is unset.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from omskills.errors import InputError
from omskills.models.registry import family_driver
from omskills.sam.sam31 import (
    SOURCE_ENV,
    MultiplexForcedDetections,
    Sam31Driver,
    _fp32_addmm_act,
    _init_state_accepting_known_kwargs,
    _visible_objects,
    resolve_checkout,
    use_checkout,
)
from omskills.source.portability import DevicePortability, WatchedImport, pkg_resources_stand_in, triton_stand_in

REPO = Path(__file__).resolve().parents[1]
TASK = REPO / "task_records" / "sam3.1-video-text.yaml"


def fake_checkout(root: Path) -> Path:
    """The layout resolve_checkout looks for (empty files: no SAM code)."""
    predictor = root / "sam3" / "model" / "sam3_multiplex_video_predictor.py"
    predictor.parent.mkdir(parents=True)
    (root / "sam3" / "__init__.py").touch()
    predictor.touch()
    return root


def omskills_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "import sys; from omskills.orchestrator.cli import main; sys.exit(main())", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )


# -- where the checkout comes from ---------------------------------------------------------


def test_family_sam31_gets_the_multiplex_driver_through_its_entry_point():
    assert isinstance(family_driver("sam3.1"), Sam31Driver)


@pytest.mark.parametrize("source", ["package", "", "/nonexistent/sam3-checkout"])
def test_without_a_checkout_the_error_says_what_to_clone_and_what_to_set(source, monkeypatch):
    monkeypatch.delenv(SOURCE_ENV, raising=False)
    with pytest.raises(InputError) as error:
        resolve_checkout(source)
    message = str(error.value)
    assert "git clone https://github.com/facebookresearch/sam3" in message
    assert "intake.model.source" in message and SOURCE_ENV in message and "--source" in message


def test_a_folder_without_the_multiplex_predictor_is_not_a_31_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv(SOURCE_ENV, raising=False)
    (tmp_path / "sam3").mkdir()
    (tmp_path / "sam3" / "__init__.py").touch()
    with pytest.raises(InputError, match="not a SAM 3.1 checkout.*sam3_multiplex_video_predictor.py.*git clone"):
        resolve_checkout(str(tmp_path))


def test_the_environment_variable_overrides_the_record_field(tmp_path, monkeypatch):
    checkout = fake_checkout(tmp_path / "checkout")
    monkeypatch.setenv(SOURCE_ENV, str(checkout))
    assert resolve_checkout("path/in/the/record") == checkout.resolve()


def test_the_package_folder_itself_is_accepted(tmp_path, monkeypatch):
    monkeypatch.delenv(SOURCE_ENV, raising=False)
    checkout = fake_checkout(tmp_path / "checkout")
    assert resolve_checkout(str(checkout / "sam3")) == checkout.resolve()


def test_a_sam3_already_imported_from_elsewhere_is_refused(tmp_path, monkeypatch):
    checkout = fake_checkout(tmp_path / "checkout")
    other = ModuleType("sam3")
    other.__file__ = str(tmp_path / "site-packages" / "sam3" / "__init__.py")
    monkeypatch.setitem(sys.modules, "sam3", other)
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(InputError, match="already imported.*fresh process"):
        use_checkout(checkout.resolve())


def test_the_checkout_goes_first_on_sys_path(tmp_path, monkeypatch):
    checkout = fake_checkout(tmp_path / "checkout").resolve()
    monkeypatch.delitem(sys.modules, "sam3", raising=False)
    monkeypatch.setattr(sys, "path", [*sys.path, str(checkout)])
    use_checkout(checkout)
    assert sys.path[0] == str(checkout) and sys.path.count(str(checkout)) == 1


def test_cli_without_a_checkout_fails_in_one_line_naming_clone_field_and_variable(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != SOURCE_ENV}
    result = omskills_cli(
        "main-path", str(TASK), "--scale", "tiny", "--frames", "1", "--out", str(tmp_path / "out"), env=env
    )
    assert result.returncode != 0
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("omskills: error:")]
    assert len(error_lines) == 1, result.stderr[-2000:]
    assert "git clone https://github.com/facebookresearch/sam3" in error_lines[0]
    assert "intake.model.source" in error_lines[0] and SOURCE_ENV in error_lines[0]


# -- portability pieces SAM 3.1 needs ---------------------------------------------------------


def _import_from_model_source(source: Path, module_name: str, body: str) -> ModuleType:
    (source / f"{module_name}.py").write_text(textwrap.dedent(body))
    sys.path.insert(0, str(source))
    try:
        return __import__(module_name)
    finally:
        sys.path.remove(str(source))
        sys.modules.pop(module_name, None)


def test_a_missing_module_imported_by_the_model_gets_a_stand_in_and_a_finding(tmp_path):
    stand_in = ModuleType("omskills_absent_lib")
    stand_in.answer = 42
    portability = DevicePortability("cpu", tmp_path)
    portability.watch_import(
        WatchedImport(
            "omskills_absent_lib", "absent_lib", "not on this host", lambda: {"omskills_absent_lib": stand_in}
        )
    )
    with portability:
        module = _import_from_model_source(
            tmp_path, "model_a", "import os\nimport omskills_absent_lib\nVALUE = omskills_absent_lib.answer\n"
        )
    assert module.VALUE == 42
    assert "omskills_absent_lib" not in sys.modules  # the stand-in lives only while the layer is active
    [finding] = portability.findings()
    assert (finding.file, finding.line, finding.kind) == ("model_a.py", 2, "absent_lib")
    assert "stand-in" in finding.detail


def test_an_installed_watched_module_is_recorded_and_left_alone(tmp_path):
    portability = DevicePortability("cpu", tmp_path)
    portability.watch_import(
        WatchedImport("json", "json_kind", "watched for the test", lambda: pytest.fail("json is installed"))
    )
    with portability:
        module = _import_from_model_source(tmp_path, "model_b", "import json\nDUMPS = json.dumps\n")
    assert module.DUMPS is json.dumps
    [finding] = portability.findings()
    assert (finding.file, finding.line) == ("model_b.py", 1) and "imported" in finding.detail


def test_pkg_resources_stand_in_resolves_package_resources():
    pkg_resources = pkg_resources_stand_in()["pkg_resources"]
    assert Path(pkg_resources.resource_filename("omskills", "errors.py")).is_file()


def test_triton_stand_in_defines_kernels_at_import_and_refuses_to_launch_them(tmp_path):
    modules = triton_stand_in()
    source = """
        import triton
        import triton.language as tl

        @triton.jit
        def kernel(ptr, n: tl.constexpr):
            return tl.load(ptr)
    """
    saved = {name: sys.modules.pop(name, None) for name in modules}
    sys.modules.update(modules)
    try:
        module = _import_from_model_source(tmp_path, "model_c", source)
    finally:
        for name, original in saved.items():
            if original is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = original
    with pytest.raises(RuntimeError, match="triton is not installed"):
        module.kernel(None, 4)


@pytest.mark.parametrize("activation", [torch.nn.GELU, torch.nn.ReLU])
def test_fp32_addmm_act_is_the_fused_op_in_fp32(activation):
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 40)
    x = torch.randn(2, 5, 24)
    used, y = _fp32_addmm_act(lambda *a: pytest.fail("the bf16 original must not run"))(activation, linear, x)
    fused = torch.ops.aten._addmm_activation(
        linear.bias, x.view(-1, 24), linear.weight.t(), use_gelu=activation is torch.nn.GELU
    )
    assert used and y.dtype == torch.float32
    torch.testing.assert_close(y, fused.view(2, 5, 40), rtol=0, atol=1e-6)


# -- verification settings on toy inputs -----------------------------------------------------


def test_forced_detections_keep_exactly_the_top_k_of_the_prompted_frame_only():
    model = SimpleNamespace(score_threshold_detection=0.4, new_det_thresh=0.65)
    forced = MultiplexForcedDetections(model, k=2, prompt_frame=0)

    def nothing_kept(pred_probs, pred_masks, prob_threshold, iou_threshold, **_):
        return torch.zeros_like(pred_probs, dtype=torch.bool)

    probs = torch.tensor([[0.10, 0.30, 0.20, 0.05], [0.9, 0.8, 0.7, 0.6]])
    nms = forced._nms(nothing_kept)
    forced._nms_frames = [0, 1]  # a batched chunk: rows are frames 0 and 1
    keep = nms(pred_probs=probs, pred_masks=torch.zeros(2, 4, 3, 3), prob_threshold=0.4, iou_threshold=0.1)
    assert keep[0].tolist() == [False, True, True, False]
    assert not keep[1].any()  # other frames keep SAM's own decision
    assert forced.forced_frames == [0]
    assert forced.forced_threshold[0] == pytest.approx(0.2 - 1e-6)


def test_forced_detections_lower_thresholds_only_while_detecting_the_prompted_frame():
    model = SimpleNamespace(score_threshold_detection=0.4, new_det_thresh=0.65)
    forced = MultiplexForcedDetections(model, k=2)
    forced.forced_threshold[0] = 0.2
    seen = []
    detect = forced._detection(
        lambda **kw: seen.append((kw["frame_idx"], model.score_threshold_detection, model.new_det_thresh))
    )
    detect(frame_idx=0)
    detect(frame_idx=1)
    assert seen == [(0, 0.2, 0.2), (1, 0.4, 0.65)]


def test_keep_objects_visible_takes_the_absolute_visibility_logit_of_both_decoders():
    logits = torch.tensor([-3.0, 2.0])
    multiplex = _visible_objects(None, None, {"masks": 1, "object_score_logits": logits})
    interactive = _visible_objects(None, None, ("masks", "ious", "tokens", logits))
    assert multiplex["object_score_logits"].tolist() == [3.0, 2.0] and multiplex["masks"] == 1
    assert interactive[3].tolist() == [3.0, 2.0] and interactive[:3] == ("masks", "ious", "tokens")


def test_start_session_keywords_the_multiplex_init_state_lacks_are_dropped():
    calls = []
    model = SimpleNamespace(
        init_state=lambda resource_path, offload_video_to_cpu=False: calls.append((resource_path, offload_video_to_cpu))
    )
    with _init_state_accepting_known_kwargs(model) as dropped:
        model.init_state(resource_path="frames", offload_video_to_cpu=True, offload_state_to_cpu=False)
    assert calls == [("frames", True)] and dropped == {"offload_state_to_cpu"}


# -- source limits behind the propagation candidates' shapes ------------------------------


def _built_model(max_num_objects=16, stride=1):
    tracker = SimpleNamespace(
        multiplex_controller=SimpleNamespace(multiplex_count=16),
        sam_image_embedding_size=72,
        num_maskmem=7,
        max_obj_ptrs_in_encoder=16,
        max_cond_frames_in_attn=4,
        memory_temporal_stride_for_eval=stride,
    )
    root = SimpleNamespace(max_num_objects=max_num_objects, tracker=SimpleNamespace(model=tracker))
    return SimpleNamespace(root=root)


def test_bucket_count_follows_max_num_objects_over_multiplex_count():
    limits = Sam31Driver().source_limits(_built_model(max_num_objects=40))
    [decoder_buckets] = limits["mask_decoder"]
    assert (decoder_buckets.quantity, decoder_buckets.low, decoder_buckets.high) == ("num_buckets", 1, 3)
    assert {d.input for d in decoder_buckets.dims} == {
        "image_embeddings",
        "high_res_features_0",
        "high_res_features_1",
        "extra_per_object_embeddings",
    }
    assert Sam31Driver().source_limits(_built_model())["mask_memory_encoder"][0].high == 1  # 16 objects: 1 bucket


def test_memory_length_grows_by_image_tokens_per_frame_and_16_tokens_per_pointer_frame():
    limits = {
        getattr(q, "quantity", "schedule"): q for q in Sam31Driver().source_limits(_built_model())["memory_attention"]
    }
    assert {(d.input, d.scale) for d in limits["memory_frames"].dims} == {
        (name, 72 * 72) for name in ("memory_image", "memory_image_pos", "memory", "memory_pos")
    }
    assert {(d.input, d.scale) for d in limits["object_pointer_frames"].dims} == {("memory", 16), ("memory_pos", 16)}
    rows = limits["schedule"].rows
    assert rows[:3] == [[1, 1], [2, 2], [3, 3]] and rows[6:8] == [[7, 7], [7, 8]] and rows[-1] == [7, 16]
    # With a temporal stride the frames taken are not min(t, 7): no schedule, the ranges alone.
    strided = Sam31Driver().source_limits(_built_model(stride=2))["memory_attention"]
    assert not any(hasattr(q, "rows") for q in strided)


# -- opt-in: tiny SAM 3.1 on CPU -------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_31_adaptation(tmp_path_factory) -> Path:
    """`omskills adapt` on tiny SAM 3.1 (the record's 4 frames) in a fresh process: the run folder."""
    source = os.environ.get(SOURCE_ENV)
    if not source:
        pytest.skip(
            f"{SOURCE_ENV} is not set: point it at a SAM 3.1 checkout "
            "(git clone https://github.com/facebookresearch/sam3) to run the SAM 3.1 tests"
        )
    out = tmp_path_factory.mktemp("sam31") / "adapt"
    result = omskills_cli(
        "adapt", str(TASK), "--scale", "tiny", "--out", str(out), env={**os.environ, SOURCE_ENV: source}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def tiny_31_main_path(tiny_31_adaptation) -> dict:
    """The main path of that adaptation's study run (PyTorch, instrumented): main_path.json."""
    return json.loads((tiny_31_adaptation / "study" / "main_path.json").read_text())


@pytest.mark.sam31
def test_tiny_31_tracks_objects_on_every_frame(tiny_31_main_path):
    steps = tiny_31_main_path["steps"]
    assert tiny_31_main_path["model_family"] == "sam3.1" and tiny_31_main_path["weights"] == "random"
    assert [s["index"] for s in steps] == [0, 1, 2, 3]
    ids = [next(o["values"] for o in s["outputs"] if o["name"] == "obj_ids") for s in steps]
    assert all(len(frame_ids) >= 1 for frame_ids in ids), ids


@pytest.mark.sam31
@pytest.mark.parametrize(
    "file, kind",
    [
        ("model/sam3_multiplex_base.py", "cuda_query"),  # CUDA device query at import time
        ("model/sam3_multiplex_tracking.py", "pin_memory"),  # pin_memory=True kwargs
        ("model/vitdet.py", "bf16_cast"),  # ViT MLP addmm_act bf16 path
        ("model/edt.py", "triton"),
        ("model_builder.py", "pkg_resources"),
        ("model_builder.py", "cuda_call"),  # demo_model.cuda()
    ],
)
def test_tiny_31_portability_findings_name_the_31_sites(tiny_31_main_path, file, kind):
    sites = [(f["file"], f["line"]) for f in tiny_31_main_path["portability_findings"] if f["kind"] == kind]
    assert any(site_file == file and line > 0 for site_file, line in sites), sites


@pytest.mark.sam31
def test_tiny_31_adapts_with_every_deployed_candidate_on_onnxruntime(tiny_31_adaptation):
    from omskills.records.task import load_record

    report = json.loads((tiny_31_adaptation / "verify" / "report.json").read_text())
    main = report["main_path"]
    checks = {c["output"]: c for c in main["checks"]}
    assert report["verdict"] == "pass" and main["fallbacks"] == 0
    assert checks["obj_ids"]["passed"] and checks["masks"]["worst"] >= 0.99
    record = load_record(tiny_31_adaptation / "task.yaml")
    graphs = {graph for name in record.intake.target.deploy for graph in record.graphs(name)}
    backends = report["backend_per_candidate"]
    assert {g: backends.get(g, "")[:12] for g in graphs} == {g: "onnxruntime:" for g in graphs}


@pytest.mark.sam31
def test_tiny_31_memory_attention_takes_every_memory_length_of_its_schedule(tiny_31_adaptation):
    from omskills.records.task import load_record

    record = load_record(tiny_31_adaptation / "task.yaml")
    [count] = [a for a in record.contracts["memory_attention"].non_tensor_args if "num_obj_ptr_tokens" in a.tree_path]
    assert not count.constant and count.derived is not None  # 16, 32, 48 tokens: computed from the shapes
    strategy = record.boundaries["memory_attention"].shape_strategy
    assert strategy.kind == "dynamic_dims" and len(strategy.gears) == 16  # frames 1..16: min(t, 7), min(t, 16)
    hw = record.contracts["memory_attention"].inputs[0].shape[0]
    assert [hw * 7, hw * 7 + 16 * 16] in [g[:2] for g in strategy.gears]  # memory_image, memory at t >= 16
