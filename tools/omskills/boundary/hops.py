"""Each hop's glue classified and costed, and the cost model's decision on widening its boundary.

From a `GlueRecorder`'s observations: per consumer graph whose inputs host code computed from
another graph's outputs, whether the glue can go into a graph (`records.glue.HopGlue.kind`), what
it costs per step where it runs now, and what moving it would save on the link and cost on the
device. Only a tensor-only hop whose predicted link time saved exceeds the predicted device time
of the moved operations is proposed for widening.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from omskills.boundary.glue import GlueRecorder, Observation, Program
from omskills.records.glue import GlueCost, GlueKind, GlueReport, HopGlue, SlotUse
from omskills.records.traffic import LinkCost

# The device's memory bandwidth the moved glue is costed at. Glue is reshapes, scales and joins:
# memory-bound. 204.8 GB/s is the published LPDDR4X bandwidth of the Atlas 300I Pro (Ascend 310P),
# the slowest memory of the inference cards; an HBM part (Ascend 910B) moves it faster, so the device
# time predicted here is an upper bound there.
DEVICE_MEMORY_GB_S = 204.8


@dataclass
class Hop:
    """One hop as captured: its record, and the program to replay when it is proposed."""

    glue: HopGlue
    program: Program | None


def hops(recorder: GlueRecorder, link: LinkCost) -> list[Hop]:
    """Every (producer, consumer) pair whose glue the recorder saw, classified and decided."""
    steps = max(recorder.steps, 1)
    by_pair: dict[tuple[str, str], list[Observation]] = defaultdict(list)
    for seen in recorder.observations:
        if seen.producer is not None:
            by_pair[(seen.producer, seen.consumer)].append(seen)
    found = []
    for (producer, consumer), calls in by_pair.items():
        if not any(seen.hop for seen in calls):
            continue  # every input handed on unchanged (a merge proposal's business), or none from it
        found.append(_hop(recorder, producer, consumer, calls, steps, link))
    return found


def glue_report(found: list[Hop], recorder: GlueRecorder) -> GlueReport:
    return GlueReport(hops=[hop.glue for hop in found], steps=recorder.steps, error=recorder.error)


def _hop(
    recorder: GlueRecorder,
    producer: str,
    consumer: str,
    calls: list[Observation],
    steps: int,
    link: LinkCost,
) -> Hop:
    served = _commonest_recipe(calls)
    first = next((seen for seen in served if seen.program is not None), served[0])
    kind, why = _kind(recorder, producer, consumer, calls, served)
    slots = _slot_uses(served) if kind == "tensor-only" else []
    cost = _cost(served, steps, link, [s for s in slots if not s.constant])
    proposed = kind == "tensor-only" and cost.link_saved_ms_per_step > cost.device_ms_per_step
    if kind != "tensor-only":
        decision_why = f"kept in Python: {why}"
    else:
        verb = "proposed" if proposed else "kept in Python"
        decision_why = (
            f"{verb}: {cost.link_saved_ms_per_step:.4f} ms of link time saved per step against "
            f"{cost.device_ms_per_step:.4f} ms of moved work on the device"
        )
    glue = HopGlue(
        producer=producer,
        consumer=consumer,
        inputs=first.glued,
        passed=first.passed,
        slots=slots,
        ops=first.ops,
        sites=list(dict.fromkeys(first.sites)),
        kind=kind,
        why=why,
        cost=cost,
        decision="kept in Python",
        decision_why=decision_why,
        recipes=first.recipes if proposed else {},
    )
    return Hop(glue, first.program if proposed else None)


def _commonest_recipe(calls: list[Observation]) -> list[Observation]:
    """The calls whose host code is the one most calls ran (the earliest of equals): those a widened
    graph serves; the others run apart."""
    groups: dict[tuple, list[Observation]] = {}
    for seen in calls:
        groups.setdefault(tuple(sorted(seen.recipes.items())), []).append(seen)
    return max(groups.values(), key=len)


def _kind(
    recorder: GlueRecorder, producer: str, consumer: str, calls: list[Observation], served: list[Observation]
) -> tuple[GlueKind, str]:
    for seen in served:
        if seen.reads:
            return (
                "data-dependent",
                f"host code reads {producer}'s outputs into Python before the call: {seen.reads[0]}",
            )
        if seen.flags:
            return seen.flags[0]
    if len(served) < len(calls) and len(served) < 2:
        return "varies-per-call", (
            f"the host code differs between calls ({len(calls)} calls, no two alike: the operations, their "
            "Python arguments or the shapes they read change)"
        )
    if not any(seen.program is not None for seen in served):
        return "python-state", "a value it starts from was gone before the call: nothing to replay"
    unfed = _calls_unfed(recorder, producer, consumer, calls)
    if unfed is not None:
        return "varies-per-call", unfed
    ops = ", ".join(dict.fromkeys(served[0].ops))
    alike = (
        "the same in every call" if len(served) == len(calls) else f"the same in {len(served)} of {len(calls)} calls"
    )
    return "tensor-only", f"torch operations on {producer}'s outputs, {alike} ({ops})"


def _calls_unfed(recorder: GlueRecorder, producer: str, consumer: str, calls: list[Observation]) -> str | None:
    """Why the consumer's calls are not each fed by their own call of the producer, or None."""
    serials = [seen.producer_serial for seen in calls]
    if len(set(serials)) != len(serials):
        return f"{consumer} is called more than once after a call of {producer}"
    if len(calls) != len(recorder.calls.get(producer, [])):
        return f"called {len(calls)} times against {len(recorder.calls.get(producer, []))} calls of {producer}"
    return None


def _slot_uses(calls: list[Observation]) -> list[SlotUse]:
    """Each slot of the recipes: a constant when its values are the same in every call, else an input."""
    uses = []
    for index, slot in enumerate(calls[0].slots):
        values = {seen.slots[index].value for seen in calls if index < len(seen.slots)}
        sources = {seen.slots[index].source for seen in calls if index < len(seen.slots)}
        constant = len(values) == 1 and None not in values
        uses.append(
            SlotUse(
                dtype=str(slot.dtype).removeprefix("torch."),
                shape=list(slot.shape),
                constant=constant,
                value=next(iter(values)) if constant else None,
                nbytes=slot.nbytes,
                source=next(iter(sources)) if len(sources) == 1 and not constant else None,
            )
        )
    return uses


def _cost(calls: list[Observation], steps: int, link: LinkCost, fed_slots: list[SlotUse]) -> GlueCost:
    """Saved: the consumer's launches and input copies, and the copies back of the producer's outputs
    its inputs rest on (they stay on the device; one the host reads elsewhere crosses then, counted in
    the merged run); still paid: the slots a widened graph is fed."""
    back = sum(sum(seen.read_back) for seen in calls) / steps
    fed = sum(sum(seen.nbytes.values()) for seen in calls) / steps + back
    copies = sum(len(seen.nbytes) + len(seen.read_back) for seen in calls) / steps
    consumer_calls = len(calls) / steps
    touched = sum(seen.touched for seen in calls) / steps
    still = consumer_calls * len(fed_slots), consumer_calls * sum(s.nbytes for s in fed_slots)
    round_trips = consumer_calls + copies - still[0]
    moved = fed - still[1]
    link_s = round_trips * link.round_trip_us * 1e-6 + (
        moved / (link.bandwidth_gb_s * 1e9) if link.bandwidth_gb_s else 0
    )
    return GlueCost(
        host_ms_per_step=round(sum(seen.ms for seen in calls) / steps, 4),
        fed_bytes_per_step=round(fed, 1),
        fed_copies_per_step=round(copies, 3),
        consumer_calls_per_step=round(consumer_calls, 3),
        touched_bytes_per_step=round(touched, 1),
        link_saved_ms_per_step=round(link_s * 1e3, 6),
        device_ms_per_step=round(touched / (DEVICE_MEMORY_GB_S * 1e9) * 1e3, 6),
    )
