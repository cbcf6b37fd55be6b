"""Any model in: drivers are found by family (entry points) or named in the record, and a model
nobody here tuned for adapts with no change to omskills (issue "Any model in")."""

from __future__ import annotations

import json
import os
import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import omskills
from infer_session_double import DOUBLES
from omskills.errors import TaskRecordError
from omskills.models.generic import FunctionDriver
from omskills.models.registry import bind_intake, driver_for, family_driver, installed_drivers
from omskills.records.intake import Intake, ModelSpec
from omskills.sam.sam3 import Sam3Driver

REPO = Path(__file__).resolve().parents[1]

TOY_DRIVER = '''
"""A third-party driver, written against omskills.models.kit only."""
import time
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from omskills.models.kit import LoadedModel, MainPathRun, ModelDriver, OutputCheck, StepOutput


class ToyNet(nn.Module):
    def __init__(self):
        super().__init__()
        # Wide enough that the encoder's arithmetic, not the hooks' overhead, is what the profile
        # times: at 64 wide its share of a pass fell under the 2 % a seed needs on a busy machine.
        self.encoder = nn.Sequential(nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU())
        self.head = nn.Linear(512, 4)

    def forward(self, x):
        return self.head(self.encoder(x)).softmax(-1)


class ToyInputs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    batch: int = 3
    steps: int = 2


class ToyDriver(ModelDriver):
    family = "toy-mlp"
    description = "a toy MLP classifier from a third-party package"
    inputs_model = ToyInputs

    def source_root(self, spec):
        return Path(__file__).parent

    def load(self, spec):
        torch.manual_seed(spec.seed)
        net = ToyNet().eval()
        return LoadedModel(entry=net, root=net, source_root=self.source_root(spec), weights="random")

    def load_inputs(self, inputs, base_dir):
        generator = torch.Generator().manual_seed(1)
        return [torch.randn(inputs.batch, 16, generator=generator) for _ in range(inputs.steps)]

    def run_main_path(self, loaded, data, inputs, verification, hooks):
        steps, start = [], time.perf_counter()
        with torch.no_grad():
            for index, x in enumerate(data):
                t0 = time.perf_counter()
                probs = loaded.entry(x)
                steps.append(StepOutput(index=index, seconds=time.perf_counter() - t0,
                                        outputs={"probs": probs.numpy(), "label": probs.argmax(-1).numpy()}))
                hooks.step(index)
        return MainPathRun(steps=steps, setup_seconds=0.0, total_seconds=time.perf_counter() - start)

    def comparison(self, verification):
        return [OutputCheck(output="probs", metric="tensor", label="class probabilities"),
                OutputCheck(output="label", metric="exact", label="predicted class")]
'''


def driver_package(root: Path) -> Path:
    """A distribution on sys.path: the package and its metadata with an omskills.drivers entry point."""
    (root / "toy_omskills_driver").mkdir(parents=True)
    (root / "toy_omskills_driver" / "__init__.py").write_text(TOY_DRIVER)
    info = root / "toy_omskills_driver-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-omskills-driver\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[omskills.drivers]\ntoy-mlp = toy_omskills_driver:ToyDriver\n")
    return root


def task_record(folder: Path, model: dict, inputs: dict, **intake) -> Path:
    path = folder / "task.yaml"
    path.write_text(yaml.safe_dump({"id": "driver-test", "intake": {"model": model, "inputs": inputs, **intake}}))
    return path


# --------------------------------------------------------------------------- finding drivers


def test_sam3_and_sam31_register_through_the_entry_point_group_like_any_package():
    listed = {d.family: d for d in installed_drivers()}
    assert listed["sam3"].reference == "omskills.sam.sam3:Sam3Driver"
    assert listed["sam3.1"].reference == "omskills.sam.sam31:Sam31Driver"
    assert all(d.origin == "entry point of omskills" for d in (listed["sam3"], listed["sam3.1"]))
    assert isinstance(family_driver("sam3"), Sam3Driver)


def test_an_unknown_family_is_an_error_that_lists_the_installed_ones():
    with pytest.raises(
        TaskRecordError, match=r"intake.model.family: no model driver named 'yolo'; installed: .*sam3, sam3\.1"
    ):
        driver_for(ModelSpec(family="yolo"))


def test_a_driver_is_named_by_module_class_or_by_a_file_relative_to_the_record(tmp_path):
    (tmp_path / "mine.py").write_text(TOY_DRIVER)
    assert driver_for(ModelSpec(driver="omskills.sam.sam3:Sam3Driver")).family == "sam3"
    assert driver_for(ModelSpec(driver="mine.py:ToyDriver"), base_dir=tmp_path).family == "toy-mlp"
    (tmp_path / "two.py").write_text(
        "def build_model(spec):\n    return None\n\ndef run_main_path(model, inputs):\n    return None\n"
    )
    assert isinstance(driver_for(ModelSpec(driver="two.py"), base_dir=tmp_path), FunctionDriver)


@pytest.mark.parametrize(
    "model, message",
    [
        ({"driver": "missing.py:Driver"}, r"intake.model.driver: driver file not found: .*missing\.py"),
        ({"driver": "mine.py:Nothing"}, r"intake.model.driver: .*mine\.py defines no 'Nothing'"),
        ({"driver": "no_functions.py"}, r"defines no function build_model or run_main_path"),
        ({"driver": "os.path:join"}, r"is not a ModelDriver subclass"),
        ({"seed": 1}, r"set family .* or driver"),
    ],
)
def test_a_driver_that_cannot_be_found_or_used_says_which_field_and_why(tmp_path, model, message):
    (tmp_path / "mine.py").write_text(TOY_DRIVER)
    (tmp_path / "no_functions.py").write_text("X = 1\n")
    with pytest.raises((TaskRecordError, ValueError), match=message):
        driver_for(ModelSpec(**model), base_dir=tmp_path)


def test_the_driver_validates_intake_inputs_and_verification_naming_the_field():
    good = Intake(model=ModelSpec(family="sam3"), inputs={"video": "builtin:shapes", "prompt": "dog", "frames": 2})
    assert bind_intake(good).inputs.frames == 2
    with pytest.raises(
        TaskRecordError, match=r"intake.inputs.frames: Input should be a valid integer.* \(sam3 driver\)"
    ):
        bind_intake(good.model_copy(update={"inputs": {"video": "builtin:shapes", "prompt": "dog", "frames": "many"}}))
    with pytest.raises(TaskRecordError, match=r"intake.verification.forced: unknown field"):
        bind_intake(good.model_copy(update={"verification": {"forced": 3}}))


def test_omskills_drivers_lists_what_is_installed():
    result = omskills("drivers")
    assert result.returncode == 0, result.stderr
    assert "sam3.1" in result.stdout and "omskills.sam.sam31:Sam31Driver" in result.stdout


# --------------------------------------------------------------------------- a third-party package


@pytest.fixture(scope="module")
def third_party(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("thirdparty")
    site = driver_package(root / "site")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)}
    return task_record(root, {"family": "toy-mlp"}, {"batch": 64, "steps": 2}), env


def test_a_driver_package_installed_with_an_entry_point_is_listed(third_party):
    _, env = third_party
    result = omskills("drivers", env=env)
    assert "toy-mlp" in result.stdout and "entry point of toy-omskills-driver" in result.stdout


def test_a_third_party_driver_adapts_its_model_with_no_change_to_omskills(third_party, tmp_path):
    task, env = third_party
    result = omskills("adapt", str(task), "--out", str(tmp_path / "run"), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "verify" / "report.json").read_text())
    assert report["verdict"] == "pass"
    assert {c["title"] for c in report["main_path"]["checks"]} == {"class probabilities", "predicted class"}
    # No seed candidates: the study found the subtrees in a profile; the encoder is one graph.
    record = yaml.safe_load((tmp_path / "run" / "task.yaml").read_text())
    assert record["study"]["seeds_from"] == "profile"
    spliced = {c["name"]: c for c in report["candidates"]}
    assert "encoder" in spliced and all(c["backend"].startswith("onnxruntime:") for c in spliced.values())


# --------------------------------------------------------------------------- a scaffolded driver


def test_new_driver_and_validate_driver_give_resnet18_an_adaptation_with_no_edit(tmp_path):
    made = omskills(
        "new-driver",
        "resnet18",
        "--entry",
        "torchvision.models:resnet18",
        "--shape",
        "1,3,128,128",
        "--dir",
        str(tmp_path),
    )
    assert made.returncode == 0, made.stderr
    assert {p.name for p in tmp_path.iterdir()} == {"resnet18_driver.py", "resnet18.yaml", "test_resnet18_driver.py"}
    checked = omskills("validate-driver", str(tmp_path / "resnet18.yaml"))
    assert checked.returncode == 0 and checked.stdout.strip() == "ok", checked.stderr
    assert "candidate layer4 (layer4)" in checked.stderr and "exportable" in checked.stderr

    adapted = omskills("adapt", str(tmp_path / "resnet18.yaml"), "--out", str(tmp_path / "run"))
    assert adapted.returncode == 0, adapted.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "verify" / "report.json").read_text())
    assert report["verdict"] == "pass"
    assert {"layer1", "layer2", "layer3", "layer4"} <= {c["name"] for c in report["candidates"]}
    assert all(c["status"] == "integrated" and c["backend"].startswith("onnxruntime:") for c in report["candidates"])
    # layer1 feeds layer2, ... layer4 with nothing between them, and conv1 feeds layer1 through the
    # stem's batch norm, relu and max pool (glue, tensor-only): one composed graph runs all five.
    (chain,) = report["merged"]["graphs"]
    assert chain["graphs"] == ["conv1", "layer1", "layer2", "layer3", "layer4"] and chain["status"] == "verified"
    [hop] = [h for h in report["glue"]["hops"] if h["decision"] == "widened"]
    assert (hop["producer"], hop["consumer"]) == ("conv1", "layer1")
    assert report["merged"]["traffic"]["calls_per_step"] == report["traffic"]["calls_per_step"] - 4
    assert chain["precision_mode"] == "force_fp16" and chain["precision"]["passed"]  # emulated as one graph too

    # The run carries its driver file (as a bundle does): a tool called by hand on the run's record
    # finds it inside the run folder, where a driver file must be.
    task = str(tmp_path / "run" / "task.yaml")
    assert yaml.safe_load(Path(task).read_text())["intake"]["model"]["driver"] == "driver/resnet18_driver.py"

    # The same main path with every graph in its chosen ATC precision mode, emulated on CPU.
    emulated = omskills("tool", "verify_main_path", "--args", json.dumps({"task": task, "precision": "emulated"}))
    assert emulated.returncode == 0, emulated.stderr[-3000:]
    expected = json.loads((tmp_path / "run" / "verify" / "report-emulated.json").read_text())
    assert expected["precision"] == "emulated" and set(expected["precision_modes"]) == {
        c["name"] for c in report["candidates"]
    }
    assert all("emulated, not an NPU" in c["backend"] for c in expected["candidates"])
    # fp16 roundings move the logits far more than fp32 ONNX Runtime does: the emulated graphs really ran.
    assert expected["main_path"]["checks"][0]["worst"] > 10 * report["main_path"]["checks"][0]["worst"]
    assert json.loads((tmp_path / "run" / "verify" / "report.json").read_text()) == report  # fp32 report untouched

    # Node by node against the PyTorch submodules: the export computes what the model computes.
    layers = omskills(
        "tool",
        "compare_layers",
        "--args",
        json.dumps({"task": task, "candidate": "layer2", "against": "pytorch"}),
    )
    assert layers.returncode == 0, layers.stderr[-3000:]
    compared = json.loads(layers.stdout)
    assert compared["backend"] == "pytorch eager (CPU)" and compared["nodes_compared"] >= 6
    assert compared["nodes_flagged"] == 0 and compared["outputs_pass"] and compared["unmatched"] == 0
    # Against an NPU's dump: with none yet, the inputs to run the OM on are written and the command named.
    npu = omskills(
        "tool",
        "compare_layers",
        "--args",
        json.dumps({"task": task, "candidate": "layer2", "against": "npu_dump"}),
    )
    assert npu.returncode != 0 and "dump_dir:" in npu.stderr and "msit benchmark --om-model" in npu.stderr
    assert [p.name for p in (tmp_path / "run" / "precision" / "layer2" / "npu_inputs").iterdir()] == [
        "input_0_input.bin"
    ]

    # An "Ascend host" made of doubles (tests/fake_atc builds the OMs, tests/doubles runs them):
    # npu-check verifies on the OMs and runs the bundle's example on them, and says what ran.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(Path(__file__).with_name("fake_atc"), bin_dir / "atc")
    (bin_dir / "atc").chmod(0o755)
    host = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(DOUBLES))
    converted = omskills("tool", "convert_atc", "--task", task, env=host)
    assert converted.returncode == 0 and not json.loads(converted.stdout)["failed"], converted.stderr[-2000:]
    checked = omskills("npu-check", task, env=host)
    assert checked.returncode == 0, checked.stderr[-3000:]
    figures = json.loads((tmp_path / "run" / "npu" / "figures.json").read_text())
    assert figures["verdict"] == "pass" and figures["example_matches_verify"] and figures["example"]["fallbacks"] == 0
    assert set(figures["backend_per_candidate"].values()) == {"om:npu:0 (InferSession double, no NPU)"}
    assert set(figures["example"]["graphs"].values()) == {"om:npu:0 (InferSession double, no NPU)"}
    assert "InferSession double, no NPU" in (tmp_path / "run" / "npu" / "FIGURES.md").read_text()


def test_new_driver_refuses_an_entry_that_does_not_exist_and_never_overwrites(tmp_path):
    missing = omskills("new-driver", "mine", "--entry", "torchvision.models:resnet999", "--dir", str(tmp_path))
    assert missing.returncode == 2 and "torchvision.models' has no 'resnet999'" in missing.stderr
    assert (
        omskills("new-driver", "mine", "--entry", "torchvision.models:resnet18", "--dir", str(tmp_path)).returncode == 0
    )
    again = omskills("new-driver", "mine", "--entry", "torchvision.models:resnet18", "--dir", str(tmp_path))
    assert again.returncode == 2 and "not overwriting" in again.stderr


def test_validate_driver_lists_every_problem_it_finds(tmp_path):
    (tmp_path / "broken_driver.py").write_text(
        textwrap.dedent("""
        import torch
        COMPARISON = [{"output": "logits", "metric": "tensor"}]
        SEED_CANDIDATES = [("decoder", "decoder")]

        def build_model(spec):
            return torch.nn.Sequential(torch.nn.Linear(4, 4))

        def run_main_path(model, inputs):
            return {"scores": model(torch.randn(1, 4))}
    """)
    )
    task = task_record(tmp_path, {"driver": "broken_driver.py"}, {})
    result = omskills("validate-driver", str(task))
    assert result.returncode == 1 and result.stdout.startswith("FAILED")
    assert (
        "the comparison checks output 'logits', which the main path does not return (it returns ['scores'])"
        in result.stderr
    )
    assert "seed candidate decoder: no module 'decoder' in Sequential" in result.stderr


def test_a_checkpoint_that_is_not_a_state_dict_is_one_line_naming_the_path(tmp_path):
    (tmp_path / "net_driver.py").write_text(
        textwrap.dedent("""
        import torch
        def build_model(spec):
            return torch.nn.Linear(4, 4)
        def run_main_path(model, inputs):
            return model(torch.randn(1, 4))
    """)
    )
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    task = task_record(tmp_path, {"driver": "net_driver.py", "checkpoint": "garbage.pt"}, {})
    result = omskills("main-path", str(task), "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        f"intake.model.checkpoint: {tmp_path / 'garbage.pt'} is not a loadable state dict"
        in result.stderr.strip().splitlines()[-1]
    )


PICKY_DRIVER = """
import torch
def build_model(spec):
    {build}
    return torch.nn.Linear(4, 2)
def run_main_path(model, inputs):
    {run}
    return model(torch.ones(3, 4))
"""


@pytest.mark.parametrize(
    ("build", "run", "exit_code"),
    [
        # The driver's own check of what the user gave (a ValueError in its builder): one line, exit 2.
        ('raise ValueError("intake.model.builder_kwargs: this net needs a width, none given")', "pass", 2),
        # A crash inside the model's run: not the user's input, exit 1.
        ("pass", 'raise RuntimeError("the kernel image is not available")', 1),
    ],
    ids=["driver-error", "crash"],
)
def test_adapt_exits_as_the_tool_it_stopped_in_exits_when_called_by_hand(tmp_path, build, run, exit_code):
    """README and docs/drivers.md: a driver's error is one line and exit status 2, whether the tool
    is called by hand or `omskills adapt` runs it through the MCP server."""
    (tmp_path / "picky_driver.py").write_text(PICKY_DRIVER.format(build=build, run=run))
    task = task_record(tmp_path, {"driver": "picky_driver.py"}, {})
    by_hand = omskills("tool", "profile_main_path", "--task", str(task))
    adapted = omskills("adapt", str(task), "--out", str(tmp_path / "run"))

    assert by_hand.returncode == exit_code, by_hand.stderr[-2000:]
    assert adapted.returncode == exit_code, adapted.stderr[-2000:]
    last = adapted.stderr.strip().splitlines()[-1]
    assert last.startswith("omskills: error: Error executing tool profile_main_path: "), last
    message = (build if exit_code == 2 else run).split('"')[1]
    assert message in last
    # A crash keeps its traceback (the server logs it); a user's error is one line.
    assert ("Traceback" in adapted.stderr) == (exit_code == 1)


def test_weights_the_builder_loads_and_a_scalar_output_are_reported_as_they_are(tmp_path):
    """A two-function file whose `build_model` loads trained weights itself says so (`WEIGHTS`):
    no report calls them random. A 0-d output (a count) is an output like any other."""
    (tmp_path / "counter_driver.py").write_text(
        textwrap.dedent("""
        import torch
        WEIGHTS = "packaged: counter.pt in the model's wheel (trained)"

        def build_model(spec):
            net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
            with torch.no_grad():
                for p in net.parameters():
                    p.fill_(0.1)  # stands for the trained weights the builder reads
            return net

        def run_main_path(model, inputs):
            scores = model(torch.ones(3, 4))
            return {"scores": scores, "count": (scores[:, 0] > 0).sum()}
    """)
    )
    task = task_record(tmp_path, {"driver": "counter_driver.py"}, {})
    checked = omskills("validate-driver", str(task))
    assert checked.returncode == 0 and checked.stdout.strip() == "ok", checked.stderr[-2000:]
    ran = omskills("main-path", str(task), "--out", str(tmp_path / "out"))
    assert ran.returncode == 0, ran.stderr[-2000:]
    main = json.loads((tmp_path / "out" / "main_path.json").read_text())
    assert main["weights"] == "packaged: counter.pt in the model's wheel (trained)"
    [step] = main["steps"]
    count = next(o for o in step["outputs"] if o["name"] == "count")
    assert count["shape"] == [] and count["values"] == [3]


TRAINED_DRIVER = """
from pathlib import Path

import torch
from safetensors.torch import load_file  # bound before any build: the engine must still see it read

HERE = Path(WEIGHTS_FOLDER)  # adapt runs a copy of this file from the run folder
SEED_CANDIDATES = [("encoder", "encoder")]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
        self.head = torch.nn.Linear(256, 4)

    def forward(self, x):
        return self.head(self.encoder(x))


def build_model(spec):
    net = Net()
    net.encoder.load_state_dict(torch.load(HERE / "encoder.pt", weights_only=True))
    net.head.load_state_dict(load_file(str(HERE / "head.safetensors")))
    return net


def run_main_path(model, inputs):
    return {"logits": model(torch.linspace(-1, 1, 32).reshape(2, 16))}
"""


def trained_weights(folder: Path) -> dict[str, str]:
    """The two files TRAINED_DRIVER reads (saved from another seed than the engine's), by name: their sha256."""
    import hashlib

    import torch
    from safetensors.torch import save_file

    torch.manual_seed(123)
    encoder = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    torch.save(encoder.state_dict(), folder / "encoder.pt")
    save_file(torch.nn.Linear(256, 4).state_dict(), str(folder / "head.safetensors"))
    names = ("encoder.pt", "head.safetensors")
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in names}


def test_weights_a_two_function_builder_reads_are_named_by_file_and_hash_in_every_report(tmp_path):
    """Issue "trained weights labelled random": a `build_model` that reads its own checkpoint files
    (torch.load, safetensors) and declares no `WEIGHTS` is reported by those files and their hashes;
    the gate, which builds nothing, claims no random weights."""
    source = tmp_path / "model"
    source.mkdir()
    (source / "trained_driver.py").write_text(f"WEIGHTS_FOLDER = {str(source)!r}\n" + TRAINED_DRIVER)
    hashes = trained_weights(source)
    task = task_record(source, {"driver": "trained_driver.py"}, {})
    result = omskills("adapt", str(task), "--out", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr[-3000:]

    # Named from the run folder, as DELIVERY.md names every path.
    label = ", ".join(f"../model/{name} (sha256 {hashes[name][:12]})" for name in ("encoder.pt", "head.safetensors"))
    record = yaml.safe_load((tmp_path / "run" / "task.yaml").read_text())
    assert record["study"]["weights"] == label
    assert json.loads((tmp_path / "run" / "verify" / "report.json").read_text())["weights"] == label
    gate = [line for line in record["environment"]["checked"] if line.startswith("intake.model.checkpoint")]
    assert gate == [
        "intake.model.checkpoint: none (the weights are what the builder makes: the files it reads are named "
        "with their sha256 when the model is built, random from seed 0 if it reads none)"
    ]
    delivery = (tmp_path / "run" / "DELIVERY.md").read_text()
    assert f"weights **{label}**" in delivery
    assert "random" not in delivery.split("## ")[0] and "random weights" not in delivery


def test_weights_a_build_reads_nothing_for_are_random_from_the_engines_seed(tmp_path):
    """The other side of the rule: a build that reads no file and sets no state is "random", and
    the engine seeded it, so the same seed gives the same weights in every process."""
    (tmp_path / "random_driver.py").write_text(
        textwrap.dedent("""
        import torch

        def build_model(spec):
            return torch.nn.Linear(4, 2)

        def run_main_path(model, inputs):
            return {"y": model(torch.ones(1, 4))}
    """)
    )
    task = task_record(tmp_path, {"driver": "random_driver.py", "seed": 7}, {})
    runs = [omskills("main-path", str(task), "--out", str(tmp_path / out)) for out in ("a", "b")]
    assert all(run.returncode == 0 for run in runs), runs[0].stderr[-2000:]
    reports = [json.loads((tmp_path / out / "main_path.json").read_text()) for out in ("a", "b")]
    assert [r["weights"] for r in reports] == ["random", "random"]
    assert "random weights: the engine seeded the generators with 7 before the build" in reports[0]["notes"]
    assert reports[0]["steps"][0]["outputs"] == reports[1]["steps"][0]["outputs"]


def test_a_list_of_input_files_reaches_the_driver_as_files_from_the_records_folder(tmp_path):
    """A field typed `list[InputPath]` is resolved like one file: each item from the record's folder
    (whatever folder the command runs in), and absolute in a run folder's copy of the intake."""
    from omskills.models.registry import localised_intake

    task_dir = tmp_path / "task"
    (task_dir / "frames").mkdir(parents=True)
    for index in range(3):
        np.save(task_dir / "frames" / f"{index}.npy", np.full((1, 4), float(index), dtype=np.float32))
    (task_dir / "frames_driver.py").write_text(
        textwrap.dedent("""
        import numpy as np
        import torch
        from pydantic import BaseModel
        from omskills.models.kit import InputPath

        class Inputs(BaseModel):
            frames: list[InputPath]

        def build_model(spec):
            return torch.nn.Identity()

        def run_main_path(model, inputs):
            for frame in inputs.frames:  # one step per file
                yield {"frame": model(torch.from_numpy(np.load(frame)))}
    """)
    )
    frames = ["frames/0.npy", "frames/1.npy", "frames/2.npy"]
    task = task_record(task_dir, {"driver": "frames_driver.py"}, {"frames": frames})
    ran = omskills("main-path", str(task), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-2000:]
    steps = json.loads((tmp_path / "out" / "main_path.json").read_text())["steps"]
    assert [step["outputs"][0]["values"] for step in steps] == [[[float(i)] * 4] for i in range(3)]

    intake = Intake.model_validate(yaml.safe_load(task.read_text())["intake"])
    localised = localised_intake(intake, task_dir)
    assert localised.inputs["frames"] == [str((task_dir / f).resolve()) for f in frames]


def test_every_run_of_the_main_path_draws_the_same_noise_from_every_generator(tmp_path):
    """A model that dithers with numpy or Python's `random` (a pitch tracker, a sampler) gives the
    same outputs on every run: the engine seeds all three generators, not torch's alone."""
    from omskills.models.api import run_seeded
    from omskills.models.registry import bind_intake
    from omskills.records.intake import Intake

    (tmp_path / "noisy_driver.py").write_text(
        textwrap.dedent("""
        import random
        import numpy as np
        import torch

        def build_model(spec):
            return torch.nn.Linear(2, 2)

        def run_main_path(model, inputs):
            return {"dither": np.random.rand(3), "jitter": np.array(random.random()), "noise": torch.rand(2)}
    """)
    )
    intake = Intake.model_validate({"model": {"driver": "noisy_driver.py"}})
    bound = bind_intake(intake, tmp_path)
    loaded = bound.driver.load(intake.model)
    first, second = (
        run_seeded(bound.driver, loaded, {}, bound.inputs, bound.verification).steps[0].outputs for _ in range(2)
    )
    assert all(np.array_equal(first[name], second[name]) for name in ("dither", "jitter", "noise"))
