"""A CLIP-style zero-shot classifier (examples/zoo/open-clip-zero-shot.yaml: open_clip's CLIP, a tiny
config, random weights, 64x64 images) classifies every image against the same prompt set. Its text
tower's input is the token embedding plus a positional parameter and its mask a buffer: values
derived from the prompts and the model's constants alone, so the deployed tower is encoded once
per prompt set however many images follow, and not at all from a bundle that computed the prompt
set ahead. A model none of whose graphs qualifies says why when asked to precompute.

The adaptations are the zoo's (`zoo_adaptation`, made once per test run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import omskills
from omskills.records.task import load_record
from omskills.splicing.memo import why_not_memoisable

CLIP = "open-clip-zero-shot"
OTHER_PROMPTS = ["a photo of a dog", "a photo of a cat"]


@pytest.fixture(scope="module")
def clip(zoo_adaptation) -> Path:
    row, run = zoo_adaptation(CLIP)
    assert row.passed, row.model_dump_json()
    return run


def _text_tower(model) -> object:
    return {s.candidate: s for s in model.stats()}["text_tower"]


def test_the_text_tower_is_remembered_and_the_image_tower_is_not_with_the_reason(clip):
    record = load_record(clip / "task.yaml")
    tower = record.contracts["text_tower"]
    x, mask = tower.inputs
    assert (x.provenance.kind, x.provenance.source) == ("module_output", "token_embedding")
    assert set(x.provenance.roots) == {"constant", "parameter"} and set(mask.provenance.roots) == {"parameter"}
    assert why_not_memoisable(tower) is None
    # The image comes through PIL and torch.from_numpy, which no torch function sees made.
    assert why_not_memoisable(record.contracts["image_tower"]).startswith(
        "input 'x' derives from a tensor the study could not trace"
    )
    delivery = (clip / "DELIVERY.md").read_text()
    assert "computes them ahead): text_tower. image_tower always runs: input 'x' derives from a tensor" in delivery
    verified = {c.name: c for c in record.verification.candidates}
    steps = record.verification.main_path.steps
    assert verified["text_tower"].memo_hits == steps - 1 and verified["image_tower"].memo_hits == 0


def test_the_same_prompts_for_every_image_and_every_run_are_encoded_once(clip):
    from omskills.deploy import load_adapted

    with load_adapted(clip / "task.yaml", backend="onnxruntime", strict=True) as model:
        model.run_main_path({"count": 3})
        model.run_main_path({"count": 3})  # the same prompt set again
        once = _text_tower(model)
        once = (once.calls, once.backend_calls, once.memo_hits)
        model.run_main_path({"count": 2, "prompts": OTHER_PROMPTS})
        text = _text_tower(model)
    assert once == (6, 1, 5)
    assert (text.calls, text.backend_calls, text.memo_hits, text.fallbacks) == (8, 2, 6, 0)


def test_a_bundle_with_the_prompt_set_computed_ahead_never_runs_the_text_tower(clip, tmp_path):
    from omskills.deploy import load_adapted

    prompts = load_record(clip / "task.yaml").intake.inputs["prompts"]
    bundle = tmp_path / "bundle"
    result = omskills(
        "bundle", str(clip / "task.yaml"), "--out", str(bundle), "--precompute", f"prompts={json.dumps(prompts)}"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    stored = bundle / "memo" / "text_tower.npz"
    assert (
        f"text_tower: 1 call(s) computed ahead (memo/text_tower.npz, {stored.stat().st_size:,} bytes), "
        "answered from memory" in result.stderr
    )
    assert (
        "image_tower: nothing computed ahead: input 'x' derives from a tensor the study could not trace"
        in result.stderr
    )
    with load_adapted(bundle, backend="onnxruntime", strict=True) as model:
        model.run_main_path({"count": 3})
        text = _text_tower(model)
    assert (text.calls, text.backend_calls, text.memo_hits) == (3, 0, 3)


def test_bundle_precompute_on_a_model_where_no_graph_qualifies_says_why_for_each_graph(zoo_adaptation, tmp_path):
    from omskills.deploy.manifest import read_bundle

    run = zoo_adaptation("crepe-tiny-pitch")[1]  # its audio comes through torch.from_numpy
    bundle = tmp_path / "bundle"
    result = omskills("bundle", str(run / "task.yaml"), "--out", str(bundle), "--precompute", "seconds=1.0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--precompute: nothing computed ahead" in result.stderr
    graphs = [g.name for g in read_bundle(bundle).graphs]
    assert graphs and all(g.remembered is None for g in read_bundle(bundle).graphs)
    for graph in graphs:
        assert f"{graph}: nothing computed ahead: input " in result.stderr, result.stderr
    assert not (bundle / "memo").exists()
