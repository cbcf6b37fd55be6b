"""Merged graphs: the merge proposals of a spliced run taken, built and verified (part of verify).

A graph whose every input is another graph's output, unchanged, in every call, and which is called
as often, can run inside that graph's call. Proposals link into chains (A feeds B, B feeds C), and
each chain's exported graphs are composed into one ONNX graph (`convert.compose`). The main path
runs again with each composed graph spliced in (`SpliceHandle.merge`). A chain is verified when
that run passes the same checks as the main verification with no fallback and the composed graph
answered the calls of every later member. A link whose inputs host code computes (a widened
boundary, `stages.glue`) has that glue exported and composed between its two members, and the
chain is served as one deferred call (`splicing.deferred_chain`). Its ATC command is written
beside the candidates' OMs in the slowest of the members' chosen precision modes, keeping each
member's kept nodes; that mode
is emulated once more on the composed graph (rounding at the joins can add up), and if the
composition fails there, the command keeps every dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from omskills.ascend.atc import AtcOptions, build_atc_command, conversion_script
from omskills.ascend.link import link_cost
from omskills.ascend.precision_fix import atc_keep_nodes, emulate_graph, fastest_first, write_keep_dtype
from omskills.ascend.precision_modes import UNCHECKED_PRECISION_MODE
from omskills.boundary.glue_graph import GLUE_INPUT, GlueGraphError, export_glue
from omskills.boundary.hops import Hop
from omskills.convert.compose import compose_chain, composed_prefix
from omskills.errors import one_line
from omskills.models.api import MainPathRun, RunHooks, save_run
from omskills.onnxfiles.inspect import graph_inputs
from omskills.records.contracts import ContractSpec, ShapeStrategy
from omskills.records.glue import glue_name
from omskills.records.precision import EmulatedResult, PrecisionGates
from omskills.records.task import TaskRecord
from omskills.records.traffic import MergedGraph, MergedRun, MergeProposal
from omskills.records.verify import OutputCheck
from omskills.report.wording import counted
from omskills.run_folder import RunFolder
from omskills.runtime import open_backend
from omskills.splicing.splice import SpliceBackend, SpliceError, splice
from omskills.splicing.traffic import traffic_report
from omskills.stages.model import TaskModel
from omskills.stages.precision import emulation_runner, first_feeds
from omskills.stages.spliced_runs import main_path_parity

MERGED_OUTPUTS = "verify/outputs-merged.npz"


def merged_run(
    record: TaskRecord,
    workdir: Path,
    model: TaskModel,
    reference: MainPathRun,
    replacements: list[tuple[ContractSpec, SpliceBackend]],
    strategies: dict[str, ShapeStrategy],
    proposals: list[MergeProposal],
    checks: list[OutputCheck],
    backend: str,
    hops: Sequence[Hop] = (),
) -> MergedRun | None:
    """The main path with every chain of mergeable graphs composed into one, the glue of each
    widened hop between its two members; None when none can merge."""
    widened = {(hop.glue.producer, hop.glue.consumer): hop for hop in hops if hop.program is not None}
    chains, not_taken = merge_chains([*proposals, *(widening_proposal(hop) for hop in widened.values())])
    if not chains:
        return None
    graphs = [_composed(record, workdir, names, links, widened) for names, links in chains]
    built = [g for g in graphs if g.status != "refused"]
    if not built:
        return MergedRun(graphs=graphs, not_taken=not_taken, verdict="not run", fallbacks=0)
    composed = [open_backend(workdir / str(graph.onnx_path), backend) for graph in built]
    refused: dict[str, str] = {}
    try:
        with splice(model.loaded.root, replacements, strategies=strategies) as handle:
            for graph, opened in zip(built, composed):
                try:
                    handle.merge(graph.graphs, opened, graph.io_maps, graph.prefixes, graph.recipes, graph.slots)
                except SpliceError as err:  # the graphs apart still serve its members
                    refused[graph.name] = f"cannot serve it: {one_line(err, 300)}"
            spliced = model.run(RunHooks(on_step=handle.traffic.step_done))
    finally:
        for opened in composed:
            opened.close()
    fallbacks = len(handle.fallbacks())
    main, _ = main_path_parity(checks, reference, spliced, fallbacks)
    answered = {s.candidate: s.merged_hits for s in handle.stats()}
    judged = []
    for graph in graphs:
        if graph.name in refused:
            graph = graph.model_copy(update={"status": "refused", "reason": refused[graph.name]})
        judged.append(graph if graph.status == "refused" else _judged(graph, main.verdict, fallbacks, answered))
    traffic = None if handle.traffic.error else traffic_report(handle.traffic.steps(), link_cost(record.intake.target))
    save_run(spliced, workdir / MERGED_OUTPUTS)
    return MergedRun(
        graphs=judged,
        not_taken=not_taken,
        verdict=main.verdict,
        fallbacks=fallbacks,
        checks=main.summary(),
        traffic=traffic,
        outputs=MERGED_OUTPUTS,
    )


def widening_proposal(hop: Hop) -> MergeProposal:
    """A hop whose glue a widened boundary takes in, as a merge of its two graphs."""
    cost = hop.glue.cost
    return MergeProposal(
        graph=hop.glue.consumer,
        upstream=hop.glue.producer,
        mergeable=True,
        reason=f"its inputs are {hop.glue.producer}'s outputs through tensor-only host code: widened to take it",
        calls_saved_per_step=cost.consumer_calls_per_step,
        bytes_saved_per_step=cost.fed_bytes_per_step,
        recipes=hop.glue.recipes,
        slots=hop.glue.slots,
    )


def merge_chains(proposals: list[MergeProposal]) -> tuple[list[tuple[list[str], list[MergeProposal]]], dict[str, str]]:
    """Mergeable proposals linked into chains, first member first, each with the proposals linking
    its members; and the mergeable graphs no chain can take, with why (a graph whose outputs feed
    two mergeable graphs runs the first of them inside its calls)."""
    feeds: dict[str, MergeProposal] = {}
    not_taken: dict[str, str] = {}
    for proposal in (p for p in proposals if p.mergeable and p.upstream):
        if (taken := feeds.get(proposal.upstream)) is not None:
            not_taken[proposal.graph] = f"{proposal.upstream} already runs {taken.graph} inside its calls"
        else:
            feeds[proposal.upstream] = proposal
    fed = {p.graph for p in feeds.values()}
    chains = []
    for head in (u for u in feeds if u not in fed):
        names, links = [head], []
        while (link := feeds.get(names[-1])) is not None and link.graph not in names:
            names.append(link.graph)
            links.append(link)
        chains.append((names, links))
    return chains, not_taken


def _composed(
    record: TaskRecord,
    workdir: Path,
    names: list[str],
    links: list[MergeProposal],
    widened: dict[tuple[str, str], Hop],
) -> MergedGraph:
    name = f"{names[0]}_to_{names[-1]}"
    out = workdir / "onnx" / "merged" / f"{name}.onnx"
    base = MergedGraph(
        name=name,
        graphs=names,
        io_maps=[link.io_map for link in links],
        prefixes=[composed_prefix(g) for g in names[1:]],
        recipes=[link.recipes for link in links],
        slots=[link.slots for link in links],
        status="refused",
        reason="",
    )
    if chunked := [g for g in names if record.batch_split_of(g) is not None]:
        return base.model_copy(
            update={
                "reason": (
                    f"{', '.join(chunked)} run(s) the batch in chunks on the CPU "
                    "(probe_onnx found the whole batch does not fit): "
                    "the composed graph would hold every member's whole batch at once"
                )
            }
        )
    try:
        members, member_names, maps, free, glue, slot_feeds = _members(record, workdir, names, links, widened)
        base = base.model_copy(update={"glue_graphs": [RunFolder(workdir).stored(g) if g else None for g in glue]})
        internal = [n for n in member_names if n not in names]
        compose_chain(members, member_names, maps, out, internal=internal, free=free, absolute=True)
        mode, keep, emulated = _precision(record, workdir, base, out, slot_feeds)
        command, script = _atc(record, workdir, name, names[0], out, mode, keep)
    except Exception as err:  # noqa: BLE001 - a merge is an optimisation: the graphs apart still serve
        return base.model_copy(update={"reason": f"cannot compose: {one_line(err, 300)}"})
    return base.model_copy(
        update={
            "onnx_path": RunFolder(workdir).stored(out),
            "atc_command": command,
            "atc_script": script,
            "precision_mode": mode,
            "keep_dtype_nodes": keep,
            "precision": emulated,
            "status": "failed",
            "reason": "not run yet",
        }
    )


def _members(
    record: TaskRecord,
    workdir: Path,
    names: list[str],
    links: list[MergeProposal],
    widened: dict[tuple[str, str], Hop],
) -> tuple[list[Path], list[str], list[dict[str, str]], list[set[str]], list[Path | None], dict[str, np.ndarray]]:
    """The graphs to compose, in order, with their names, the maps feeding each (by the composed
    graph's names), the inputs left to feed and their captured values: each widened link's glue
    graph (exported now) goes between its two members, its slots computed by earlier members wired
    to them."""
    members, member_names = [record.preferred_model(workdir, names[0])], [names[0]]
    maps: list[dict[str, str]] = []
    free: list[set[str]] = []
    glue: list[Path | None] = []
    slot_feeds: dict[str, np.ndarray] = {}
    fed_by: dict[str, dict[str, str]] = {}  # member -> its input -> the composed name feeding it
    for k, (before, after, link) in enumerate(zip(names, names[1:], links)):
        consumer = record.preferred_model(workdir, after)
        inputs = graph_inputs(consumer)
        if not link.recipes:
            fed_by[after] = {i: _composed_name(names, before, o) for i, o in link.io_map.items()}
            members.append(consumer), member_names.append(after), maps.append(fed_by[after])
            free.append(set()), glue.append(None)
            continue
        name = glue_name(before, after)
        path = workdir / "onnx" / "merged" / f"{name}.onnx"
        constant = [slot.constant for slot in link.slots]
        try:
            reads = export_glue(widened[(before, after)].program, constant, inputs, path)  # type: ignore[arg-type]
        except GlueGraphError as err:
            raise ValueError(f"the glue between {before} and {after} as a graph: {err}") from None
        wired = _wired(names[: k + 1], link, fed_by)
        outputs = {r: r.removeprefix(GLUE_INPUT) for r in reads if r.startswith(GLUE_INPUT)}
        glue_map = {r: _composed_name(names, before, o) for r, o in outputs.items()} | wired
        fed_by[after] = {i: composed_prefix(name) + i for i in inputs}
        members += [path, consumer]
        member_names += [name, after]
        maps += [glue_map, fed_by[after]]
        loose = {r for r in reads if r.startswith("slot_") and r not in wired}
        free += [loose, set()]
        program = widened[(before, after)].program
        slot_feeds |= {
            composed_prefix(name) + r: program.slot_samples[int(r[5:])].detach().cpu().numpy() for r in loose
        }  # type: ignore[union-attr]
        glue.append(path)
    return members, member_names, maps, free, glue, slot_feeds


def _wired(earlier: list[str], link: MergeProposal, fed_by: dict[str, dict[str, str]]) -> dict[str, str]:
    """The glue's slot inputs an earlier member computes -> the composed name that has it."""
    wired = {}
    for index, slot in enumerate(link.slots):
        found = slot.chained(earlier)
        if found is None:
            continue
        kind, graph, name = found
        wired[f"slot_{index}"] = _composed_name(earlier, graph, name) if kind == "output" else fed_by[graph][name]
    return wired


def _composed_name(names: list[str], graph: str, output: str) -> str:
    """An output of chain member `graph` as the composed graph names it."""
    return output if graph == names[0] else composed_prefix(graph) + output


def _precision(
    record: TaskRecord, workdir: Path, graph: MergedGraph, model: Path, slot_feeds: dict[str, np.ndarray]
) -> tuple[str, list[str], EmulatedResult | None]:
    """The slowest of the members' chosen modes, each member's keep list (prefixed), and that
    mode emulated on the composed graph (fed the first member's first captured inputs and the
    glue's captured slots); if the composition fails there, every dtype kept."""
    chains = [record.toolchain_of(g) for g in graph.graphs]
    modes = [(c.precision.chosen_mode if c.precision else None) or UNCHECKED_PRECISION_MODE for c in chains]
    mode = fastest_first(modes)[-1]
    if mode == UNCHECKED_PRECISION_MODE:
        return mode, [], None
    keep = [
        prefix + node
        for chain, own, prefix in zip(chains, modes, ["", *graph.prefixes])
        for node in atc_keep_nodes(chain, own)
    ]
    feeds, _ = first_feeds(record, workdir, graph.graphs[0])
    feeds = {**feeds, **slot_feeds}
    gates = chains[0].precision.gates if chains[0].precision else PrecisionGates()
    emulated = emulation_runner(model, feeds)(emulate_graph, model, mode, keep, feeds, gates)
    if not emulated.passed:
        return UNCHECKED_PRECISION_MODE, [], emulated
    return mode, keep, emulated


def _atc(
    record: TaskRecord, workdir: Path, name: str, first: str, model: Path, mode: str, keep: list[str]
) -> tuple[list[str], str | None]:
    boundary = record.boundaries.get(first)
    if boundary is None or boundary.shape_strategy is None:
        return [], None
    workdir = workdir.resolve()  # the paths below absolute, for the script; recorded relative to it
    folder = workdir / "om" / name
    folder.mkdir(parents=True, exist_ok=True)
    kept = write_keep_dtype(keep, folder, name) if keep else None
    options = AtcOptions.from_strategy(
        boundary.shape_strategy,
        model=str(model.resolve()),
        output=str(folder / name),
        soc_version=record.intake.target.soc,
        precision_mode=mode,
        **({"keep_dtype": str(kept)} if kept else {}),
    )
    script = folder / f"{name}_atc.sh"
    script.write_text(conversion_script(options, None, folder))
    script.chmod(0o755)
    # Recorded relative to the run folder, as every path a record holds (the run folder can move).
    run = RunFolder(workdir)
    return run.command(build_atc_command(options)), run.stored(script)


def _judged(graph: MergedGraph, verdict: str, fallbacks: int, answered: dict[str, int]) -> MergedGraph:
    hits = [answered.get(g, 0) for g in graph.graphs[1:]]
    if verdict == "pass" and fallbacks == 0 and all(hits):
        return graph.model_copy(
            update={
                "status": "verified",
                "reason": (
                    f"the main path passed with it; {counted(sum(hits), 'call')} of {', '.join(graph.graphs[1:])} "
                    f"over the run answered inside {graph.graphs[0]}'s"
                ),
            }
        )
    idle = [g for g, n in zip(graph.graphs[1:], hits) if not n]
    why = (
        f"no call of {', '.join(idle)} was answered by it"
        if idle
        else f"the main path with it: {verdict}, {fallbacks} fallback(s)"
    )
    return graph.model_copy(update={"status": "failed", "reason": why})
