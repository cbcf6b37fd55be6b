"""Runs of the main path with compiled graphs spliced in: which graphs can be, how each is opened
(as exported, or emulated in an ATC precision mode), and how two runs are judged against each
other. Shared by verify and by the precision plan's end-to-end check.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from omskills.ascend.emulation import write_emulated
from omskills.compare.outputs import compare_step, worse
from omskills.deploy.manifest import graph_from_record
from omskills.errors import StageError, one_line
from omskills.models.api import MainPathRun
from omskills.records.task import TaskRecord
from omskills.records.verify import CheckSummary, MainPathParity, OutputCheck, StepParity, worst_tier
from omskills.runtime.serving import open_graph
from omskills.splicing.paged_weights import page_out
from omskills.splicing.splice import SpliceBackend


def spliceable(record: TaskRecord) -> tuple[list[str], dict[str, str]]:
    """Graphs with an export whose probe did not fail; the others stay in PyTorch, with why. A
    dispatched candidate is spliced whole or not at all (a call to a graph left out would fall back)."""
    if record.plan is None:
        raise StageError("no plan in the task record: run plan_candidates first")
    chosen, skipped = [], {}
    for name in record.plan.first_batch:
        graphs = [c.candidate for c in record.contracts_of(name)] or [name]
        why = [f"{g}: {reason}" if g != name else reason for g in graphs if (reason := _not_spliceable(record, g))]
        if why:
            skipped[name] = "; ".join(why)
        else:
            chosen += graphs
    return chosen, skipped


def _not_spliceable(record: TaskRecord, graph: str) -> str | None:
    probe = record.toolchain_of(graph).probes.get("original")
    if graph not in record.exports:
        cand = record.plan.candidate(record.contracts[graph].plan_candidate if graph in record.contracts else graph)  # type: ignore[union-attr]
        return f"not exported ({cand.reason if cand else 'no export'})"
    if probe is None:
        return "never probed: run probe_onnx first"
    if probe.verdict == "fail":
        return f"probe failed (cosine {probe.worst_cosine:.5f}, max abs {probe.worst_max_abs:.2e})"
    return None


class Emulation(NamedTuple):
    """An ATC precision mode to emulate a graph in, and the nodes kept in fp32."""

    mode: str
    keep: tuple[str, ...] = ()

    def describe(self) -> str:
        return self.mode + (f" keeping {len(self.keep)} node(s)" if self.keep else "")


def chosen_emulation(record: TaskRecord, name: str) -> Emulation:
    report = record.toolchain_of(name).precision
    if report is None:
        raise StageError(f"{name}: no precision emulation recorded: run emulate_precision first")
    return Emulation(report.chosen_mode, tuple(report.chosen_keep))


def open_spliced(
    record: TaskRecord,
    workdir: Path,
    name: str,
    backend: str,
    emulation: Emulation | None = None,
    written: Path | None = None,
) -> SpliceBackend:
    """The graph's backend, opened as a deployment opens it (runtime.serving): on ONNX Runtime's CPU
    the batch in chunks where probe_onnx found it must be; an OM in the mode of its shape strategy,
    its batch gears serving other sizes; any other backend as its class serves a graph.
    `emulation`: the graph rewritten to compute as that ATC precision mode would, on ONNX Runtime
    CPU; `written`: that rewrite, when `ascend.emulation.write_emulated` already wrote it."""
    model = written or (_emulated_model(record, workdir, name, emulation) if emulation is not None else None)
    return open_graph(
        graph_from_record(record, workdir, name),
        workdir,
        backend,
        device_id=record.intake.target.device_id,
        model=model,
    )


def _emulated_model(record: TaskRecord, workdir: Path, name: str, emulation: Emulation) -> Path:
    return write_emulated(record.preferred_model(workdir, name), emulation.mode, emulation.keep)


def chosen_modes(record: TaskRecord, names: list[str]) -> dict[str, str]:
    return {name: chosen_emulation(record, name).describe() for name in names if record.toolchain_of(name).precision}


def page_out_spliced(root: Any, record: TaskRecord, names: list[str], workdir: Path) -> list[str]:
    """From here the spliced candidates' PyTorch weights only serve fallbacks: out of memory
    (`page_out`) before the sessions load the same weights again. A memory optimisation, so when
    it cannot apply the run goes on with the weights in memory, and the report says why."""
    try:
        page_out([root.get_submodule(record.contracts[n].module_path) for n in names], workdir / "verify")
    except Exception as err:  # noqa: BLE001 - best effort: any failure leaves the weights where they were
        return [
            f"the spliced candidates' PyTorch weights stayed in memory (paging them out failed: {one_line(err, 300)})"
        ]
    return []


def _summaries(checks: list[OutputCheck], per_step: list[StepParity]) -> list[CheckSummary]:
    summaries = []
    for check in checks:
        results = [c for s in per_step for c in s.checks if c.output == check.output and c.metric == check.metric]
        worst = None
        # A step where an optional output was absent from both runs passed with no figure: not the worst one.
        for result in [r for r in results if r.value is not None or not r.passed]:
            if worst is None or worse(check.metric, result.value, worst):
                worst = result.value
        summaries.append(
            CheckSummary(
                output=check.output,
                metric=check.metric,
                title=check.title,
                worst=worst,
                passed=all(r.passed for r in results),
                gating=check.gating,
                tier=worst_tier([r.tier for r in results]),
            )
        )
    return summaries


def main_path_parity(
    checks: list[OutputCheck], reference: MainPathRun, spliced: MainPathRun, fallbacks: int
) -> tuple[MainPathParity, list[StepParity]]:
    """Two runs of the main path judged by the (expanded) checks, step by step and as a whole."""
    per_step = [
        StepParity(
            index=r.index,
            checks=compare_step(checks, r.outputs, s.outputs),
            torch_seconds=round(r.seconds, 3),
            spliced_seconds=round(s.seconds, 3),
        )
        for r, s in zip(reference.steps, spliced.steps)
    ]
    n = max(len(per_step), 1)
    torch_s = sum(s.torch_seconds for s in per_step) / n
    spliced_s = sum(s.spliced_seconds for s in per_step) / n
    steps_equal = [s.index for s in reference.steps] == [s.index for s in spliced.steps]
    main = MainPathParity(
        steps=len(per_step),
        steps_equal=steps_equal,
        checks=_summaries(checks, per_step),
        fallbacks=fallbacks,
        torch_s_per_step=round(torch_s, 3),
        spliced_s_per_step=round(spliced_s, 3),
        latency_ratio=round(spliced_s / torch_s, 3) if torch_s else 0.0,
        torch_pass_s=round(reference.total_seconds, 3),
        spliced_pass_s=round(spliced.total_seconds, 3),
    )
    return main, per_step
