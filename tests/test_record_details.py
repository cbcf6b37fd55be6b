"""A record a person can read: its bulky tables live in detail files beside it, named and hashed
in the record, and every reader still sees the whole record.

Real records on disk throughout: the repository's commented task record, with a profile of many
nodes added as a study would add it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from conftest import TASK
from omskills.errors import TaskRecordError
from omskills.records.profile import ModuleProfile, ProfileReport
from omskills.records.task import load_record, save_record, updating

NODES = 200


def _profile(nodes: int) -> ProfileReport:
    return ProfileReport(
        total_seconds=2.0,
        module_seconds=1.5,
        frames=2,
        prompts=1,
        modules_total=nodes,
        modules_called=nodes,
        nodes=[
            ModuleProfile(
                path=f"block.{i}",
                parent=None,
                module_class="Linear",
                depth=2,
                params_own=10,
                params_total=10,
                calls=1,
                inclusive_s=0.01,
                exclusive_s=0.01,
                share=0.005,
                exclusive_share=0.005,
            )
            for i in range(nodes)
        ],
    )


@pytest.fixture
def profiled(tmp_path: Path) -> Path:
    task = tmp_path / "task.yaml"
    shutil.copy(TASK, task)
    with updating(task) as record:
        record.profile = _profile(NODES)
    return task


def _reference(task: Path) -> dict:
    from omskills.records.task import load_yaml

    return load_yaml(task.read_text())["profile"]["nodes"]


def test_a_big_table_is_kept_in_a_detail_file_named_by_its_hash(profiled):
    ref = _reference(profiled)
    assert set(ref) == {"detail", "items"} and ref["items"] == NODES
    side = profiled.parent / ref["detail"]
    assert side.parent == profiled.parent / "task-details" and side.is_file()
    assert side.name == f"profile.nodes.{hashlib.sha256(side.read_bytes()).hexdigest()[:16]}.json"
    assert len(json.loads(side.read_text())) == NODES
    # The record stays short: the 200 nodes (14 fields each) take two lines of it.
    assert len(profiled.read_text().splitlines()) < 120
    assert load_record(profiled).profile == _profile(NODES)


def test_a_table_that_fits_on_one_line_stays_in_the_record():
    from typing import Annotated

    from omskills.records.base import Record
    from omskills.records.details import DETAIL, split_details

    class Table(Record):
        rows: Annotated[list[int], DETAIL]
        note: str | None = None

    short, long = {"rows": [1, 2, 3], "note": None}, {"rows": list(range(100)), "note": None}
    assert split_details(Table, short, "task-details") == {} and short == {"rows": [1, 2, 3]}
    files = split_details(Table, long, "task-details")
    assert list(files) == [long["rows"]["detail"]] and long["rows"]["items"] == 100
    assert json.loads(files[long["rows"]["detail"]]) == list(range(100))


def test_a_changed_detail_file_is_an_error_naming_the_field_and_the_file(profiled):
    side = profiled.parent / _reference(profiled)["detail"]
    nodes = json.loads(side.read_text())
    nodes[0]["calls"] = 99
    side.write_text(json.dumps(nodes, indent=1))
    with pytest.raises(TaskRecordError, match=r"profile\.nodes: its detail file task-details/.*changed since"):
        load_record(profiled)


def test_a_missing_detail_file_is_an_error_naming_it(profiled):
    side = profiled.parent / _reference(profiled)["detail"]
    side.unlink()
    with pytest.raises(TaskRecordError, match=rf"profile\.nodes: its detail file {side.parent.name}/{side.name}"):
        load_record(profiled)


@pytest.mark.parametrize(
    "planted", ["../outside.json", "/etc/passwd", "task-details/link.json", "task-details/../task.yaml", "onnx/x.json"]
)
def test_a_detail_reference_leading_outside_the_run_folder_is_refused(profiled, planted):
    outside = profiled.parent.parent / "outside.json"
    outside.write_text("[]")
    (profiled.parent / "task-details" / "link.json").symlink_to(outside)
    text = profiled.read_text()
    ref = _reference(profiled)["detail"]
    profiled.write_text(text.replace(ref, planted))
    with pytest.raises(TaskRecordError, match=r"profile\.nodes: its detail file"):
        load_record(profiled)


def test_a_save_removes_the_detail_files_no_longer_named_and_keeps_the_others(profiled):
    first = profiled.parent / _reference(profiled)["detail"]
    with updating(profiled) as record:
        record.profile = _profile(NODES + 1)
    second = profiled.parent / _reference(profiled)["detail"]
    assert second != first and second.is_file() and not first.exists()
    assert load_record(profiled).profile == _profile(NODES + 1)
    with updating(profiled) as record:
        record.profile = None
    assert not list((profiled.parent / "task-details").glob("*.json"))


def test_a_record_with_its_tables_inline_is_read_and_written_back_with_detail_files(tmp_path, profiled):
    """Records written before detail files hold every table inline: read as they are, moved out
    at the next save."""
    from omskills.records.task import render_record

    inline = tmp_path / "inline" / "task.yaml"
    inline.parent.mkdir()
    inline.write_text(render_record(load_record(profiled), TASK.read_text()))
    assert isinstance(_reference(inline), list) and len(_reference(inline)) == NODES
    record = load_record(inline)
    save_record(record, inline)
    assert _reference(inline)["items"] == NODES
    assert load_record(inline) == record
