"""A crash during stage 3 of the shared tiny SAM 3 adaptation, and its rerun (issues 3-6).

Its own file: one long test, a unit of work of its own that either worker takes, longest first
(tests/conftest.py)."""

from __future__ import annotations

from omskills.records.task import load_record


def test_rerun_after_a_crash_in_stage_3_redoes_only_the_unfinished_export(tiny_adaptation, tmp_path):
    from conftest import TASK, copy_run, omskills
    from omskills.records.task import save_record

    run = copy_run(tiny_adaptation, tmp_path / "run")  # a copied run folder resumes on its own files
    record = load_record(run / "task.yaml")
    done = sorted(k for k, v in record.stages.items() if k.startswith("export:") and v.status == "done")
    assert len(done) >= 2
    # The smallest export: its redo (export, probe, variants) is the cheapest.
    crashed = min(done, key=lambda step: record.exports[step.split(":", 1)[1]].bytes)
    done = [step for step in done if step != crashed] + [crashed]
    # What a kill during that export leaves behind: the step marked running, no result stored.
    record.stages[crashed].status = "running"
    record.exports.pop(crashed.split(":", 1)[1])
    save_record(record, run / "task.yaml")
    started_before = {k: record.stages[k].started for k in done[:-1]}
    kept_probes = [f"probe:{k.split(':', 1)[1]}:original" for k in done[:-1]]
    probes_before = {k: record.stages[k].started for k in kept_probes}

    result = omskills("adapt", str(TASK), "--scale", "tiny", "--frames", "2", "--out", str(run))
    assert result.returncode == 0, result.stderr[-2000:]
    after = load_record(run / "task.yaml")
    assert all(after.stages[k].started == v for k, v in started_before.items()), "finished exports were redone"
    assert all(after.stages[k].started == v for k, v in probes_before.items()), "probes of kept exports were redone"
    assert after.stages[crashed].status == "done" and crashed.split(":", 1)[1] in after.exports
    assert after.verification is not None and after.verification.main_path.fallbacks == 0
