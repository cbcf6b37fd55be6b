"""The host<->device link of an Ascend target as the traffic cost model sees it: defaults per
SoC family, each with what it rests on, and `intake.target` overriding either figure.

Only figures a source states are used as facts; where none was found the default says it is an
assumption. The bandwidth is the link's theoretical rate per direction (a real copy reaches
less), so predicted link times are lower bounds of the bytes' share.
"""

from __future__ import annotations

from dataclasses import dataclass

from omskills.records.intake import TargetSpec
from omskills.records.traffic import LinkCost

PCIE3_X16_GB_S = 15.75  # 8 GT/s x 16 lanes x 128/130 encoding / 8 bits, per direction
PCIE4_X16_GB_S = 31.5  # 16 GT/s x 16 lanes x 128/130 encoding / 8 bits, per direction

ROUND_TRIP_US = 9.5
ROUND_TRIP_SOURCE = (
    "round trip: a synchronous aclrtMemcpy of 4 to 64 bytes, ~9.5 us on Atlas A2/A3 with CANN 9.0.0 "
    "(github.com/hw-native-sys/simpler, pull request 2234); no published launch overhead of "
    "aclmdlExecute was found, so a launch is counted as one such round trip"
)


@dataclass(frozen=True)
class FamilyLink:
    soc_prefix: str
    bandwidth_gb_s: float | None  # None: host and NPU share memory
    source: str


# Most specific prefix first.
FAMILY_LINKS = (
    FamilyLink(
        "Ascend310B",
        None,
        "Atlas 200I/500 A2 (Ascend 310B): host CPU and NPU share the SoC's memory and a "
        "host<->device copy runs device to device (CANN runtime API, aclrtMemcpyAsync, RC mode)",
    ),
    FamilyLink(
        "Ascend310P", PCIE4_X16_GB_S, "Atlas 300I Pro / 300I Duo (Ascend 310P) specifications: PCIe Gen 4.0 x16"
    ),
    FamilyLink(
        "Ascend910B",
        PCIE4_X16_GB_S,
        "Atlas 800T A2 / 800I A2 (Ascend 910B) specifications: each NPU linked to the "
        "CPU by PCIe 4.0 x16 (an Atlas 300I A2 card is PCIe 5.0 x16: set "
        "intake.target.link_gb_s to 63)",
    ),
    FamilyLink(
        "Ascend910", PCIE4_X16_GB_S, "assumed PCIe 4.0 x16: no published host link figure was found for this SoC"
    ),
    FamilyLink(
        "Ascend310", PCIE3_X16_GB_S, "assumed PCIe 3.0 x16: no published host link figure was found for this SoC"
    ),
)


def link_cost(target: TargetSpec) -> LinkCost:
    """The link figures for `target`: its own settings where given, else its family's defaults."""
    family = next((f for f in FAMILY_LINKS if target.soc.startswith(f.soc_prefix)), None)
    sources = []
    if target.link_gb_s is not None:
        bandwidth, sources = target.link_gb_s, ["bandwidth: intake.target.link_gb_s"]
    elif family is not None:
        bandwidth, sources = family.bandwidth_gb_s, [f"bandwidth: {family.source}"]
    else:
        bandwidth, sources = PCIE4_X16_GB_S, [f"bandwidth: assumed PCIe 4.0 x16 ({target.soc} is in no known family)"]
    if target.round_trip_us is not None:
        round_trip, sources = target.round_trip_us, [*sources, "round trip: intake.target.round_trip_us"]
    else:
        round_trip, sources = ROUND_TRIP_US, [*sources, ROUND_TRIP_SOURCE]
    return LinkCost(soc=target.soc, bandwidth_gb_s=bandwidth, round_trip_us=round_trip, source="; ".join(sources))
