"""ATC options, command line and run (with a test-double atc), and the operator precheck.

No CANN here: `tests/fake_atc` is a test double put on PATH as `atc`; it records its argv
and writes a fake .om (or fails like ATC does with E19010).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
from pathlib import Path

import onnx
import pytest
from omskills.ascend.atc import AtcOptions, advise, build_atc_command, find_atc, run_atc
from omskills.ascend.ops import load_table, parse_opsets, precheck_ops
from omskills.errors import InputError
from omskills.records.contracts import ShapeStrategy
from onnx import TensorProto, helper

FAKE_ATC = Path(__file__).with_name("fake_atc")


def model_file(tmp_path: Path, nodes, opset: int = 17, extra_opsets=(), name: str = "m.onnx") -> Path:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.FLOAT, None)],
    )
    opsets = [helper.make_opsetid("", opset), *(helper.make_opsetid(d, v) for d, v in extra_opsets)]
    path = tmp_path / name
    onnx.save(helper.make_model(graph, opset_imports=opsets), path)
    return path


@pytest.fixture
def relu_model(tmp_path) -> Path:
    return model_file(tmp_path, [helper.make_node("Relu", ["x"], ["y"], name="relu")])


def options(model: Path, tmp_path: Path, **fields) -> AtcOptions:
    base = dict(
        model=str(model),
        output=str(tmp_path / "out" / "relu"),
        soc_version="Ascend310P3",
        input_shapes={"x": [1, 3, 8, 8]},
    )
    base.update(fields)
    return AtcOptions.checked(**base)


# -- options and command line ---------------------------------------------------------------


def test_static_command_has_the_documented_parameters(relu_model, tmp_path):
    cmd = build_atc_command(options(relu_model, tmp_path, precision_mode="allow_fp32_to_fp16", input_format="NCHW"))

    assert cmd == [
        "atc",
        f"--model={relu_model}",
        "--framework=5",
        f"--output={tmp_path / 'out' / 'relu'}",
        "--soc_version=Ascend310P3",
        "--input_shape=x:1,3,8,8",
        "--input_format=NCHW",
        "--precision_mode=allow_fp32_to_fp16",
        "--log=error",
    ]


def test_each_dynamic_strategy_renders_its_own_option(relu_model, tmp_path):
    batch = build_atc_command(
        options(relu_model, tmp_path, input_shapes={"x": [-1, 3, 8, 8]}, dynamic_batch_size=[1, 2, 4])
    )
    image = build_atc_command(
        options(relu_model, tmp_path, input_shapes={"x": [1, 3, -1, -1]}, dynamic_image_size=[[224, 224], [448, 448]])
    )
    dims = build_atc_command(
        options(
            relu_model, tmp_path, input_shapes={"x": [1, -1], "mask": [-1, -1]}, dynamic_dims=[[20, 1, 1], [40, 2, 2]]
        )
    )
    ranges = build_atc_command(
        options(relu_model, tmp_path, input_shapes={"x": [-1, 3, 8, 8]}, dynamic_shape={"x": [[1, 8], [3], [8], [8]]})
    )

    assert "--dynamic_batch_size=1,2,4" in batch and "--input_shape=x:-1,3,8,8" in batch
    assert "--dynamic_image_size=224,224;448,448" in image
    assert (
        "--dynamic_dims=20,1,1;40,2,2" in dims
        and "--input_format=ND" in dims
        and "--input_shape=x:1,-1;mask:-1,-1" in dims
    )
    assert "--input_shape=x:1~8,3,8,8" in ranges


def test_two_strategies_at_once_are_refused(relu_model, tmp_path):
    with pytest.raises(InputError, match=r"shape strategies \['dynamic_batch_size', 'dynamic_dims'\] given together"):
        options(
            relu_model, tmp_path, input_shapes={"x": [-1, 3, 8, 8]}, dynamic_batch_size=[1, 2], dynamic_dims=[[1], [2]]
        )


def test_unknown_soc_is_refused(relu_model, tmp_path):
    with pytest.raises(InputError, match="soc_version: unknown SoC 'Ascend310X'"):
        options(relu_model, tmp_path, soc_version="Ascend310X")


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(dynamic_dims=[[4]], input_shapes={"x": [1, -1]}), "dynamic_dims: 1 gear"),
        (dict(dynamic_dims=[[g] for g in range(1, 102)], input_shapes={"x": [1, -1]}), "dynamic_dims: 101 gear"),
        (dict(dynamic_dims=[[1, 2], [3, 4]], input_shapes={"x": [1, -1]}), "each gear needs 1 positive value"),
        (dict(input_shapes={"x": [-1, 3, 8, 8]}), "no dynamic strategy is given"),
        (dict(dynamic_batch_size=[1, 2], input_shapes={"x": [1, 3, -1, 8]}), "-1 on dim 0"),
        (dict(precision_mode="fp16_please"), "precision_mode"),
    ],
)
def test_inconsistent_options_name_the_field(relu_model, tmp_path, fields, message):
    with pytest.raises(InputError, match=message):
        options(relu_model, tmp_path, **fields)


def test_options_come_from_the_boundary_shape_strategy(relu_model, tmp_path):
    strategy = ShapeStrategy(
        kind="dynamic_dims", input_shapes={"x": [1, -1]}, gears=[[4], [8], [16]], rationale="token count varies"
    )

    opts = AtcOptions.from_strategy(
        strategy, model=str(relu_model), output=str(tmp_path / "o.om"), soc_version="Ascend910B3"
    )

    assert opts.strategy == "dynamic_dims" and opts.output == str(tmp_path / "o")  # .om is ATC's to add
    assert "--dynamic_dims=4;8;16" in build_atc_command(opts)


# -- finding and running atc ----------------------------------------------------------------


@pytest.fixture
def fake_atc_on_path(tmp_path, monkeypatch):
    """Put the test double on PATH as `atc`; return the file its argv is recorded in."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(FAKE_ATC, bin_dir / "atc")
    (bin_dir / "atc").chmod((bin_dir / "atc").stat().st_mode | stat.S_IXUSR)
    argv_log = tmp_path / "atc_argv.jsonl"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_ATC_ARGV_LOG", str(argv_log))
    monkeypatch.delenv("FAKE_ATC_MODE", raising=False)
    return argv_log


def test_fake_atc_success_records_om_and_hash(relu_model, tmp_path, fake_atc_on_path):
    opts = options(relu_model, tmp_path, input_shapes={"x": [1, -1]}, dynamic_dims=[[8], [16]])

    result = run_atc(opts, tmp_path / "work")

    assert result.status == "converted" and result.exit_code == 0
    assert result.om_path == str(tmp_path / "out" / "relu.om") and Path(result.om_path).is_file()
    assert len(result.om_sha256) == 64 and result.om_bytes == Path(result.om_path).stat().st_size
    recorded = json.loads(fake_atc_on_path.read_text().splitlines()[0])
    assert recorded == build_atc_command(opts)[1:]  # atc received exactly the built arguments
    assert Path(result.log).is_file() and Path(result.script).is_file()


def test_fake_atc_failure_keeps_log_and_maps_the_error(relu_model, tmp_path, fake_atc_on_path, monkeypatch):
    monkeypatch.setenv("FAKE_ATC_MODE", "fail")

    result = run_atc(options(relu_model, tmp_path), tmp_path / "work")

    assert result.status == "failed" and result.exit_code == 1 and result.om_path is None
    assert "No parser is registered" in Path(result.log).read_text()
    assert [e.code for e in result.errors] == ["E19010"]
    assert "opset" in result.errors[0].advice and "precheck_ops" in result.errors[0].advice


def test_atc_exiting_0_without_an_om_is_not_converted(relu_model, tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "atc").write_text("#!/bin/sh\necho 'test double: exits 0, writes nothing'\n")
    (bin_dir / "atc").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    result = run_atc(options(relu_model, tmp_path), tmp_path / "work")

    assert result.status == "failed" and "wrote no" in result.reason


def test_without_atc_a_script_is_written_and_nothing_is_claimed(relu_model, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)
    monkeypatch.setattr("omskills.ascend.atc.DEFAULT_TOOLKIT_HOMES", (str(tmp_path / "no_cann"),))
    opts = options(relu_model, tmp_path)

    result = run_atc(opts, tmp_path / "work")

    assert result.status == "not_run" and result.reason == "atc missing"
    assert result.om_path is None and result.om_sha256 is None
    script = Path(result.script)
    assert script.name == "convert_relu.sh" and os.access(script, os.X_OK)
    text = script.read_text()
    assert "set_env.sh" in text and "--soc_version=Ascend310P3" in text
    # Paths are relative to the script's folder, which it runs from: it moves with the run folder.
    assert 'cd "$(dirname "${BASH_SOURCE[0]}")/."' in text and str(tmp_path) not in text
    model_arg = next(a for a in shlex.split(text.splitlines()[-1]) if a.startswith("--model="))
    assert (script.parent / model_arg.removeprefix("--model=")).resolve() == Path(relu_model).resolve()


def test_find_atc_sources_set_env_of_a_toolkit_install(tmp_path):
    home = tmp_path / "ascend-toolkit" / "latest"
    (home / "compiler" / "bin").mkdir(parents=True)
    (home / "compiler" / "bin" / "atc").write_text("#!/bin/sh\n")
    (tmp_path / "ascend-toolkit" / "set_env.sh").write_text("export X=1\n")

    install = find_atc(env={"PATH": "/nonexistent", "ASCEND_TOOLKIT_HOME": str(home)}, toolkit_homes=())

    assert install.atc == str(home / "compiler" / "bin" / "atc")
    assert install.set_env == str(tmp_path / "ascend-toolkit" / "set_env.sh")
    assert find_atc(env={"PATH": "/nonexistent"}, toolkit_homes=(str(tmp_path / "none"),)) is None


def test_advice_for_parameter_errors():
    found = advise("E10001: Value [abc] for parameter [--input_shape] is invalid. Reason: bad format.\nATC run failed")
    assert [e.code for e in found] == ["E10001"] and "--input_shape" in found[0].message


# -- operator precheck ----------------------------------------------------------------------


def test_table_is_the_cann_list_with_opset_ranges():
    table = load_table()
    assert len(table) == 160
    assert table["Resize"].opsets == parse_opsets("10-12,14-18") and 13 not in table["Resize"].opsets
    assert table["LayerNormalization"].range_from == "op page"
    assert "ArgMax" in table and "Gelu" not in table


def test_precheck_flags_unknown_custom_and_out_of_range_ops_with_node_names(tmp_path):
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="relu_0"),
        helper.make_node("Gelu", ["a"], ["b"], name="gelu_0"),
        helper.make_node("FancyOp", ["b"], ["c"], name="fancy_0", domain="com.example"),
        helper.make_node("Sigmoid", ["c"], ["y"], name="sigmoid_0"),
    ]
    path = model_file(tmp_path, nodes, opset=20, extra_opsets=[("com.example", 1)])

    report = precheck_ops(path, "Ascend310P3")

    rows = {r.op_type: r for r in report.rows}
    assert report.opset == 20 and report.verdict == "fail"
    assert rows["Gelu"].status == "unsupported" and rows["Gelu"].nodes == ["gelu_0"]
    assert rows["FancyOp"].status == "unsupported" and rows["FancyOp"].domain == "com.example"
    assert rows["FancyOp"].nodes == ["fancy_0"]
    # Opset 20 is above every range in the table: listed ops become constrained.
    assert rows["Relu"].status == "constrained" and "opset 20" in rows["Relu"].reason
    assert report.counts == {"supported": 0, "constrained": 2, "unsupported": 2}


def test_precheck_passes_plain_ops_at_an_accepted_opset_and_checks_attributes(tmp_path):
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="relu_0"),
        helper.make_node("Einsum", ["a", "a"], ["y"], name="einsum_0", equation="abcd,abce->abde"),
    ]
    ok = precheck_ops(model_file(tmp_path, nodes, opset=17), "Ascend910B3")
    assert {r.op_type: r.status for r in ok.rows}["Relu"] == "supported"
    assert {r.op_type: r.reason for r in ok.rows}["Einsum"] == "documented constraints apply (see constraints)"

    odd = [helper.make_node("Einsum", ["x", "x"], ["y"], name="einsum_odd", equation="abcd,abcd->ab")]
    report = precheck_ops(model_file(tmp_path, odd, opset=17, name="odd.onnx"), "Ascend910B3")
    assert "equation outside the documented values in node(s) ['einsum_odd']" in report.rows[0].reason


def test_precheck_refuses_unknown_soc(relu_model):
    with pytest.raises(InputError, match="unknown SoC 'Ascend42'"):
        precheck_ops(relu_model, "Ascend42")


def test_a_toolkit_atc_runs_after_sourcing_set_env(relu_model, tmp_path, monkeypatch):
    home = tmp_path / "ascend-toolkit" / "latest"
    (home / "bin").mkdir(parents=True)
    shutil.copy(FAKE_ATC, home / "bin" / "atc")
    (home / "bin" / "atc").chmod(0o755)
    argv_log = tmp_path / "sourced_argv.jsonl"
    # Only set_env.sh tells the test double where to record: a record proves it was sourced.
    (home / "set_env.sh").write_text(f"export FAKE_ATC_ARGV_LOG={argv_log}\n")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(home))
    monkeypatch.delenv("FAKE_ATC_ARGV_LOG", raising=False)

    result = run_atc(options(relu_model, tmp_path), tmp_path / "work")

    assert result.status == "converted" and result.atc == str(home / "bin" / "atc")
    assert argv_log.is_file()
    assert "source" in Path(result.log).read_text().splitlines()[0]
