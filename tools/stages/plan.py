"""Stage 1 plan: rank the family's heavy subtrees by what the study run measured.

Score = compute share x boundary clarity x state factor. Clarity comes from the captured
contract (tensor-only I/O, constant non-tensor arguments, one call structure); candidates
reading session state across frames keep their rank but carry the flag, since their
inputs must be bridged from Python every frame. The first batch is every candidate with a
clear boundary and a share of at least MIN_SHARE.
"""

from __future__ import annotations

from pathlib import Path

from omskills.boundary.analysis import analyze_boundary
from omskills.errors import TaskRecordError
from omskills.report.inventory import render_inventory_report
from omskills.models import SeedCandidate, get_driver
from omskills.records.contracts import ContractSpec
from omskills.records.plan import Candidate, Plan
from omskills.records.profile import ProfileReport

MIN_SHARE = 0.005
STATE_FACTOR = 0.9


def _clarity(contract: ContractSpec) -> tuple[float, bool, list[str]]:
    decision = analyze_boundary(contract)
    if not decision.exportable:
        return 0.0, False, decision.reasons
    constants = sum(1 for a in contract.non_tensor_args if a.constant)
    # Many baked-in constants mean more Python state crossing the boundary.
    return round(1.0 / (1.0 + 0.05 * constants), 3), True, decision.reasons


def _state_dependent(contract: ContractSpec) -> bool:
    return any(s.provenance is not None and s.provenance.kind == "session" for s in contract.inputs)


def _candidate(seed: SeedCandidate, profile: ProfileReport, contract: ContractSpec | None) -> tuple[Candidate, bool, list[str]]:
    node = profile.node(seed.module_path)
    share = profile.subtree_share(seed.module_path)
    if contract is None:
        clarity, exportable, reasons = 0.0, False, ["never called on the main path"]
    else:
        clarity, exportable, reasons = _clarity(contract)
    state = contract is not None and _state_dependent(contract)
    score = share * clarity * (STATE_FACTOR if state else 1.0)
    return Candidate(
        name=seed.name, module_path=seed.module_path, module_class=node.module_class if node else "?",
        description=seed.description, group=seed.group, share=round(share, 5), calls=node.calls if node else 0,
        calls_per_frame=node.calls_per_frame if node else None, params=node.params_total if node else 0,
        boundary_clarity=clarity, state_dependent=state, score=round(score, 6), rank=0,
        status="pending", reason="",
    ), exportable, reasons


def plan_from_study(family: str, profile: ProfileReport, contracts: dict[str, ContractSpec],
                    deploy: list[str] | None = None) -> Plan:
    """Rank the family's seeds; `deploy` (intake.target.deploy) names candidates selected whatever their share."""
    seeds = get_driver(family).seed_candidates()
    deploy = deploy or []
    unknown = sorted(set(deploy) - {seed.name for seed in seeds})
    if unknown:
        raise TaskRecordError(f"intake.target.deploy: {unknown} are not {family} candidates "
                              f"({', '.join(seed.name for seed in seeds)})")
    rows = [_candidate(seed, profile, contracts.get(seed.name)) for seed in seeds]
    rows.sort(key=lambda r: r[0].score, reverse=True)
    batch = []
    for rank, (cand, exportable, reasons) in enumerate(rows, start=1):
        cand.rank = rank
        if not exportable:
            cand.status, cand.reason = "excluded", "boundary not exportable: " + "; ".join(reasons)
        elif cand.share < MIN_SHARE and cand.name not in deploy:
            cand.status, cand.reason = "deferred", f"share {cand.share:.2%} < {MIN_SHARE:.1%} of the main path"
        else:
            cand.status = "selected"
            cand.reason = (f"{cand.share:.1%} of main-path time, {cand.calls} calls"
                           f"{f' ({cand.calls_per_frame:.2f}/frame)' if cand.calls_per_frame else ''}; clear tensor boundary"
                           + ("; reads session state (bridged from Python each frame)" if cand.state_dependent else "")
                           + ("; named in intake.target.deploy" if cand.name in deploy else ""))
            batch.append(cand.name)
    covered = sum(c.share for c, _, _ in rows if c.name in batch)
    rationale = (f"first batch = every candidate with an exportable boundary and >= {MIN_SHARE:.1%} share "
                 f"or named in intake.target.deploy, "
                 f"ranked by share x clarity x state factor; together {covered:.1%} of main-path wall time "
                 f"(the rest is Python control plane, post-processing and small modules)")
    return Plan(candidates=[r[0] for r in rows], first_batch=batch, rationale=rationale)


def render_plan_report(plan: Plan, inventory, profile: ProfileReport, out_dir: Path) -> Path:
    rows = [(c.name, c.share, c.status, c.reason) for c in plan.candidates]
    return render_inventory_report(inventory, profile, rows, out_dir)
