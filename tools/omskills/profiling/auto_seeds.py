"""Seed candidates from a profile, for drivers that name none: the heaviest subtrees.

A subtree is kept when it holds parameters (weights belong on the device), runs for at least
AUTO_MIN_SHARE of the time spent in the model and lies at most AUTO_MAX_DEPTH calls below the
root: depth counts the modules that call each other, not the dots of a path, so containers
never called (a ModuleList of blocks) are no level. The share is of the model's time (its
top-level module calls), not of the whole step: the driver's own Python (decoding, pre- and
post-processing, waiting for the CPU on a loaded machine) is never a candidate, and a step it
dominates still has a heaviest part of the model.
The plan then judges each candidate by its share of the whole main path.

Nested ones are kept too: when a subtree's contract is not tensor-only, its children are the cut;
when it is, the plan deploys the outermost one and defers what runs inside it (deployed in its
place if the outer one fails to export). Shallow subtrees come first, so one deep branch cannot
take every place: the heaviest at depth 1, then at depth 2, and so on.

A subtree the user names (intake.target.deploy) is a seed whatever its measured share: timings
of small heads swing with the machine's load, and a declared choice must not depend on them.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from omskills.records.plan import Seed
from omskills.records.profile import ModuleProfile, ProfileReport

AUTO_MIN_SHARE = 0.02
AUTO_MAX_DEPTH = 3
AUTO_MAX_SEEDS = 12


def seed_name(module_path: str) -> str:
    """ "roi_heads.box_head" -> "roi_heads_box_head": a name valid in files, YAML keys and ONNX."""
    return re.sub(r"[^0-9A-Za-z_]+", "_", module_path).strip("_") or "root"


def _model_share(node: ModuleProfile, profile: ProfileReport) -> float:
    return node.inclusive_s / profile.module_seconds if profile.module_seconds > 0 else 0.0


def call_depths(profile: ProfileReport) -> dict[str, int]:
    """Each module's depth in calls: 1 for what the root calls, one more per calling module."""
    by_path = {n.path: n for n in profile.nodes}
    depths: dict[str, int] = {}

    def depth(node: ModuleProfile) -> int:
        if node.path not in depths:
            depths[node.path] = node.depth  # a caller cycle stops here, at the path's own depth
            caller = by_path.get(node.parent) if node.parent is not None else None
            depths[node.path] = (
                0 if node.depth == 0 else (1 if caller is None or caller.depth == 0 else depth(caller) + 1)
            )
        return depths[node.path]

    for node in profile.nodes:
        depth(node)
    return depths


def _weighted_subtrees(profile: ProfileReport) -> list[tuple[int, ModuleProfile]]:
    depths = call_depths(profile)
    return [(depths[n.path], n) for n in profile.nodes if 1 <= depths[n.path] <= AUTO_MAX_DEPTH and n.params_total > 0]


def seeds_from_profile(profile: ProfileReport, named: Collection[str] = ()) -> list[Seed]:
    """The heaviest subtrees, plus every profiled subtree with parameters whose seed name is in `named`."""
    ranked = [(d, n) for d, n in _weighted_subtrees(profile) if _model_share(n, profile) >= AUTO_MIN_SHARE]
    ranked.sort(key=lambda pair: (pair[0], -pair[1].inclusive_s))
    nodes = [n for _, n in ranked][:AUTO_MAX_SEEDS]
    chosen = {n.path for n in nodes}
    nodes += [
        n
        for n in profile.nodes
        if seed_name(n.path) in named and n.params_total > 0 and n.path and n.path not in chosen
    ]
    return [
        Seed(
            name=seed_name(n.path),
            module_path=n.path,
            group=n.path.split(".")[0],
            description=(
                f"{n.module_class}, {_model_share(n, profile):.1%} of the model's time "
                f"({n.share:.1%} of the main path), {n.calls} calls (from the profile)"
            ),
        )
        for n in nodes
    ]


def why_no_seeds(profile: ProfileReport) -> str:
    """What the profile showed, for the error when it yields no seed."""
    heaviest = sorted((n for _, n in _weighted_subtrees(profile)), key=lambda n: -n.inclusive_s)[:5]
    shown = ", ".join(f"{n.path} {_model_share(n, profile):.1%}" for n in heaviest) or "none was called"
    measured = f" ({'; '.join(profile.notes)})" if profile.notes else ""
    return (
        f"a pass of the main path took {profile.total_seconds * 1000:.2f} ms{measured}, "
        f"{profile.module_seconds * 1000:.2f} ms of it in the model's modules; the heaviest subtrees with "
        f"parameters within {AUTO_MAX_DEPTH} calls of the root, "
        f"as shares of the model's time (a seed needs {AUTO_MIN_SHARE:.0%}): {shown}"
    )
