"""Bad inputs are refused the way a user can act on: exit code 2, one line on stderr naming the
field, argument or path at fault, and the task record left byte for byte as it was.

Each case gets its own folder (its task record and the files it names). The cases marked
`batch` run in one child process, one after another, each through the CLI a user runs (a skill
script's `run_cli`, or `omskills ...`'s `main`) with file descriptor 2 captured, so torch and
the drivers are imported once; the `process` cases (records that fail before any import,
`omskills adapt`) each run in their own process. Nearly all fail before a model is built.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CLI = "import sys; from omskills.orchestrator.cli import main; sys.exit(main())"

GOOD_SAM3 = {
    "id": "bad-inputs",
    "intake": {
        "model": {"family": "sam3", "builder": "build_sam3_video_model", "scale": "tiny"},
        "inputs": {"video": "builtin:shapes", "prompt": "objects", "frames": 2},
        "target": {"soc": "Ascend910B4"},
    },
}
GOOD_NET = {
    "id": "bad-inputs-net",
    "intake": {"model": {"driver": "net.py"}, "inputs": {"size": 4}, "target": {"soc": "Ascend910B4"}},
}
# A two-function driver that imports torch only when it builds: its records fail fast.
NET_DRIVER = textwrap.dedent("""\
    from pydantic import BaseModel, ConfigDict, Field

    class Inputs(BaseModel):
        model_config = ConfigDict(extra="forbid")
        size: int = Field(4, ge=1, le=64)  # the most this driver will allocate

    def build_model(spec):
        import torch
        return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))

    def run_main_path(model, inputs):
        import torch
        return model(torch.zeros(1, inputs.size))
    """)
GOOD_CLIPS = {
    "id": "bad-inputs-clips",
    "intake": {"model": {"driver": "clips.py"}, "inputs": {"clips": ["short.gif"]}, "target": {"soc": "Ascend910B4"}},
}
# A two-function driver taking a list of files: each item is checked, resolved and confined like one file.
CLIPS_DRIVER = textwrap.dedent("""\
    from pydantic import BaseModel
    from omskills.models.kit import InputPath

    class Inputs(BaseModel):
        clips: list[InputPath]

    def build_model(spec):
        raise AssertionError("the gate builds no model")

    def run_main_path(model, inputs):
        raise AssertionError("the gate runs no model")
    """)
GOOD_CHECKED = {
    "id": "bad-inputs-checked",
    "intake": {"model": {"driver": "checked.py:Checked"}, "inputs": {"size": 4}, "target": {"soc": "Ascend910B4"}},
}
# A class driver whose own checks raise ValueError and TypeError, as driver authors write them.
CHECKED_DRIVER = textwrap.dedent("""\
    from pathlib import Path
    from pydantic import BaseModel, ConfigDict
    from omskills.models.kit import ModelDriver

    class Inputs(BaseModel):
        model_config = ConfigDict(extra="forbid")
        size: int = 4

    class Checked(ModelDriver):
        family = "checked"
        inputs_model = Inputs

        def source_root(self, spec):
            return Path(__file__).parent

        def check_inputs(self, inputs, base_dir):
            if inputs.size % 2:
                raise ValueError(f"intake.inputs.size: must be even, got {inputs.size}")
            return []

        def check_builder(self, spec):
            if not isinstance(spec.builder_kwargs.get("width", 1), int):
                raise TypeError("intake.model.builder_kwargs.width: must be an int")
            return "builder: checked"

        def load(self, spec):
            raise AssertionError("the gate builds no model")

        def load_inputs(self, inputs, base_dir):
            return inputs

        def run_main_path(self, loaded, data, inputs, verification, hooks):
            raise AssertionError("the gate runs no model")
    """)


def edit(path: str, value: object) -> Callable[[dict, Path], None]:
    """Set the dotted `path` of the record to `value` ("{case}"/"{outside}" are filled in)."""

    def apply(record: dict, folder: Path) -> None:
        *parents, last = path.split(".")
        node = record
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = fill(value, folder)

    return apply


def drop(path: str) -> Callable[[dict, Path], None]:
    def apply(record: dict, folder: Path) -> None:
        *parents, last = path.split(".")
        node = record
        for key in parents:
            node = node[key]
        del node[last]

    return apply


def fill(value: object, folder: Path) -> object:
    if isinstance(value, dict):
        return {k: fill(v, folder) for k, v in value.items()}
    if isinstance(value, list):
        return [fill(v, folder) for v in value]
    if isinstance(value, str):
        return value.replace("{case}", str(folder)).replace("{outside}", str(folder.parent / "outside"))
    return value


@dataclass(frozen=True)
class Case:
    id: str
    named: tuple[str, ...]  # what the one error line must contain
    edits: tuple[Callable[[dict, Path], None], ...] = ()
    base: dict = field(default_factory=lambda: GOOD_SAM3)
    raw: bytes | None = None  # the record file's bytes instead of the edited YAML
    # "script:<tool>" (the skill script's CLI) or "omskills" (the `omskills` CLI); then the arguments
    via: str = "script:check_environment"
    argv: tuple[str, ...] = ("--task", "{case}/task.yaml")
    process: bool = False  # its own process rather than the shared one
    xfail: str | None = None


EXPORT = {
    "exporter": "dynamo",
    "opset": 18,
    "seconds": 1.0,
    "bytes": 1,
    "sha256": "0",
    "external_data": False,
    "log_path": "onnx/g.log",
    "input_names": [],
    "output_names": [],
    "fact_source": "test",
}


MAIN_PATH = {
    "steps": 1,
    "steps_equal": True,
    "checks": [],
    "fallbacks": 0,
    "torch_s_per_step": 1.0,
    "spliced_s_per_step": 1.0,
    "latency_ratio": 1.0,
}
VERIFY = {
    **dict.fromkeys(("backend_per_candidate",), {}),
    **dict.fromkeys(("candidates", "comparison", "per_step", "splice_stats", "fallback_events"), []),
    "task_id": "bad-inputs",
    "weights": "random",
    "scale": "tiny",
    "backend": "onnxruntime",
    "main_path": MAIN_PATH,
    "verification_settings": [],
    "report_json": "verify/report.json",
    "report_html": "verify/report.html",
    "verdict": "pass",
}
MERGED = {"name": "a_to_b", "graphs": ["a", "b"], "io_maps": [{"x": "y"}], "status": "verified", "reason": ""}


def _merged(**graph: object) -> dict:
    return {"graphs": [{**MERGED, **graph}], "verdict": "pass", "fallbacks": 0}


ATC = {"status": "not_run", "command": ["atc", "--model=onnx/g/g.onnx"], "script": "om/g/convert_g.sh"}


def _record_text(**changes: str) -> bytes:
    """GOOD_SAM3 as YAML text, with lines replaced (`old line` -> `new lines`)."""
    text = yaml.safe_dump(GOOD_SAM3, sort_keys=False)
    for old, new in changes.items():
        assert old in text, old
        text = text.replace(old, new, 1)
    return text.encode()


# 500 bytes that expand to 9^9 strings when read naively.
ALIAS_BOMB = (
    "a: &a [x, x, x, x, x, x, x, x, x]\n"
    + "".join(f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8))
    + "id: bomb\nintake: {model: {family: sam3}}\n"
).encode()
DUPLICATE_SEED = _record_text(**{"    scale: tiny\n": "    scale: tiny\n    seed: 1\n    seed: 2\n"})
DUPLICATE_KWARG = _record_text(
    **{"    scale: tiny\n": "    scale: tiny\n    builder_kwargs:\n      compile: false\n      compile: true\n"}
)

CASES = [
    # -- the target and the inputs of a SAM 3 record
    Case(
        "soc-unknown", ("intake.target.soc", "Ascend999X", "did you mean"), (edit("intake.target.soc", "Ascend999X"),)
    ),
    Case(
        "soc-lowercase", ("intake.target.soc", "did you mean Ascend910B4"), (edit("intake.target.soc", "ascend910b4"),)
    ),
    Case("frames-huge", ("intake.inputs.frames",), (edit("intake.inputs.frames", 1_000_000_000),)),
    Case("frames-zero", ("intake.inputs.frames",), (edit("intake.inputs.frames", 0),)),
    Case("frames-text", ("intake.inputs.frames",), (edit("intake.inputs.frames", "many"),)),
    Case("frames-beyond-builtin-clip", ("intake.inputs.frames", "30"), (edit("intake.inputs.frames", 31),)),
    Case(
        "frames-beyond-video",
        ("intake.inputs.frames", "short.gif", "has 3"),
        (edit("intake.inputs.video", "short.gif"), edit("intake.inputs.frames", 8)),
    ),
    Case("video-missing", ("intake.inputs.video", "missing.mp4"), (edit("intake.inputs.video", "missing.mp4"),)),
    Case("video-garbage", ("intake.inputs.video", "garbage.mp4"), (edit("intake.inputs.video", "garbage.mp4"),)),
    Case("video-wrong-type", ("intake.inputs.video", "notes.txt"), (edit("intake.inputs.video", "notes.txt"),)),
    Case("video-empty-folder", ("intake.inputs.video", "empty"), (edit("intake.inputs.video", "empty"),)),
    Case("video-unknown-builtin", ("intake.inputs.video", "nope"), (edit("intake.inputs.video", "builtin:nope"),)),
    Case("video-outside", ("intake.inputs.video", "outside"), (edit("intake.inputs.video", "{outside}/clip.gif"),)),
    Case(
        "video-a-fifo",
        ("intake.inputs.video", "pipe.mp4", "not a regular file"),
        (edit("intake.inputs.video", "pipe.mp4"),),
    ),
    Case(
        "driver-file-outside",
        ("intake.model.driver", "outside"),
        (drop("intake.model.family"), edit("intake.model.driver", "{outside}/evil.py")),
    ),
    Case(
        "record-id-too-long",
        ("id", "at most"),
        (edit("id", "a" * 300),),
    ),
    Case(
        "video-symlink-out", ("intake.inputs.video", "link.gif", "symlink"), (edit("intake.inputs.video", "link.gif"),)
    ),
    Case("prompt-empty", ("intake.inputs.prompt",), (edit("intake.inputs.prompt", "  "),)),
    Case("inputs-unknown-field", ("intake.inputs.colour",), (edit("intake.inputs.colour", "red"),)),
    # -- the model
    Case("family-unknown", ("intake.model.family", "nope"), (edit("intake.model.family", "nope"),)),
    Case("scale-unknown", ("intake.model.scale",), (edit("intake.model.scale", "huge"),)),
    Case("seed-text", ("intake.model.seed",), (edit("intake.model.seed", "x"),)),
    Case("model-unknown-field", ("intake.model.colour",), (edit("intake.model.colour", "red"),)),
    Case(
        "checkpoint-missing",
        ("intake.model.checkpoint", "missing.pt"),
        (edit("intake.model.checkpoint", "missing.pt"),),
    ),
    Case(
        "checkpoint-garbage",
        ("intake.model.checkpoint", "garbage.pt", "not a loadable state dict"),
        (edit("intake.model.checkpoint", "garbage.pt"),),
    ),
    Case(
        "checkpoint-outside",
        ("intake.model.checkpoint", "outside"),
        (edit("intake.model.checkpoint", "{outside}/net.pt"),),
    ),
    Case("source-outside", ("intake.model.source", "outside"), (edit("intake.model.source", "{outside}"),)),
    Case(
        "builder-unknown", ("intake.model.builder", "build_nothing"), (edit("intake.model.builder", "build_nothing"),)
    ),
    Case(
        "driver-file-missing",
        ("intake.model.driver", "nope.py"),
        (drop("intake.model.family"), edit("intake.model.driver", "nope.py")),
    ),
    Case("device-id-negative", ("intake.target.device_id",), (edit("intake.target.device_id", -1),)),
    Case(
        "verification-negative",
        ("intake.verification.force_top_k_detections",),
        (edit("intake.verification.force_top_k_detections", -1),),
    ),
    Case("verification-unknown-field", ("intake.verification.colour",), (edit("intake.verification.colour", 1),)),
    # -- the record itself
    Case("record-id-invalid", ("id",), (edit("id", "bad id!"),)),
    Case("record-no-intake", ("intake",), (drop("intake"),)),
    Case("record-not-a-mapping", ("task.yaml", "mapping"), raw=b"- one\n- two\n"),
    Case(
        "exports-path-outside",
        ("exports.g.path", "outside"),
        (edit("exports", {"g": {"path": "{outside}/g.onnx", **EXPORT}}),),
    ),
    # -- a two-function driver's record: the checkpoint's keys, the driver's own bound
    Case(
        "checkpoint-wrong-keys",
        ("intake.model.checkpoint", "wrong.pt", "missing key", "unexpected key"),
        (edit("intake.model.checkpoint", "wrong.pt"),),
        base=GOOD_NET,
    ),
    Case(
        "inputs-beyond-driver-bound",
        ("intake.inputs.size",),
        (edit("intake.inputs.size", 1_000_000_000),),
        base=GOOD_NET,
    ),
    Case(
        "shape-inputs-bad-field",
        ("intake.shape_inputs[1].size",),
        (edit("intake.shape_inputs", [{"size": 2}, {"size": "x"}]),),
        base=GOOD_NET,
    ),
    # -- a list of input files: the item at fault named by its index
    Case(
        "input-list-item-missing",
        ("intake.inputs.clips[1]", "gone.gif", "not found"),
        (edit("intake.inputs.clips", ["short.gif", "gone.gif"]),),
        base=GOOD_CLIPS,
    ),
    Case(
        "input-list-item-outside",
        ("intake.inputs.clips[1]", "outside"),
        (edit("intake.inputs.clips", ["short.gif", "{outside}/clip.gif"]),),
        base=GOOD_CLIPS,
    ),
    # -- a class driver's own checks raising ValueError / TypeError
    Case(
        "driver-check-value-error",
        ("intake.inputs.size", "must be even", "checked driver"),
        (edit("intake.inputs.size", 3),),
        base=GOOD_CHECKED,
    ),
    Case(
        "driver-check-type-error",
        ("intake.model.builder_kwargs.width", "must be an int"),
        (edit("intake.model.builder_kwargs", {"width": "wide"}),),
        base=GOOD_CHECKED,
    ),
    Case(
        "driver-check-shape-inputs",
        ("intake.shape_inputs[0]", "must be even"),
        (edit("intake.shape_inputs", [{"size": 5}]),),
        base=GOOD_CHECKED,
    ),
    # -- tool arguments
    Case("args-null", ("--args",), via="script:inspect_onnx", argv=("--args", "null")),
    Case("args-five-omskills-tool", ("--args",), via="omskills", argv=("tool", "check_environment", "--args", "5")),
    Case("args-unknown-argument", ("tsk",), argv=("--args", '{"task": "{case}/task.yaml", "tsk": 1}')),
    Case("args-task-not-a-path", ("task",), argv=("--args", '{"task": [1]}')),
    Case("task-record-missing", ("nope.yaml",), argv=("--task", "{case}/nope.yaml")),
    Case(
        "validate-driver-missing-record",
        ("task record not found", "nope.yaml"),
        via="omskills",
        argv=("validate-driver", "{case}/nope.yaml"),
    ),
    Case(
        "validate-driver-fifo-record",
        ("pipe.mp4", "is not a regular file"),
        via="omskills",
        argv=("validate-driver", "{case}/pipe.mp4"),
    ),
    Case("onnx-garbage", ("bad.onnx",), via="script:inspect_onnx", argv=("--path", "{case}/bad.onnx")),
    Case("onnx-missing", ("missing.onnx",), via="script:inspect_onnx", argv=("--path", "{case}/missing.onnx")),
    Case(
        "new-driver-out-dir-a-file",
        ("afile",),
        via="script:new_driver",
        argv=("--name", "net", "--entry", "torchvision.models:resnet18", "--out-dir", "{case}/afile"),
    ),
    # -- hostile records: names that would be paths, paths that would leave, bombs, versions
    Case(
        "deploy-name-climbs",
        ("intake.target.deploy[0]", "not a safe name"),
        (edit("intake.target.deploy", ["../../../outside/esc"]),),
    ),
    Case(
        "graph-name-climbs",
        ("exports.../x", "not a safe name"),
        (edit("exports", {"../x": {"path": "onnx/g.onnx", **EXPORT}}),),
    ),
    Case(
        "stored-path-climbs",
        ("exports.g.path", "not a path inside the run folder"),
        (edit("exports", {"g": {"path": "../../etc/passwd", **EXPORT}}),),
    ),
    Case(
        "merged-graph-name-climbs",
        ("verification.merged.graphs[0].name", "not a safe name"),
        (edit("verification", {**VERIFY, "merged": _merged(name="../../../../outside/x")}),),
    ),
    Case(
        "merged-graph-onnx-outside",
        ("verification.merged.graphs[0].onnx_path", "not a path inside the run folder"),
        (edit("verification", {**VERIFY, "merged": _merged(onnx_path="/etc/passwd")}),),
    ),
    Case(
        "merged-keep-dtype-outside",
        ("verification.merged.graphs[0].atc_command", "--keep_dtype", "not a path inside the run folder"),
        (
            edit(
                "verification",
                {**VERIFY, "merged": _merged(atc_command=["atc", "--keep_dtype=../../x.cfg"])},
            ),
        ),
    ),
    Case(
        "atc-command-runs-something-else",
        ("toolchain.g.atc.command", "starts with 'atc'"),
        (edit("toolchain", {"g": {"atc": {**ATC, "command": ["sh", "-c", "touch {outside}/ran"]}}}),),
    ),
    Case(
        "atc-keep-dtype-absolute",
        ("toolchain.g.atc.command", "--keep_dtype", "not a path inside the run folder"),
        (edit("toolchain", {"g": {"atc": {**ATC, "command": ["atc", "--keep_dtype={outside}/keep.cfg"]}}}),),
    ),
    Case(
        "video-colon-outside", ("intake.inputs.video", "outside"), (edit("intake.inputs.video", "{outside}/a:b.gif"),)
    ),
    Case("yaml-alias-bomb", ("task.yaml", "YAML aliases expand"), raw=ALIAS_BOMB),
    Case("yaml-duplicate-key", ("task.yaml", "duplicate key 'seed'", "lines"), raw=DUPLICATE_SEED),
    Case("yaml-duplicate-builder-kwarg", ("duplicate key 'compile'",), raw=DUPLICATE_KWARG),
    Case("schema-version-text", ("schema_version", "'two'", "reads 2"), (edit("schema_version", "two"),)),
    Case("schema-version-future", ("schema_version", "99", "newer than this release"), (edit("schema_version", 99),)),
    Case("seed-36-digits", ("intake.model.seed",), (edit("intake.model.seed", 10**35),)),
    Case("device-shell-command", ("intake.model.device",), (edit("intake.model.device", "rm -rf /"),)),
    Case("device-cuda-absent", ("intake.model.device", "no CUDA device"), (edit("intake.model.device", "cuda"),)),
    Case(
        "builder-kwargs-unknown",
        ("intake.model.builder_kwargs", "colour"),
        (edit("intake.model.builder_kwargs", {"colour": 1}),),
    ),
    Case(
        "video-truncated",
        ("intake.inputs.video", "truncated.mp4", "decode"),
        (edit("intake.inputs.video", "truncated.mp4"), edit("intake.inputs.frames", 6)),
    ),
    Case("task-name-too-long", ("File name too long",), argv=("--task", "{case}/" + "x" * 300 + ".yaml")),
    Case("args-nested-50000-deep", ("--args", "nested too deeply"), argv=("--args", "[" * 50_000 + "]" * 50_000)),
    Case("flag-value-a-number", ("123", "not found"), via="script:inspect_onnx", argv=("--path", "{case}/123")),
    Case(
        "serve-port-beyond-65535",
        ("--http", "70000", "not a TCP port"),
        via="omskills",
        argv=("serve", "--http", "127.0.0.1:70000"),
    ),
    Case(
        "candidate-argument-climbs",
        ("candidate", "not a safe name"),
        via="script:export_onnx",
        argv=("--task", "{case}/task.yaml", "--candidate", "../../outside/esc"),
    ),
    # -- in their own process
    Case("record-not-utf8", ("task.yaml",), raw=b"id: caf\xe9\nintake: {}\n", process=True),
    Case("record-not-yaml", ("task.yaml",), raw=b"id: [unclosed\nintake:\n  model: {\n", process=True),
    Case(
        "adapt-frames-huge",
        ("intake.inputs.frames",),
        via="omskills",
        process=True,
        argv=("adapt", "{case}/task.yaml", "--frames", "1000000000", "--out", "{case}/run"),
    ),
    Case(
        "adapt-out-a-file",
        ("--out", "afile"),
        via="omskills",
        process=True,
        argv=("adapt", "{case}/task.yaml", "--out", "{case}/afile"),
    ),
]

# One child runs the batch: each case through the CLI a user runs, stderr's descriptor captured.
RUNNER = textwrap.dedent("""\
    import json, os, sys, tempfile, traceback
    from omskills.host.toolkit import load_tool, run_cli, skills_root
    from omskills.orchestrator.cli import main

    def run(case):
        if case["via"] == "omskills":
            return main(case["argv"])
        tool = load_tool(next(skills_root().glob(f"*/scripts/{case['via'].split(':')[1]}.py")))
        return run_cli(tool.func, case["argv"], prog=tool.name)

    results = {}
    for case in json.load(open(sys.argv[1])):
        sys.stderr.flush()
        saved = os.dup(2)
        with tempfile.TemporaryFile() as captured:
            os.dup2(captured.fileno(), 2)
            try:
                code = run(case)
            except SystemExit as stop:
                code = stop.code
            except BaseException:
                traceback.print_exc()
                code = "traceback"
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
            captured.seek(0)
            results[case["id"]] = {"code": code, "stderr": captured.read().decode(errors="replace")}
    json.dump(results, open(sys.argv[2], "w"))
    """)


def _write_files(folder: Path, shared: Path) -> None:
    """The files cases name, in the case's own folder (its workspace)."""
    (folder / "garbage.mp4").write_bytes(os.urandom(2048))
    (folder / "notes.txt").write_text("not a video\n")
    (folder / "empty").mkdir()
    (folder / "short.gif").write_bytes((shared / "short.gif").read_bytes())
    (folder / "garbage.pt").write_bytes(b"\x80\x04not a checkpoint" * 64)
    (folder / "wrong.pt").write_bytes((shared / "wrong.pt").read_bytes())
    (folder / "net.py").write_text(NET_DRIVER)
    (folder / "checked.py").write_text(CHECKED_DRIVER)
    (folder / "clips.py").write_text(CLIPS_DRIVER)
    (folder / "bad.onnx").write_bytes(os.urandom(1024))
    (folder / "afile").write_text("a file, not a folder\n")
    (folder / "link.gif").symlink_to(shared.parent / "outside" / "clip.gif")
    (folder / "truncated.mp4").write_bytes((shared / "truncated.mp4").read_bytes())
    os.mkfifo(folder / "pipe.mp4")  # opened, it would block until someone writes


def _record_bytes(case: Case, folder: Path) -> bytes:
    if case.raw is not None:
        return case.raw
    record = json.loads(json.dumps(case.base))
    for change in case.edits:
        change(record, folder)
    return yaml.safe_dump(record, sort_keys=False).encode()


def _argv(case: Case, folder: Path) -> list[str]:
    return [str(fill(a, folder)) for a in case.argv]


def _shared_files(root: Path) -> Path:
    import numpy as np
    import torch
    from PIL import Image

    shared, outside = root / "shared", root / "outside"
    shared.mkdir()
    outside.mkdir()
    frames = [Image.fromarray(np.full((32, 32, 3), 40 * i, dtype=np.uint8)) for i in range(3)]
    frames[0].save(shared / "short.gif", save_all=True, append_images=frames[1:])
    frames[0].save(outside / "clip.gif", save_all=True, append_images=frames[1:])
    _truncated_mp4(shared / "truncated.mp4")
    torch.save({"fc.weight": torch.zeros(2, 4), "fc.bias": torch.zeros(2)}, shared / "wrong.pt")
    torch.save({}, outside / "net.pt")
    # A driver outside the workspace: importing it would leave a sentinel beside it.
    (outside / "evil.py").write_text("import pathlib\npathlib.Path(__file__).with_name('ran').write_text('ran')\n")
    return shared


def _truncated_mp4(path: Path) -> None:
    """An mp4 whose header (moov first) still says 12 frames, cut a quarter into its frames' data,
    as a download that stopped would be: the gate must decode the frames asked, not trust the header."""
    import av
    import numpy as np

    rng = np.random.default_rng(0)
    with av.open(str(path), mode="w", options={"movflags": "faststart"}) as container:
        stream = container.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
        for _ in range(12):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    data = path.read_bytes()
    frames_data = data.find(b"mdat")
    path.write_bytes(data[: frames_data + (len(data) - frames_data) // 4])


def _process_command(case: Case, folder: Path) -> list[str]:
    if case.via == "omskills":
        return [sys.executable, "-c", CLI, *_argv(case, folder)]
    tool = case.via.split(":")[1]
    script = next((REPO / "skills").glob(f"*/scripts/{tool}.py"))
    return [sys.executable, str(script), *_argv(case, folder)]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, tuple[object, str, bytes, bytes]]:
    """Per case: exit code, stderr, the record's bytes before and after."""
    root = tmp_path_factory.mktemp("bad-inputs")
    shared = _shared_files(root)
    before: dict[str, bytes] = {}
    batch = []
    for case in CASES:
        folder = root / case.id
        folder.mkdir()
        _write_files(folder, shared)
        before[case.id] = _record_bytes(case, folder)
        (folder / "task.yaml").write_bytes(before[case.id])
        if not case.process:
            batch.append({"id": case.id, "via": case.via, "argv": _argv(case, folder)})
    (root / "cases.json").write_text(json.dumps(batch))
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, str(root / "cases.json"), str(root / "results.json")],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((root / "results.json").read_text())
    for case in (c for c in CASES if c.process):
        ran = subprocess.run(
            _process_command(case, root / case.id), capture_output=True, text=True, cwd=root, timeout=300
        )
        results[case.id] = {"code": ran.returncode, "stderr": ran.stderr}
    assert not (root / "outside" / "ran").exists(), "a driver outside the workspace was imported"
    return {
        c.id: (results[c.id]["code"], results[c.id]["stderr"], before[c.id], (root / c.id / "task.yaml").read_bytes())
        for c in CASES
    }


def test_the_table_is_at_least_thirty_cases():
    assert len(CASES) >= 30 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.id, marks=[pytest.mark.xfail(reason=c.xfail)] if c.xfail else []) for c in CASES]
)
def test_bad_input_is_one_line_naming_it_and_the_record_is_untouched(case: Case, outcomes):
    code, stderr, before, after = outcomes[case.id]
    lines = stderr.strip().splitlines()
    assert code == 2, f"exit {code}: {stderr[-2000:]}"
    assert len(lines) == 1, f"{len(lines)} lines on stderr:\n{stderr[-2000:]}"
    assert len(lines[0]) < 600, lines[0]
    for word in case.named:
        assert word in lines[0], f"{word!r} not in: {lines[0]}"
    assert after == before


# -- one owner per run folder ----------------------------------------------------------------


def _good_record(folder: Path, **target: str) -> Path:
    record = json.loads(json.dumps(GOOD_SAM3))
    record["intake"]["target"].update(target)
    path = folder / "task.yaml"
    path.write_text(yaml.safe_dump(record, sort_keys=False))
    return path


def test_a_second_adapt_on_a_locked_run_folder_is_refused_with_the_owners_pid(tmp_path):
    task, run = _good_record(tmp_path), tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from omskills.orchestrator.run_lock import claim_run_folder; "
            "claim_run_folder(Path(sys.argv[1])); print('held', flush=True); time.sleep(120)",
            str(run),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        second = subprocess.run(
            [sys.executable, "-c", CLI, "adapt", str(task), "--out", str(run)],
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        holder.send_signal(signal.SIGTERM)
        holder.wait(timeout=30)
    lines = second.stderr.strip().splitlines()
    assert second.returncode == 2, second.stderr[-2000:]
    assert len(lines) == 1 and f"run folder {run} is in use by omskills adapt (pid {holder.pid}" in lines[0], lines
    assert not (run / "task.yaml").exists()  # the refused adapt wrote nothing


def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_line(tmp_path, capsys):
    from omskills.orchestrator.run_lock import LOCK_NAME, claim_run_folder

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": dead_pid, "host": os.uname().nodename, "since": "earlier"}))
    lock = claim_run_folder(tmp_path)
    try:
        said = capsys.readouterr().err
        assert f"taking over run folder {tmp_path} from pid {dead_pid} (no longer running" in said
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    finally:
        lock.release()


def test_adapt_with_an_unknown_soc_stops_at_the_gate_with_a_did_you_mean(tmp_path):
    task, run = _good_record(tmp_path, soc="Ascend910B9"), tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-c", CLI, "adapt", str(task), "--out", str(run)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode != 0
    assert "intake.target.soc: unknown SoC 'Ascend910B9'" in done.stderr and "did you mean Ascend910B" in done.stderr
    record = yaml.safe_load((run / "task.yaml").read_text())
    assert not {"inventory", "profile", "study"} & set(record.get("stages") or {}), "a step after the gate ran"
