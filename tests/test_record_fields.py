"""Every field of a stored record that names a file, a folder or a command is typed by one of the
confined types (`records.names`, `records.intake`), so a field added tomorrow is checked on load
without anyone remembering to: this test walks every model reachable from the task record, the
bundle manifest and the job file, and fails on a path-like field typed plain `str`."""

from __future__ import annotations

import pathlib
import re
import types
import typing
from collections.abc import Iterator

import pytest
from omskills.host.job_store import StoredJob
from omskills.records.base import Record
from omskills.records.deploy import DeployManifest
from omskills.records.names import InputPathMarker, atc_argv, run_relative, safe_name
from omskills.records.task import TaskRecord
from pydantic import AfterValidator, BaseModel

ROOTS = (TaskRecord, DeployManifest, StoredJob)

# A field whose name says it may name a file, a folder, a graph (which becomes a file name) or a
# command. Matched against the field's name, or "<field>[key]" for a dict's keys.
PATH_LIKE = re.compile(
    r"(^|_)(path|paths|file|files|dir|folder|root|log|logs|script|json|html|figures|samples|onnx|om|"
    r"command|checkpoint|driver|source|video|out|output_dir|name|graph|graphs|candidate|first_batch|"
    r"deploy|defer|merged_into|contracts|boundaries|exports|toolchain)(\[key\])?$"
)

# Path-like by name but never used as one, each with why. A new entry needs a reason as good.
NOT_PATHS = {
    # Dotted Python paths inside the model, never joined to a folder.
    "ContractSpec.module_path": "a dotted module path",
    "ContractSpec.parent_path": "a dotted module path",
    "Candidate.module_path": "a dotted module path",
    "Seed.module_path": "a dotted module path",
    "ModuleProfile.path": "a dotted module path",
    "SpliceStats.module_path": "a dotted module path",
    "DeployedGraph.module_path": "a dotted module path",
    "TensorSpec.tree_path": "a pytree path",
    "NonTensorArg.tree_path": "a pytree path",
    "ModuleProfile.parent": "a dotted module path",
    # Names of ONNX tensors, packages, checks and routes: compared, printed, never a file name.
    "TensorSpec.name": "an ONNX tensor name",
    "OutputParity.name": "an output's name in the contract",
    "PackageProbe.name": "a Python distribution's name",
    "BuilderFunction.name": "a Python function's name",
    "PredictorClass.name": "a Python class's name",
    "ControlPlaneSite.name": "a Python function's name",
    "KnowledgeOutcome.name": "a known pitfall's name",
    "CandidateVerification.name": "a graph looked up in the record's own keys, never a file name",
    "GraphTraffic.merged_into": "a graph looked up in the record's own keys, never a file name",
    "SpliceStats.candidate": "a graph looked up in the record's own keys, never a file name",
    "FallbackEvent.candidate": "a graph looked up in the record's own keys, never a file name",
    # Where a figure or a finding came from, printed with it.
    "Provenance.source": "where a value came from, printed",
    "OpCheckRow.source": "the document a row cites",
    "PitfallHit.source": "the document a pitfall cites",
    "LinkCost.source": "the document a bandwidth cites",
    "SlotUse.source": "a graph call's input or output a slot is, compared with a chain's members by name",
    "PlanTime.source": "the document a rate cites",
    "ExportResult.fact_source": "the document a fact cites",
    # Files of the model's source tree, found by the inventory and shown to the user, never opened again.
    "Inventory.source": "shown, the intake's source is what is read",
    "Inventory.source_root": "shown, the intake's source is what is read",
    "Inventory.builder_file": "shown, never opened again",
    "Inventory.unparsed_files": "shown, never opened again",
    "BuilderFunction.file": "shown, never opened again",
    "PredictorClass.file": "shown, never opened again",
    "RequestRoute.file": "shown, never opened again",
    "ControlPlaneSite.file": "shown, never opened again",
    "PortabilityFinding.file": "shown, never opened again",
    "CannProbe.version_file": "the machine's CANN file the probe read, shown",
    # Labels of what was compared or checked, never opened again.
    "OpPrecheck.model": "the graph checked, as given: a label",
    "PrecisionReport.model": "the graph emulated: a label (its file is the export's)",
    "VariantResult.built_from": "the file a variant was made from: a label",
    # The job file's own fields: the server wrote them, and checks them when it reads one back.
    "StoredJob.skills_dir": "the server's own skills folder, compared with it on read",
    "StoredJob.task": "confined to the workspace when the job file is read (host.job_store)",
    "StoredJob.task_label": "shown",
    "VerifyReport.step_name": "what the driver calls a step, printed",
    "VerifyReport.backend_per_candidate": "graph -> the backend that ran it, looked up by the record's own keys",
    "StoredJob.tool": "a tool's name, looked up in the server's registry",
}

CONFINED = (safe_name, run_relative, atc_argv)


def _confined(metadata: tuple) -> bool:
    for item in metadata:
        if isinstance(item, InputPathMarker):
            return True
        if isinstance(item, AfterValidator) and getattr(item.func, "check", item.func) in CONFINED:
            return True
    return False


def _leaves(annotation: object, metadata: tuple = (), key: bool = False) -> Iterator[tuple[object, tuple, bool]]:
    """(leaf type, the Annotated metadata around it, whether it is a dict's key)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        base, *extra = typing.get_args(annotation)
        # A list typed as a whole (AtcArgv) confines its items.
        if typing.get_origin(base) is list and any(isinstance(m, AfterValidator) and m.func in CONFINED for m in extra):
            yield str, (*metadata, *extra), key
            return
        yield from _leaves(base, (*metadata, *extra), key)
        return
    if origin in (dict, typing.Union, types.UnionType, list, tuple, set, frozenset) or (
        origin is not None and getattr(origin, "__module__", "") == "collections.abc"
    ):
        for index, arg in enumerate(typing.get_args(annotation)):
            if arg is not Ellipsis:
                is_key = origin is dict and index == 0
                yield from _leaves(arg, metadata if not is_key else (), is_key)
        return
    yield annotation, metadata, key


def unconfined_path_fields(*roots: type[BaseModel]) -> list[str]:
    """ "Model.field" (or "Model.field[key]") of every path-like plain-str field reachable from `roots`."""
    seen: set[type] = set()
    found: list[str] = []

    def walk(model: type[BaseModel]) -> None:
        if model in seen:
            return
        seen.add(model)
        for name, field in model.model_fields.items():
            for leaf, metadata, key in _leaves(field.annotation, tuple(field.metadata)):
                if isinstance(leaf, type) and issubclass(leaf, BaseModel):
                    walk(leaf)
                    continue
                if leaf not in (str, pathlib.Path, pathlib.PurePath):
                    continue
                label = f"{model.__name__}.{name}" + ("[key]" if key else "")
                if PATH_LIKE.search(name + ("[key]" if key else "")) and not _confined(metadata):
                    if label not in NOT_PATHS and f"{model.__name__}.{name}" not in NOT_PATHS:
                        found.append(label)

    for root in roots:
        walk(root)
    return found


def test_every_path_like_field_of_a_stored_record_is_a_confined_type():
    assert unconfined_path_fields(*ROOTS) == []


def test_a_planted_path_field_typed_plain_str_fails_the_walk():
    class Planted(Record):
        weights_file: str
        graphs: dict[str, int]

    class Holder(Record):
        planted: Planted | None = None

    assert unconfined_path_fields(Holder) == ["Planted.weights_file", "Planted.graphs[key]"]


@pytest.mark.parametrize("stale", sorted(NOT_PATHS))
def test_every_exemption_names_a_field_that_exists(stale):
    model_name, field = stale.split(".")
    names = {m.__name__: m for m in _models(*ROOTS)}
    assert model_name in names and field in names[model_name].model_fields, f"{stale}: no such field"


def _models(*roots: type[BaseModel]) -> set[type[BaseModel]]:
    seen: set[type[BaseModel]] = set()
    todo = list(roots)
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for field in model.model_fields.values():
            for leaf, _, _ in _leaves(field.annotation, tuple(field.metadata)):
                if isinstance(leaf, type) and issubclass(leaf, BaseModel):
                    todo.append(leaf)
    return seen
