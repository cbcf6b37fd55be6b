"""Each hop's glue classified and costed, and the cost model's decision on widening its boundary.

From a `GlueRecorder`'s observations: per consumer graph whose inputs host code computed from graph
outputs, per producer graph, whether the glue can go into a graph (see `records.glue.HopGlue.kind`),
what it costs per step where it runs now, and what moving it would save on the link and cost on the
device. Only a tensor-only hop whose predicted link time saved exceeds the predicted device time of
the moved operations is proposed for widening.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from omskills.boundary.glue import GlueRecorder, Observation, Program
from omskills.contracts.recipes import output_digest
from omskills.records.glue import GlueCost, GlueKind, GlueReport, HopGlue
from omskills.records.traffic import LinkCost

# The device's memory bandwidth the moved glue is costed at. Glue is reshapes, scales and joins:
# memory-bound. 204.8 GB/s is the published LPDDR4X bandwidth of the Atlas 300I Pro (Ascend 310P),
# the slowest memory of the inference cards; an HBM part (Ascend 910B) moves it faster, so the device
# time predicted here is an upper bound there.
DEVICE_MEMORY_GB_S = 204.8


@dataclass
class Hop:
    """One hop as captured: its record, and the program to replay when it is widened."""

    glue: HopGlue
    program: Program | None


def hops(recorder: GlueRecorder, link: LinkCost) -> list[Hop]:
    """Every (producer, consumer) pair whose glue the recorder saw, classified and decided."""
    steps = max(len({o.step for o in recorder.observations if o.step is not None}), 1)
    by_consumer: dict[str, list[Observation]] = defaultdict(list)
    for seen in recorder.observations:
        by_consumer[seen.consumer].append(seen)
    found = []
    for consumer, calls in by_consumer.items():
        if not any(seen.glued for seen in calls):
            continue  # inputs handed on unchanged (a merge proposal's business) or made by the host alone
        producers = sorted({r.graph for seen in calls for recipe in seen.glued.values() for r in recipe.roots})
        for producer in producers:
            found.append(_hop(recorder, producer, consumer, calls, producers, steps, link))
    return found


def glue_report(found: list[Hop], recorder: GlueRecorder) -> GlueReport:
    steps = len({o.step for o in recorder.observations if o.step is not None})
    return GlueReport(hops=[hop.glue for hop in found], steps=steps)


def _hop(
    recorder: GlueRecorder,
    producer: str,
    consumer: str,
    calls: list[Observation],
    producers: list[str],
    steps: int,
    link: LinkCost,
) -> Hop:
    first = next(seen for seen in calls if seen.glued)
    kind, why = _kind(recorder, producer, calls, producers)
    cost = _cost(calls, steps, link)
    movable = kind == "tensor-only"
    if not movable:
        decision_why = f"kept in Python: {why}"
    elif cost.link_saved_ms_per_step <= cost.device_ms_per_step:
        decision_why = (
            f"kept in Python: moving it would save {cost.link_saved_ms_per_step:.4f} ms of link time per step "
            f"and cost {cost.device_ms_per_step:.4f} ms on the device"
        )
    else:
        decision_why = (
            f"proposed: {cost.link_saved_ms_per_step:.4f} ms of link time saved per step against "
            f"{cost.device_ms_per_step:.4f} ms of moved work on the device"
        )
    proposed = movable and cost.link_saved_ms_per_step > cost.device_ms_per_step
    glue = HopGlue(
        producer=producer,
        consumer=consumer,
        inputs=sorted(first.glued),
        passed=sorted(first.passed),
        ops=first.ops,
        sites=list(dict.fromkeys(first.sites)),
        kind=kind,
        why=why,
        cost=cost,
        decision="kept in Python",
        decision_why=decision_why,
        recipes=_recipes(first) if proposed else {},
    )
    return Hop(glue, first.program if proposed else None)


def _kind(
    recorder: GlueRecorder, producer: str, calls: list[Observation], producers: list[str]
) -> tuple[GlueKind, str]:
    if len(producers) > 1:
        return "several-sources", (
            f"its inputs come from {', '.join(producers)}: one widened graph would have to take them all"
        )
    changing = _changing_host_inputs(calls)
    if changing:
        size = max(calls[0].nbytes.get(name, 0) for name in changing)
        return "python-state", (
            f"it also reads {', '.join(changing)} ({size / 1e6:.2f} MB), which no graph output makes and which "
            "change between calls (user inputs or state kept by Python)"
        )
    for seen in calls:
        if seen.reads:
            return "data-dependent", f"host code read graph outputs into Python between the calls: {seen.reads[0]}"
        if seen.flags:
            return "data-dependent", seen.flags[0]
    recipes = {tuple(sorted((n, r.digest) for n, r in seen.glued.items())) for seen in calls}
    if len(recipes) > 1:
        return "varies-per-call", (
            f"the host code differs between calls ({len(recipes)} distinct recipes: shapes or Python arguments "
            "that change, or tensors read from outside that change)"
        )
    latest = _latest_call_fed(recorder, producer, calls)
    if latest is not None:
        return "varies-per-call", latest
    ops = ", ".join(dict.fromkeys(calls[0].ops))
    return "tensor-only", f"torch operations on {producer}'s outputs and constants, the same in every call ({ops})"


def _changing_host_inputs(calls: list[Observation]) -> list[str]:
    names = sorted({name for seen in calls for name in seen.host})
    return [name for name in names if len({seen.host.get(name) for seen in calls}) > 1]


def _latest_call_fed(recorder: GlueRecorder, producer: str, calls: list[Observation]) -> str | None:
    """Why the consumer's calls are not each fed by the producer's call just before it, or None."""
    serials = recorder.calls.get(producer, [])
    if len(serials) != len(calls):
        return f"called {len(calls)} times against {len(serials)} calls of {producer}"
    for seen in calls:
        before = [s for s in serials if s < seen.serial]
        used = {r.serial for recipe in seen.glued.values() for r in recipe.roots}
        used |= {root.serial for root in seen.passed.values()}
        if not before or used != {before[-1]}:
            return f"a call of {seen.consumer} reads outputs of an earlier call of {producer} than the last one"
    return None


def _cost(calls: list[Observation], steps: int, link: LinkCost) -> GlueCost:
    fed = sum(sum(seen.nbytes.values()) for seen in calls) / steps
    copies = sum(len(seen.nbytes) for seen in calls) / steps
    consumer_calls = len(calls) / steps
    touched = sum(seen.touched for seen in calls) / steps
    round_trips = consumer_calls + copies  # the consumer's launches and its input copies
    link_s = round_trips * link.round_trip_us * 1e-6 + (fed / (link.bandwidth_gb_s * 1e9) if link.bandwidth_gb_s else 0)
    return GlueCost(
        host_ms_per_step=round(sum(seen.ms for seen in calls) / steps, 4),
        fed_bytes_per_step=round(fed, 1),
        fed_copies_per_step=round(copies, 3),
        consumer_calls_per_step=round(consumer_calls, 3),
        touched_bytes_per_step=round(touched, 1),
        link_saved_ms_per_step=round(link_s * 1e3, 6),
        device_ms_per_step=round(touched / (DEVICE_MEMORY_GB_S * 1e9) * 1e3, 6),
    )


def _recipes(seen: Observation) -> dict[str, str]:
    """Each consumer input -> the digest a widened graph's call checks it against."""
    recipes = {name: recipe.digest for name, recipe in seen.glued.items()}
    recipes |= {name: output_digest(root.graph, root.output) for name, root in seen.passed.items()}
    return recipes | dict(seen.host)
