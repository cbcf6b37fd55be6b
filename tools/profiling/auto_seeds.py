"""Seed candidates from a profile, for drivers that name none: the heaviest subtrees.

A subtree is kept when it holds parameters (weights belong on the device), runs for at least
AUTO_MIN_SHARE of the main path and lies at most AUTO_MAX_DEPTH levels below the root. Nested
ones are kept too: when a subtree's contract is not tensor-only, its children are the cut; when it
is, the plan deploys the outermost one and defers what runs inside it (deployed in its place if
the outer one fails to export). Shallow subtrees come first, so one deep branch cannot take every
place: the heaviest at depth 1, then at depth 2, and so on.
"""

from __future__ import annotations

import re

from omskills.records.plan import Seed
from omskills.records.profile import ProfileReport

AUTO_MIN_SHARE = 0.02
AUTO_MAX_DEPTH = 3
AUTO_MAX_SEEDS = 12


def seed_name(module_path: str) -> str:
    """"roi_heads.box_head" -> "roi_heads_box_head": a name valid in files, YAML keys and ONNX."""
    return re.sub(r"[^0-9A-Za-z_]+", "_", module_path).strip("_") or "root"


def seeds_from_profile(profile: ProfileReport) -> list[Seed]:
    nodes = [n for n in profile.nodes
             if 1 <= n.depth <= AUTO_MAX_DEPTH and n.share >= AUTO_MIN_SHARE and n.params_total > 0]
    nodes.sort(key=lambda n: (n.depth, -n.share))
    return [Seed(name=seed_name(n.path), module_path=n.path, group=n.path.split(".")[0],
                 description=f"{n.module_class}, {n.share:.1%} of the main path, {n.calls} calls (from the profile)")
            for n in nodes[:AUTO_MAX_SEEDS]]
