"""The run folder owns the paths a record stores: relative inside it, refused outside it, found again
through no symbolic link and never a FIFO."""

from __future__ import annotations

import os

import pytest
from omskills.run_folder import RunFolder


def test_a_path_inside_is_stored_relative_and_one_outside_is_refused(tmp_path):
    run = RunFolder(tmp_path / "run")
    (tmp_path / "run" / "onnx").mkdir(parents=True)
    assert run.stored(tmp_path / "run" / "onnx" / "g.onnx") == "onnx/g.onnx"
    assert run.stored(tmp_path / "run" / "..name" / "x") == "..name/x"  # a name starting with dots is inside
    with pytest.raises(ValueError, match="is outside the run folder"):
        run.stored(tmp_path / "elsewhere.onnx")
    assert run.stored_if_inside(str(tmp_path / "elsewhere.om")) == str(tmp_path / "elsewhere.om")
    assert run.stored_if_inside("om/g.om") == "om/g.om" and run.stored_if_inside(None) is None


def test_a_sub_folder_linked_to_another_disk_still_belongs_to_the_run(tmp_path):
    (tmp_path / "disk").mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "onnx").symlink_to(tmp_path / "disk")
    assert RunFolder(tmp_path / "run").stored(tmp_path / "run" / "onnx" / "g.onnx") == "onnx/g.onnx"


def test_commands_and_messages_lose_the_folders_absolute_prefix(tmp_path):
    run = RunFolder(tmp_path)
    root = str(tmp_path.resolve())
    assert run.command(["atc", f"--model={root}/onnx/g.onnx", "--log=error"]) == [
        "atc",
        "--model=onnx/g.onnx",
        "--log=error",
    ]
    assert run.text(f"failed: see {root}/om/g/atc.log (in {root})") == "failed: see om/g/atc.log (in .)"


def test_a_stored_path_is_found_again_only_through_no_link_and_never_as_a_fifo(tmp_path):
    run = RunFolder(tmp_path / "run")
    (tmp_path / "run").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "run" / "g.onnx").write_bytes(b"graph")
    (tmp_path / "run" / "out").symlink_to(tmp_path / "outside")
    os.mkfifo(tmp_path / "run" / "pipe")
    assert run.file("g.onnx") == tmp_path / "run" / "g.onnx"
    with pytest.raises(ValueError, match="symbolic link"):
        run.file("out/g.onnx")
    with pytest.raises(ValueError, match="not a regular file or folder"):
        run.file("pipe")
    with pytest.raises(ValueError, match="not a path inside"):
        run.file("../outside/g.onnx")
