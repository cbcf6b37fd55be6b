"""The tool surface a client sees: fast discovery, titles and annotations, a description on every
parameter, enums where the values are known, and one readable line per bad argument.

No model runs here: the tools are listed, and called only with arguments they refuse.
"""

from __future__ import annotations

import inspect
import json
import shutil
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, get_args

import anyio
import pytest
from mcp_helpers import write_task_record, write_tool
from omskills.ascend.atc import KNOWN_SOCS, PRECISION_MODES
from omskills.host.mcp_server import is_path_parameter
from omskills.host.toolkit import discover_tools, load_tool, skills_root, tool_files, tool_listing
from omskills.orchestrator.mcp_client import connect
from omskills.orchestrator.skills_admin import new_skill, validate_skills
from omskills.records.choices import EmulatedMode

CLI = [sys.executable, "-c", "import sys; from omskills.orchestrator.cli import main; sys.exit(main())"]
HEAVY = ("torch", "onnx", "onnxruntime")
NEW_SKILL = "demo-surface"
NEW_TOOL = "demo_surface_task_summary"


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


# --------------------------------------------------------------------------- through the real MCP client


@pytest.fixture(scope="module")
def surface(tmp_path_factory) -> Path:
    """The shipped skills copied, plus one made by `omskills new-skill`, and a workspace."""
    root = tmp_path_factory.mktemp("surface")
    skills = root / "skills"
    shutil.copytree(skills_root(), skills, ignore=shutil.ignore_patterns("__pycache__", "tests"))
    made = run(*CLI, "new-skill", NEW_SKILL, "--description", "Demo: summarise a task.", "--skills-dir", str(skills))
    assert made.returncode == 0, made.stderr
    write_task_record(root / "ws" / "task.yaml")
    return root


@pytest.fixture(scope="module")
def listed(surface) -> dict[str, Any]:
    """tools/list from `omskills serve` over the shipped skills plus the new skill's."""
    skills, workspace = surface / "skills", surface / "ws"

    async def list_tools() -> list[Any]:
        async with connect(workspace, skills) as client:
            return (await client.session.list_tools()).tools

    return {t.name: t for t in anyio.run(list_tools)}


def _skill_tools(listed: dict[str, Any]) -> dict[str, Any]:
    # The server's own job tools (start_job, ...) are not skill scripts; they are checked too, below.
    return {name: t for name, t in listed.items() if (t.meta or {}).get("omskills/skill")}


def test_every_skill_tool_and_the_new_skills_is_listed(listed):
    names = set(_skill_tools(listed))
    assert names == {p.stem for p in tool_files()} | {NEW_TOOL}


def test_every_tool_has_a_title_and_annotations(listed):
    for name, tool in listed.items():
        assert tool.title, name
        assert tool.annotations is not None, name
        assert tool.annotations.title == tool.title, name
        flags = (
            tool.annotations.read_only_hint,
            tool.annotations.destructive_hint,
            tool.annotations.idempotent_hint,
            tool.annotations.open_world_hint,
        )
        assert all(isinstance(flag, bool) for flag in flags), (name, flags)


def test_every_input_parameter_has_a_description(listed):
    missing = [
        f"{name}.{param}"
        for name, tool in listed.items()
        for param, schema in tool.input_schema.get("properties", {}).items()
        if not schema.get("description")
    ]
    assert not missing


def _enum(schema: dict[str, Any]) -> list[Any] | None:
    """The enum of a property, through `anyOf` (optional) and `items` (lists)."""
    if "enum" in schema:
        return schema["enum"]
    for arm in schema.get("anyOf", []):
        if (found := _enum(arm)) is not None:
            return found
    return _enum(schema["items"]) if "items" in schema else None


@pytest.mark.parametrize(
    ("tool", "param", "values"),
    [
        ("convert_atc", "precision_mode", list(PRECISION_MODES)),
        ("precheck_ops", "soc", list(KNOWN_SOCS)),
        ("emulate_precision", "modes", list(get_args(EmulatedMode))),
        ("compare_layers", "mode", list(get_args(EmulatedMode))),
        ("compare_layers", "against", ["emulated", "npu_dump", "pytorch"]),
        ("export_onnx", "exporter", ["dynamo", "legacy"]),
        ("probe_onnx", "variant", ["original", "onnxslim", "auto_optimizer"]),
        ("verify_main_path", "precision", ["fp32", "emulated"]),
        ("write_bundle", "artifact", ["auto", "onnx", "om"]),
    ],
)
def test_parameters_with_known_values_carry_an_enum(listed, tool, param, values):
    assert _enum(listed[tool].input_schema["properties"][param]) == values


TOY_DRIVER = """\
import torch


def build_model(spec):
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def run_main_path(model, inputs):
    return model(torch.randn(3, 4))
"""


def _toy_workspace(folder: Path) -> Path:
    """A task record naming a two-function driver of a three-layer net (cheap to build and run), and a
    three-node ONNX file made with onnx.helper."""
    import onnx
    from onnx import TensorProto, helper

    folder.mkdir(parents=True)
    (folder / "toy_driver.py").write_text(TOY_DRIVER)
    (folder / "task.yaml").write_text(
        "id: toy\nintake:\n  model:\n    driver: toy_driver.py\n    scale: tiny\n  inputs: {}\n"
    )
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("Neg", ["r"], ["n"]),
            helper.make_node("Abs", ["n"], ["y"]),
        ],
        "toy",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), folder / "toy.onnx")
    return folder


def _files(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {
        p.relative_to(folder).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def _without_times(record_text: str) -> Any:
    """The record as data, each stage's and decision's times left out."""
    import yaml

    data = yaml.safe_load(record_text)
    for stage in (data.get("stages") or {}).values():
        for key in ("started", "finished", "seconds"):
            stage.pop(key, None)
    for decision in data.get("decisions") or []:
        decision.pop("at", None)
    if data.get("environment"):
        data["environment"].pop("probed_at", None)
    return data


def test_read_only_tools_leave_every_file_as_it_was(listed, surface, tmp_path, monkeypatch):
    """Each tool that says read-only is called on a small workspace: no file's bytes or mtime change,
    and none is added (validate_driver builds and runs the three-layer net: a second or so)."""
    folder = _toy_workspace(tmp_path / "ws")
    monkeypatch.chdir(folder)
    task = str(folder / "task.yaml")
    arguments = {
        "inspect_onnx": {"path": str(folder / "toy.onnx")},
        "list_drivers": {},
        "validate_driver": {"task": task},
        NEW_TOOL: {"task": task},
    }
    read_only = {name for name, t in _skill_tools(listed).items() if t.annotations.read_only_hint}
    assert read_only == set(arguments), "a read-only tool without a case here: add one"
    scripts = {p.stem: p for p in (surface / "skills").glob("*/scripts/*.py")}
    before = _files(folder)
    for name, kwargs in arguments.items():
        result = load_tool(scripts[name]).func(**kwargs)
        assert result is not None, name
        assert _files(folder) == before, f"{name} changed the workspace"
    assert load_tool(scripts["validate_driver"]).func(task=task).ok


def test_an_idempotent_tool_called_twice_leaves_the_record_as_the_first_call_did(listed, tmp_path, monkeypatch):
    """check_environment (the gate, hinted idempotent) twice: the record differs only in its times."""
    assert listed["check_environment"].annotations.idempotent_hint
    folder = _toy_workspace(tmp_path / "ws")
    monkeypatch.chdir(folder)
    tool = load_tool(skills_root() / "om-deployer" / "scripts" / "check_environment.py").func
    tool(task=str(folder / "task.yaml"))
    first = (folder / "task.yaml").read_text()
    tool(task=str(folder / "task.yaml"))
    second = (folder / "task.yaml").read_text()
    assert "environment" in _without_times(first)["stages"]
    assert _without_times(second) == _without_times(first)


def test_a_step_run_again_with_the_same_result_adds_no_decision():
    """convert_atc and precheck_ops rerun where they cannot reuse (ATC not run, say): the same outcome
    is not written into the record's history twice, a different one is."""
    from omskills.records.task import TaskRecord
    from omskills.stages.toolchain import decide_unless_repeated

    record = TaskRecord.model_validate({"id": "t", "intake": {"model": {"family": "sam3"}, "inputs": {}}})
    for _ in range(2):
        decide_unless_repeated(record, "convert_atc", "g", "g: ATC not_run", "atc missing")
        decide_unless_repeated(record, "convert_atc", "h", "h: ATC not_run", "atc missing")
    assert [d.what for d in record.decisions] == ["g: ATC not_run", "h: ATC not_run"]
    decide_unless_repeated(record, "convert_atc", "g", "g: ATC converted", "ATC exited 0 and wrote the OM")
    decide_unless_repeated(record, "convert_atc", "g", "g: ATC not_run", "atc missing")
    assert [d.what for d in record.decisions][2:] == ["g: ATC converted", "g: ATC not_run"]


def test_no_tool_reaches_outside_and_the_tools_that_run_models_are_long(listed):
    annotations = {name: t.annotations for name, t in _skill_tools(listed).items()}
    assert not any(a.open_world_hint for a in annotations.values())
    long_running = {name for name, t in _skill_tools(listed).items() if t.meta.get("omskills/long_running")}
    assert {"profile_main_path", "export_onnx", "probe_onnx", "emulate_precision", "verify_main_path"} <= long_running
    assert not long_running & {"inspect_onnx", "list_drivers", "plan_candidates", NEW_TOOL}


def test_every_tool_result_describes_its_fields(listed):
    """Every top-level field of every tool's output schema, as tools/list serves it (the skill
    tools, the new skill's and the server's job tools), carries a description."""
    assert {"start_job", "job_status", "cancel_job", "list_jobs", NEW_TOOL} <= set(listed)
    unschemed = [name for name, tool in listed.items() if not (tool.output_schema or {}).get("properties")]
    assert not unschemed
    undescribed = [
        f"{name}.{field}"
        for name, tool in sorted(listed.items())
        for field, schema in tool.output_schema["properties"].items()
        if not _field_description(schema, tool.output_schema)
    ]
    assert not undescribed


def _field_description(schema: dict[str, Any], root: dict[str, Any]) -> str | None:
    """A field's description; for a bare `$ref`, the referenced model's. Pydantic leaves the field's
    own off when it repeats the model's docstring, which a client then reads through the `$ref`."""
    if schema.get("description") or "$ref" not in schema:
        return schema.get("description")
    return root.get("$defs", {}).get(schema["$ref"].rsplit("/", 1)[-1], {}).get("description")


# --------------------------------------------------------------------------- fast discovery


def test_discovery_and_serving_import_no_torch_onnx_or_driver():
    """What `omskills serve` does before answering initialize, in a fresh interpreter."""
    drivers = sorted({ep.value.split(":")[0] for ep in entry_points(group="omskills.drivers")})
    assert drivers, "no driver entry point installed"
    probe = textwrap.dedent(f"""
        import asyncio, json, sys
        from pathlib import Path

        def heavy():
            return sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r} or m in {drivers!r})

        from omskills.host.toolkit import discover_tools
        discover_tools()
        after_discovery = heavy()
        from omskills.host.mcp_server import build_server
        server = build_server(Path.cwd())
        tools = asyncio.run(server.list_tools())
        print(json.dumps({{"after_discovery": after_discovery, "after_listing": heavy(),
                          "tools": {{t.name: [t.input_schema.get("type") == "object", bool(t.output_schema)]
                                    for t in tools}}}}))
    """)
    proc = run(sys.executable, "-c", probe)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["after_discovery"] == []
    assert seen["after_listing"] == []
    skill_tools = {p.stem for p in tool_files()}
    assert skill_tools <= set(seen["tools"])
    assert all(seen["tools"][name] == [True, True] for name in skill_tools), seen["tools"]


def test_a_described_workspace_path_is_still_confined():
    """`Annotated[WorkspacePath | None, Field(...)]` keeps the marker the server confines paths by."""
    compare = discover_tools().get("compare_layers").func
    hints = inspect.get_annotations(compare, eval_str=True)
    assert is_path_parameter("om_json", hints["om_json"])  # by its marker: the name says nothing
    assert not is_path_parameter("candidate", hints["candidate"])


def test_emulated_modes_are_the_engines():
    from omskills.ascend.precision_modes import SPEED_ORDER

    assert list(get_args(EmulatedMode)) == list(SPEED_ORDER)


# --------------------------------------------------------------------------- CLI


def test_tool_list_prints_each_whole_summary():
    proc = run(*CLI, "tool", "--list")
    assert proc.returncode == 0, proc.stderr
    flat = " ".join(proc.stdout.split())
    for _, info in discover_tools().items():
        assert info.summary and info.summary in flat, info.name
        assert info.hints is not None and info.hints.title in proc.stdout
    assert all(
        len(line) <= 80 for line in tool_listing([info for _, info in discover_tools().items()], width=80).splitlines()
    )


def test_a_bad_call_is_exit_2_with_one_line_per_argument():
    proc = run(
        *CLI, "tool", "convert_atc", "--args", json.dumps({"precision_mode": "fp8", "colour": "red", "candidate": 3})
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        "error: argument 'colour': unknown (this tool takes task, candidate, precision_mode)",
        "error: argument 'task': required",
        "error: argument 'candidate': input should be a valid string",
        "error: argument 'precision_mode': must be one of "
        + ", ".join(repr(m) for m in PRECISION_MODES[:-1])
        + f" or {PRECISION_MODES[-1]!r}",
    ]
    assert proc.stdout == ""


def test_a_script_run_directly_refuses_a_bad_list_item_the_same_way():
    script = skills_root() / "onnx-atc-pipeline" / "scripts" / "emulate_precision.py"
    proc = run(sys.executable, str(script), "--task", "t.yaml", "--modes", '["force_fp16", "fp8"]')
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: argument 'modes'[1]: must be one of "
        + ", ".join(repr(m) for m in get_args(EmulatedMode)[:-1])
        + f" or {get_args(EmulatedMode)[-1]!r}",
    ]


# --------------------------------------------------------------------------- the validate gate


def test_the_scaffold_passes_and_validate_names_missing_hints_and_descriptions(tmp_path):
    created = new_skill(NEW_SKILL, "Demo: summarise a task.", tmp_path)
    assert validate_skills([created.folder], run_help=False).ok
    assert load_tool(created.folder / "scripts" / f"{NEW_TOOL}.py").hints is not None
    write_tool(
        created.folder,
        NEW_TOOL,
        '''
        def demo_surface_task_summary(task: str, depth: int = 1) -> dict:
            """Summarise."""
            return {}
        ''',
    )
    problems = [p.message for p in validate_skills([created.folder], run_help=False).problems]
    assert any("parameter 'task' has no description" in p for p in problems), problems
    assert any("parameter 'depth' has no description" in p for p in problems), problems
    assert any("no @tool_hints" in p for p in problems), problems
