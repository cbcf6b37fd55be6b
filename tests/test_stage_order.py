"""Each step declared once (`records.stage_order`): what the rest of the engine derives from the
declaration holds for every step, including one added later."""

from __future__ import annotations

import shutil
import types
import typing

import pytest
from conftest import TASK
from omskills.records.export import ExportResult
from omskills.records.stage_order import ADAPTATION_STEPS, STAGE_COLUMNS, result_slots, step_key
from omskills.records.stages import StageResult
from omskills.records.task import TaskRecord, load_record, updating
from pydantic import BaseModel


def _field_type(model: type[BaseModel], dotted: list[str]) -> object:
    """The type at a declared slot path, following models and the values of dicts ({graph} and
    {variant} stand for keys)."""
    annotation: object = model
    for part in dotted:
        while typing.get_origin(annotation) in (typing.Union, types.UnionType):
            annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
        if part.startswith("{"):
            assert typing.get_origin(annotation) is dict, (dotted, part)
            annotation = typing.get_args(annotation)[1]
        else:
            assert isinstance(annotation, type) and issubclass(annotation, BaseModel), (dotted, part)
            assert part in annotation.model_fields, f"{'.'.join(dotted)}: {annotation.__name__} has no {part}"
            annotation = annotation.model_fields[part].annotation
    return annotation


@pytest.mark.parametrize("declared", [s for s in ADAPTATION_STEPS if s.results], ids=lambda s: s.tool)
def test_every_declared_result_slot_is_a_field_of_the_record(declared):
    for template in [*declared.results, *(t for ts in declared.results_of_variant.values() for t in ts)]:
        _field_type(TaskRecord, template.split("."))


def test_the_stage_table_has_one_column_per_declared_step_in_plan_order_named_by_its_key():
    assert STAGE_COLUMNS == ("export", "probe", "optimize", "precision", "precheck", "atc", "verify")
    assert all(step_key(column).split(":")[0] == column for column in STAGE_COLUMNS)


def test_a_step_marked_done_without_its_declared_result_is_reported_missing(tmp_path):
    task = tmp_path / "task.yaml"
    shutil.copy(TASK, task)
    export = ExportResult(
        path="onnx/g/g.onnx",
        exporter="dynamo",
        opset=18,
        seconds=1.0,
        bytes=1,
        sha256="0" * 64,
        external_data=False,
        log_path="onnx/g/g.onnx.export.log",
        input_names=["x"],
        output_names=["y"],
        fact_source="test",
    )
    with updating(task) as record:
        record.stages[step_key("export", "g")] = StageResult(status="done")
        record.stages[step_key("probe", "g", "original")] = StageResult(status="done")
        record.stages[step_key("verify", None, "emulated")] = StageResult(status="done")
        record.exports["g"] = export
    record = load_record(task)
    assert result_slots("probe:g:original") == ["toolchain.g.probes.original"]
    assert record.missing_results("export:g") == []
    assert record.missing_results("probe:g:original") == ["toolchain.g.probes.original"]
    assert record.missing_results("verify:emulated") == ["verification_emulated"]
    assert record.missing_results("verify") == ["verification"]
