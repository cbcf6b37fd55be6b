"""Boundary optimisation (part of verify): the host code between the deployed graphs, hop by hop.

The main path runs once more with the graphs spliced in and a `GlueRecorder` on, which sees every
torch operation the host runs on graph outputs between the calls (`boundary.glue`). Each hop is
classified and costed, and the cost model proposes widening the tensor-only ones worth it
(`boundary.hops`). A proposed hop becomes a merge of its two graphs with the glue exported between
them (`stages.merged_graphs`); the decision recorded per hop is what that merged run showed.
"""

from __future__ import annotations

from omskills.ascend.link import link_cost
from omskills.boundary.glue import GlueRecorder
from omskills.boundary.hops import Hop, glue_report, hops
from omskills.models.api import RunHooks
from omskills.records.contracts import ContractSpec, ShapeStrategy
from omskills.records.glue import GlueReport
from omskills.records.task import TaskRecord
from omskills.records.traffic import MergedRun
from omskills.splicing.splice import SpliceBackend, splice
from omskills.stages.model import TaskModel


def captured_hops(
    record: TaskRecord,
    model: TaskModel,
    replacements: list[tuple[ContractSpec, SpliceBackend]],
    strategies: dict[str, ShapeStrategy],
) -> tuple[list[Hop], GlueRecorder]:
    """The main path spliced, with the host code between the graphs recorded: each hop classified,
    costed and decided by the cost model."""
    recorder = GlueRecorder()
    with splice(model.loaded.root, replacements, strategies=strategies) as handle:
        handle.traffic.observer = recorder
        with recorder:
            model.run(RunHooks(on_step=handle.traffic.step_done))
    found = hops(recorder, link_cost(record.intake.target))
    for seen in recorder.observations:
        seen.program = None  # copies of values kept to replay a hop: only the proposed ones still need theirs
    return found, recorder


def decided(found: list[Hop], recorder: GlueRecorder, merged: MergedRun | None) -> GlueReport:
    """The hops with what became of each proposal: widened when the merged graph holding it was
    verified, otherwise kept in Python with why."""
    chains = merged.graphs if merged is not None else []
    for hop in found:
        if hop.program is None:
            continue
        pair = (hop.glue.producer, hop.glue.consumer)
        chain = next((g for g in chains if _links(g.graphs, pair) and any(g.recipes)), None)
        if chain is not None and chain.status == "verified":
            hop.glue = hop.glue.model_copy(
                update={
                    "decision": "widened",
                    "decision_why": f"{hop.glue.decision_why.removeprefix('proposed: ')}; verified in {chain.name}",
                    "glue_onnx": next(
                        (p for p, g in zip(chain.glue_graphs, chain.graphs[1:]) if g == hop.glue.consumer), None
                    ),
                }
            )
        else:
            why = f"{chain.name} {chain.status}: {chain.reason}" if chain is not None else "no merged run took it"
            hop.glue = hop.glue.model_copy(update={"decision_why": f"kept in Python: the widened graph, {why}"})
    return glue_report(found, recorder)


def _links(graphs: list[str], pair: tuple[str, str]) -> bool:
    return any((a, b) == pair for a, b in zip(graphs, graphs[1:]))
