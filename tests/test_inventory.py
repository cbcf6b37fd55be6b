"""inventory_entries: a static scan of the model source with file:line evidence, and its report."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from omskills.errors import InputError, OmskillsError, TaskRecordError
from omskills.host.toolkit import load_tool, repo_root, skills_root
from omskills.records.inventory import Inventory, PortabilityFinding
from omskills.records.task import TaskRecord, load_record, save_record
from omskills.report.inventory import render_inventory_report
from omskills.source.inventory import scan_source
from omskills.source.packages import package_root

SCRIPT = skills_root() / "om-deployer" / "scripts" / "inventory_entries.py"
TOOL = load_tool(SCRIPT).func


def write_record(folder: Path, source: str = "package", builder: str = "build_sam3_video_model") -> Path:
    record = TaskRecord.model_validate(
        {
            "id": "inventory-test",
            "intake": {
                "model": {"family": "sam3", "source": source, "builder": builder, "scale": "tiny"},
                "inputs": {"video": "builtin:shapes", "prompt": "objects"},
            },
        }
    )
    path = folder / "task.yaml"
    save_record(record, path)
    return path


def source_line(inventory: Inventory, file: str, line: int) -> str:
    return (Path(inventory.source_root) / file).read_text().splitlines()[line - 1]


@pytest.fixture(scope="module")
def sam3_inventory(tmp_path_factory) -> tuple[Inventory, Path]:
    """The tool run once on the installed sam3 package."""
    path = write_record(tmp_path_factory.mktemp("inventory"))
    return TOOL(task=str(path)), path


# --- the installed SAM 3 package --------------------------------------------------------


def test_finds_the_configured_builder_with_its_signature(sam3_inventory):
    inventory, _ = sam3_inventory
    builder = next(b for b in inventory.builders if b.name == "build_sam3_video_model")
    assert builder.file == inventory.builder_file == "sam3/model_builder.py"
    assert {"checkpoint_path", "load_from_HF", "device"} <= set(builder.parameters)
    assert source_line(inventory, builder.file, builder.line).startswith("def build_sam3_video_model(")


def test_finds_the_video_predictor_and_the_requests_it_dispatches(sam3_inventory):
    inventory, _ = sam3_inventory
    predictor = inventory.predictor("Sam3VideoPredictor")
    assert predictor is not None and predictor.file == "sam3/model/sam3_video_predictor.py"
    routes = {r.request_type: r for r in predictor.routes}
    assert {"start_session", "add_prompt", "propagate_in_video", "close_session"} <= set(routes)
    assert routes["propagate_in_video"].dispatcher == "handle_stream_request"
    for request_type in ("start_session", "add_prompt", "propagate_in_video"):
        route = routes[request_type]
        assert route.method == request_type
        assert f'"{request_type}"' in source_line(inventory, route.file, route.line)


def test_a_predictor_that_delegates_to_super_serves_its_base_requests(sam3_inventory):
    inventory, _ = sam3_inventory
    multi = inventory.predictor("Sam3VideoPredictorMultiGPU")
    assert multi.delegates_to_base == ["handle_request", "handle_stream_request"]
    assert {"start_session", "add_prompt", "propagate_in_video"} <= set(multi.request_types)


def test_tokenizer_and_session_store_are_control_plane(sam3_inventory):
    inventory, _ = sam3_inventory
    tokenizer = {c.name for c in inventory.control("tokenizer")}
    assert "SimpleTokenizer" in tokenizer
    store = next(c for c in inventory.control("session_store") if c.name == "_ALL_INFERENCE_STATES")
    assert store.file == "sam3/model/sam3_video_predictor.py"
    assert "_ALL_INFERENCE_STATES" in source_line(inventory, store.file, store.line)
    assert "obj_id_to_idx" in {c.name for c in inventory.control("object_ids")}
    assert "add_prompt" in {c.name for c in inventory.control("prompt_management")}
    assert "load_video_frames" in {c.name for c in inventory.control("frame_cache")}
    # Networks are compute candidates, not control plane.
    assert "PromptEncoder" not in {c.name for c in inventory.control_plane}


@pytest.mark.parametrize(
    "kind, file, token",
    [
        ("cuda_call", "sam3/model/sam3_video_predictor.py", ".cuda()"),
        ("device_cuda", "sam3/model/position_encoding.py", 'device="cuda"'),
        ("pin_memory", "sam3/model/geometry_encoders.py", "pin_memory()"),
        ("triton", "sam3/model/edt.py", "import triton"),
        ("autocast", "sam3/model/sam3_video_inference.py", "torch.autocast"),
        ("cuda_query", "sam3/model/sam3_video_predictor.py", "torch.cuda."),
        ("flash_attention", "sam3/sam/transformer.py", "fa3"),
        ("bf16_cast", "sam3/model/sam3_tracking_predictor.py", "torch.bfloat16"),
    ],
)
def test_cuda_only_sites_are_portability_findings_with_file_line(sam3_inventory, kind, file, token):
    inventory, _ = sam3_inventory
    found = [f for f in inventory.portability if f.kind == kind and f.file == file]
    assert found, f"no {kind} finding in {file}"
    assert all(f.in_static_scan and not f.seen_at_runtime for f in found)
    assert any(token in source_line(inventory, f.file, f.line) for f in found)


def test_only_the_builders_import_closure_is_scanned(sam3_inventory):
    inventory, _ = sam3_inventory
    scanned = {f.file for f in inventory.portability} | {c.file for c in inventory.control_plane}
    assert not any(f.startswith(("sam3/eval/", "sam3/agent/")) for f in scanned)
    assert inventory.files_scanned < sum(1 for _ in (Path(inventory.source_root) / "sam3").rglob("*.py"))


def test_the_inventory_is_written_to_the_task_record(sam3_inventory):
    inventory, path = sam3_inventory
    record = load_record(path)
    assert record.inventory == inventory
    assert record.stages["inventory"].status == "done"


def test_the_tool_runs_as_a_cli_and_prints_json_only(tmp_path):
    path = write_record(tmp_path)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--task", str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["builder"] == "build_sam3_video_model"


# --- bad input --------------------------------------------------------------------------


def test_a_source_path_that_does_not_exist_is_an_error_and_the_record_stays_untouched(tmp_path):
    path = write_record(tmp_path, source=str(tmp_path / "missing-checkout"))
    before = path.read_bytes()
    with pytest.raises(InputError, match="missing-checkout"):
        TOOL(task=str(path))
    assert path.read_bytes() == before


def test_a_builder_not_in_the_source_is_an_error_and_the_record_stays_untouched(tmp_path):
    path = write_record(tmp_path, builder="build_sam4_model")
    before = path.read_bytes()
    with pytest.raises(OmskillsError, match=r"builder 'build_sam4_model' not found in .*sam3"):
        TOOL(task=str(path))
    assert path.read_bytes() == before


def test_a_record_without_intake_is_an_error(tmp_path):
    path = tmp_path / "task.yaml"
    path.write_text("id: no-intake\n")
    with pytest.raises(TaskRecordError, match="intake"):
        TOOL(task=str(path))
    assert path.read_text() == "id: no-intake\n"


def test_a_folder_without_the_package_is_an_error(tmp_path):
    with pytest.raises(InputError, match="does not contain the 'sam3' package"):
        package_root(str(tmp_path), "sam3")


# --- a checkout, and merging with what the portability layer saw at run time --------------

TOY_FILES = {
    "sam3/__init__.py": "",
    "sam3/model_builder.py": """\
        from sam3.model.predictor import ToyPredictor
        from .model import sites


        def build_sam3_video_model(checkpoint_path=None, *, device="cuda"):
            return ToyPredictor()
        """,
    "sam3/model/__init__.py": "",
    "sam3/model/predictor.py": """\
        class ToyPredictor:
            _SESSIONS = {}

            def handle_request(self, request):
                kind = request["type"]
                if kind == "start_session":
                    return self.start_session(request)
                elif kind == "close_session":
                    return self.close_session(request)

            def handle_stream_request(self, request):
                match request["type"]:
                    case "propagate_in_video":
                        yield from self.propagate_in_video(request)
        """,
    "sam3/model/sites.py": """\
        import torch


        def make_buffers():
            a = torch.zeros(2, device="cuda")
            b = (
                torch.ones(2)
                .cuda()
            )
            return a, b
        """,
    "sam3/train/trainer.py": "import triton\n",  # not imported by the builder: not scanned
}


@pytest.fixture()
def checkout(tmp_path) -> Path:
    for rel, text in TOY_FILES.items():
        path = tmp_path / "checkout" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path / "checkout"


def test_a_checkout_path_relative_to_the_record_is_scanned(checkout):
    path = write_record(checkout.parent, source="checkout")
    inventory = TOOL(task=str(path))
    assert inventory.source_root == str(checkout.resolve())
    assert package_root(str(checkout / "sam3"), "sam3") == checkout.resolve()
    routes = {(r.request_type, r.method) for r in inventory.predictor("ToyPredictor").routes}
    assert routes == {
        ("start_session", "start_session"),
        ("close_session", "close_session"),
        ("propagate_in_video", "propagate_in_video"),
    }
    assert [c.name for c in inventory.control("session_store")] == ["_SESSIONS"]
    kinds = {(f.kind, f.file, f.line) for f in inventory.portability}
    assert ("device_cuda", "sam3/model/sites.py", 5) in kinds
    assert ("cuda_call", "sam3/model/sites.py", 8) in kinds
    assert ("device_cuda", "sam3/model_builder.py", 5) in kinds  # the builder's device="cuda" default
    assert not any(f.kind == "triton" for f in inventory.portability)


def test_runtime_findings_of_the_portability_layer_mark_the_static_sites(checkout):
    import torch
    from omskills.source.portability import DevicePortability

    inventory = scan_source(
        checkout,
        "sam3",
        "build_sam3_video_model",
        family="sam3",
        entry_methods=("handle_request", "handle_stream_request"),
    )
    spec = importlib.util.spec_from_file_location("toy_sites", checkout / "sam3/model/sites.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with DevicePortability("cpu", checkout) as layer:
        a, b = module.make_buffers()
    assert a.device == b.device == torch.device("cpu")
    runtime = layer.findings()
    assert {(f.file, f.line) for f in runtime} >= {("sam3/model/sites.py", 5), ("sam3/model/sites.py", 8)}

    extra = PortabilityFinding(
        file=str(checkout / "sam3/model/other.py"),
        line=3,
        kind="cuda_query",
        detail="torch.cuda.current_device()",
        seen_at_runtime=True,
    )
    inventory.merge_runtime_findings(runtime + [extra])
    seen = {(f.kind, f.line): f for f in inventory.portability if f.file == "sam3/model/sites.py"}
    assert seen[("device_cuda", 5)].seen_at_runtime and "cpu" in seen[("device_cuda", 5)].action
    assert seen[("cuda_call", 8)].seen_at_runtime and seen[("cuda_call", 8)].in_static_scan
    builder_default = next(f for f in inventory.portability if f.file == "sam3/model_builder.py")
    assert not builder_default.seen_at_runtime  # never executed on this run
    runtime_only = [f for f in inventory.portability if not f.in_static_scan]
    assert [f.file for f in runtime_only] == [extra.file]


# --- report -----------------------------------------------------------------------------


def test_renders_a_markdown_report_with_a_compute_share_chart(sam3_inventory, tmp_path):
    import torch
    from omskills.profiling.profiler import ModuleProfiler
    from torch import nn

    inventory, _ = sam3_inventory
    net = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    with ModuleProfiler(net) as profiler:
        for _ in range(2):
            net(torch.zeros(1, 4))
            profiler.mark_frame()
    profile = profiler.report()
    rows = [
        ("vision_backbone", 0.62, "selected", "largest share | every frame"),
        ("text_encoder", 0.03, "deferred", "once per prompt"),
    ]
    report = render_inventory_report(inventory, profile, rows, tmp_path / "report")
    text = report.read_text()
    assert report.name == "inventory_report.md"
    assert "`Sam3VideoPredictor` (sam3/model/sam3_video_predictor.py:23)" in text
    assert "| `propagate_in_video` | handle_stream_request | `propagate_in_video` |" in text
    assert "| vision_backbone | 62.0% | selected | largest share \\| every frame |" in text
    assert "| `1.0` | Linear | 20 | 2 | 1.00 |" in text and "![compute share per candidate](compute_share.png)" in text
    assert (tmp_path / "report" / "compute_share.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- the skill ----------------------------------------------------------------------------


def test_the_om_deployer_skill_passes_agentskills_validate():
    agentskills = Path(sys.executable).parent / "agentskills"
    command = str(agentskills) if agentskills.exists() else shutil.which("agentskills")
    assert command, "skills-ref's agentskills command is not installed"
    done = subprocess.run(
        [command, "validate", str(repo_root() / "skills" / "om-deployer")], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Valid skill" in done.stdout


# --- a model a factory builds from dotted names (Hydra's instantiate) ---------------------

FACTORY_FILES = {
    "toyhydra/__init__.py": "",
    "toyhydra/build.py": """\
        import json
        from pathlib import Path

        from toyhydra.config import instantiate


        def build_toy(config="tiny.json"):
            return instantiate(json.loads((Path(__file__).parent / config).read_text())["predictor"])
        """,
    "toyhydra/config.py": """\
        import importlib


        def instantiate(node):
            '''hydra.utils.instantiate in small: the class a `_target_` string names, built.'''
            node = dict(node)
            module, _, name = node.pop("_target_").rpartition(".")
            kwargs = {k: instantiate(v) if isinstance(v, dict) else v for k, v in node.items()}
            return getattr(importlib.import_module(module), name)(**kwargs)
        """,
    # The classes are named in the config only: no import statement of the builder leads to them.
    "toyhydra/tiny.json": """\
        {"predictor": {"_target_": "toyhydra.predictor.ToyPredictor",
                       "net": {"_target_": "toyhydra.modeling.net.ToyNet", "width": 8}}}
        """,
    "toyhydra/predictor.py": """\
        from toyhydra.sessions import SessionStore


        class ToyPredictor:
            def __init__(self, net):
                self.net = net
                self.sessions = SessionStore()

            def handle_request(self, request):
                if request["type"] == "start_session":
                    return self.start_session(request)
                if request["type"] == "predict":
                    return self.predict(request)

            def start_session(self, request):
                return self.sessions.open()

            def predict(self, request):
                return self.net(request["x"])
        """,
    "toyhydra/sessions.py": """\
        import torch


        class SessionStore:
            def open(self):
                return torch.zeros(1).pin_memory()
        """,
    "toyhydra/modeling/__init__.py": "",
    "toyhydra/modeling/net.py": """\
        from torch import nn


        class ToyNet(nn.Module):
            def __init__(self, width=8):
                super().__init__()
                self.body = nn.Sequential(nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, width))

            def forward(self, x):
                return self.body(x)

            def moved(self, device="cuda"):
                return self.to(device)
        """,
    "toyhydra/train/trainer.py": "import triton\n",  # never loaded by building or running: not scanned
}


def factory_checkout(folder: Path) -> Path:
    for rel, text in FACTORY_FILES.items():
        path = folder / "checkout" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return folder / "checkout"


# A two-function driver: SOURCE_PACKAGE gives it a static inventory, ENTRY_CLASSES the predictor.
FACTORY_DRIVER = """\
import torch

SOURCE_PACKAGE = "toyhydra"
ENTRY_CLASSES = ("ToyPredictor",)
ENTRY_METHODS = ("handle_request",)
SEED_CANDIDATES = [("body", "body")]


def build_model(spec):
    from toyhydra.build import build_toy

    predictor = build_toy()
    return predictor, predictor.net


def run_main_path(predictor, inputs):
    return {"y": predictor.handle_request({"type": "predict", "x": torch.ones(2, 8)})}
"""


def test_a_model_built_from_dotted_names_is_inventoried_from_its_entry_classes(tmp_path, monkeypatch):
    """Issue "Hydra-built models": the builder's imports reach only the factory; the driver's entry
    class is scanned wherever it is defined, with what it imports, and the classes the model was
    seen to run are scanned once a study has profiled it."""
    monkeypatch.syspath_prepend(str(factory_checkout(tmp_path)))
    (tmp_path / "factory_driver.py").write_text(FACTORY_DRIVER)
    record = TaskRecord.model_validate(
        {"id": "factory", "intake": {"model": {"driver": "factory_driver.py", "source": "checkout"}, "inputs": {}}}
    )
    task = tmp_path / "task.yaml"
    save_record(record, task)

    inventory = TOOL(task=str(task))
    assert inventory.scanned_from == ["toyhydra/__init__.py", "toyhydra/predictor.py"]
    routes = {(r.request_type, r.method) for r in inventory.predictor("ToyPredictor").routes}
    assert routes == {("start_session", "start_session"), ("predict", "predict")}
    kinds = {(f.kind, f.file) for f in inventory.portability}
    assert ("pin_memory", "toyhydra/sessions.py") in kinds  # imported by the predictor's module
    assert not any(f.file.startswith(("toyhydra/modeling/", "toyhydra/train/")) for f in inventory.portability)

    profile = load_tool(skills_root() / "om-deployer" / "scripts" / "profile_main_path.py").func
    profile(task=str(task))
    rescanned = TOOL(task=str(task))
    assert "toyhydra/modeling/net.py" in rescanned.scanned_from  # ToyNet ran: its file is scanned now
    assert ("device_cuda", "toyhydra/modeling/net.py") in {(f.kind, f.file) for f in rescanned.portability}
    assert not any(f.file.startswith("toyhydra/train/") for f in rescanned.portability)


def test_entry_classes_named_but_defined_nowhere_say_so_in_the_report(tmp_path):
    checkout = factory_checkout(tmp_path)
    inventory = scan_source(
        checkout, "toyhydra", None, family="toy", entry_methods=("handle_request",), entry_classes=("Gone",)
    )
    assert inventory.predictors == []
    text = render_inventory_report(inventory, None, [], tmp_path / "report").read_text()
    assert "No class named Gone defines the driver's entry methods (handle_request) in the files scanned." in text
