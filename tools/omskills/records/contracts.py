"""I/O contracts of candidate modules, as captured on the real main path (stage 2).

Everything later (export wrapper, shape strategy, splice-back) is built from these.
A contract describes one candidate's call signature after flattening: the args/kwargs and
outputs are pytrees whose structure is kept as serialised tree specs; tensor leaves are
listed in flat order with their names; non-tensor leaves are constants (or flagged varying).
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

from omskills.records.base import Record
from omskills.records.details import DETAIL
from omskills.records.names import RunPath, SafeName
from pydantic import Field, field_validator, model_validator


def is_ancestor(ancestor: str, path: str) -> bool:
    """True when module `ancestor` strictly contains module `path` (dotted paths; "" is the root)."""
    if ancestor == path:
        return False
    return ancestor == "" or path.startswith(ancestor + ".")


# input: made from what the user gives (frames, an image, text tokens); session: kept across calls.
ProvenanceKind = Literal["input", "session", "parameter", "module_output", "constant", "unknown"]
# Where the values a tensor was computed from entered the run, through any number of torch ops and
# modules (contracts.provenance): user input; the model's parameters and buffers; tensors made from
# Python values (`torch.arange`, a tokenizer's `torch.tensor`); session state; a random op; or what
# the study could not trace (made outside torch's functions, or before the run).
LineageRoot = Literal["input", "parameter", "constant", "session", "random", "unknown"]


class Provenance(Record):
    kind: ProvenanceKind
    # For module_output: the producing module's path; for input/session: what tagged it.
    source: str | None = None
    # True when the tensor was computed from that origin by Python-side tensor ops (e.g. a value
    # thresholded in the model's Python code), not handed over as is.
    derived: bool = False
    # Every kind of root the value was computed from, each with the first source seen (a parameter's
    # name, the random op); None in records written before roots were traced.
    roots: dict[LineageRoot, str] | None = None

    @field_validator("kind", mode="before")
    @classmethod
    def _older_kinds(cls, kind: Any) -> Any:
        return "input" if kind in ("prompt", "image") else kind  # records written before "input" existed


class TensorSpec(Record):
    """One tensor leaf of a call, in flat order."""

    name: str  # valid ONNX I/O name, unique within the contract
    tree_path: str  # where it sits in the (args, kwargs) or output pytree, e.g. "[0][1].tensors"
    shape: list[int]  # shape seen in the first call
    dtype: str  # "float32", "int64", "bool", ...
    device: str
    # dim index (as str, YAML/JSON keys) -> sorted distinct sizes seen across calls (only dims that vary)
    dynamic_dims: dict[str, list[int]] = Field(default_factory=dict)
    provenance: Provenance | None = None  # inputs only
    consumers: list[str] = Field(default_factory=list)  # outputs only: modules that read it next
    # Outputs only: the study saw the host read other outputs of the graph after each call and never
    # this one, so a deployment may leave it on the device (a placeholder copies it back if read).
    unread: bool = False
    # Position among all leaves (tensor and non-tensor) of the flattened tree, to rebuild it.
    flat_index: int | None = None


class DimRef(Record):
    """Dimension `dim` of the contract input named `input` (its name or tree path).

    Bound to a quantity, the dim grows by `scale` per unit of it; a dim named by several
    quantities is the sum (a memory of 5184 tokens per memory frame + 16 per pointer frame).
    """

    input: str
    dim: int
    scale: int = Field(1, ge=1)


_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_FUNCTIONS: dict[str, Callable[..., Any]] = {"min": min, "max": max}


class ShapeExpression:
    """An integer formula over input shapes: `memory.shape[0] - memory_image.shape[0]`,
    `tokens.shape[1] // 16`. Names are contract inputs; allowed are `.shape[k]`,
    integers, + - * // %, min() and max(). Evaluated on ints, or on SymInts under torch.export."""

    def __init__(self, text: str) -> None:
        try:
            self.tree = ast.parse(text, mode="eval").body
        except SyntaxError as err:
            raise ValueError(f"expression {text!r} is not valid Python ({err.msg})") from None
        self.text = text
        self.names: list[str] = []
        self._check(self.tree)

    def _check(self, node: ast.AST) -> None:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            self._check(node.left)
            self._check(node.right)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _FUNCTIONS
            and not node.keywords
        ):
            for arg in node.args:
                self._check(arg)
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            pass
        elif self._shape_ref(node) is not None:
            self.names.append(self._shape_ref(node)[0])  # type: ignore[index]
        else:
            raise ValueError(
                f"expression {self.text!r}: {ast.unparse(node)!r} is not allowed "
                "(use <input>.shape[<k>], integers, + - * // %, min, max)"
            )

    @staticmethod
    def _shape_ref(node: ast.AST) -> tuple[str, int] | None:
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "shape"
            and isinstance(node.value.value, ast.Name)
            and isinstance(node.slice, ast.Constant)
            and type(node.slice.value) is int
        ):
            return node.value.value.id, node.slice.value
        return None

    def value(self, shape_of: Callable[[str], Sequence[Any]]) -> Any:
        return self._eval(self.tree, shape_of)

    def _eval(self, node: ast.AST, shape_of: Callable[[str], Sequence[Any]]) -> Any:
        if isinstance(node, ast.BinOp):
            return _OPERATORS[type(node.op)](self._eval(node.left, shape_of), self._eval(node.right, shape_of))
        if isinstance(node, ast.Call):
            return _FUNCTIONS[node.func.id](*(self._eval(a, shape_of) for a in node.args))  # type: ignore[union-attr]
        if isinstance(node, ast.Constant):
            return node.value
        name, dim = self._shape_ref(node)  # type: ignore[misc]
        return shape_of(name)[dim]


class ShapeDerivedArg(Record):
    """A non-tensor argument the source computes from input shapes, by a formula the driver gives.

    A video tracker passes `num_obj_ptr_tokens` = `memory.shape[0] - memory_image.shape[0]` (its
    decoder asserts it). It varies with the memory length, yet a graph can compute it from the shapes it is
    given, so the candidate stays exportable: the export computes it, the splice checks it per call.
    """

    expression: str
    evidence: str = ""

    @model_validator(mode="before")
    @classmethod
    def _from_dim_difference(cls, data: Any) -> Any:
        # Records written before formulas: a minuend dim minus an optional subtrahend dim.
        if isinstance(data, dict) and "minuend" in data:
            data = dict(data)
            text = "{input}.shape[{dim}]".format(**data.pop("minuend"))
            subtrahend = data.pop("subtrahend", None)
            if subtrahend:
                text += " - {input}.shape[{dim}]".format(**subtrahend)
            data["expression"] = text
        return data

    @field_validator("expression")
    @classmethod
    def _parses(cls, text: str) -> str:
        ShapeExpression(text)
        return text

    @property
    def inputs(self) -> list[str]:
        return ShapeExpression(self.expression).names

    def value(self, shape_of: Callable[[str], Sequence[Any]]) -> Any:
        """The argument from input shapes (`shape_of(input name)`); SymInts under export."""
        return ShapeExpression(self.expression).value(shape_of)

    def formula(self) -> str:
        return self.expression


class NonTensorArg(Record):
    tree_path: str
    value_repr: str  # the value (first call); when varying, the distinct values seen
    constant: bool  # the same on every call
    # The value itself when it is a JSON scalar (to rebuild the call without the live objects).
    value: bool | int | float | str | None = None
    flat_index: int | None = None
    # Set when the driver declares it a function of input shapes and every observed call agrees.
    derived: ShapeDerivedArg | None = None
    # A Python object holding tensors (a cache dict keyed by modules): state a graph cannot take.
    holds_tensors: bool = False


class CallShape(Record):
    """Shapes of one call, flat order, for the record of observed values."""

    inputs: list[list[int]]
    outputs: list[list[int]]


class Dispatch(Record):
    """This contract serves the calls of plan candidate `candidate` whose non-tensor arguments take
    these values (tree path -> value): one graph per observed value, chosen per call by the splice."""

    candidate: SafeName
    on: dict[str, bool | int | float | str | None]

    def label(self) -> str:
        return ", ".join(f"{path}={value!r}" for path, value in self.on.items())


class ContractSpec(Record):
    # The contract's (and its graph's) name: the plan candidate, or "<candidate>-<value>" for one
    # of several dispatched graphs (see `dispatch`).
    candidate: SafeName
    module_path: str  # dotted path from the model root, e.g. "detector.backbone.vision_backbone"
    module_class: str
    parent_path: str  # replacement point: parent module path ...
    attribute: str  # ... attribute on the parent ...
    method: str = "forward"  # ... and the method that is called
    calls: int
    calls_per_frame: float | None = None
    in_spec: Annotated[str, DETAIL]  # serialised pytree spec of (args, kwargs)
    out_spec: Annotated[str, DETAIL]  # serialised pytree spec of the output
    inputs: Annotated[list[TensorSpec], DETAIL]
    outputs: Annotated[list[TensorSpec], DETAIL]
    non_tensor_args: Annotated[list[NonTensorArg], DETAIL] = Field(default_factory=list)
    non_tensor_outputs: Annotated[list[NonTensorArg], DETAIL] = Field(default_factory=list)
    # Distinct call structures seen (tree spec + which leaves are tensors). Above 1, the fields above
    # describe the most frequent one and the other calls cannot be served by one graph.
    structure_variants: int = 1
    call_shapes: Annotated[list[CallShape], DETAIL] = Field(
        default_factory=list
    )  # distinct per-call shapes, first-seen order
    samples: Annotated[list[RunPath], DETAIL] = Field(default_factory=list)  # npz paths, relative to the task workdir
    dispatch: Dispatch | None = None
    # How many input sets its calls came from: the task's inputs and each of intake.shape_inputs.
    # With more than one, a dim that varies takes every size between the extremes seen.
    input_sets: int = Field(1, ge=1)

    @property
    def plan_candidate(self) -> str:
        """The plan candidate this contract belongs to."""
        return self.dispatch.candidate if self.dispatch else self.candidate

    def input_index(self, ref: str) -> int:
        """Position of the tensor input named `ref` (its name or tree path)."""
        for index, spec in enumerate(self.inputs):
            if ref in (spec.name, spec.tree_path):
                return index
        raise KeyError(
            f"candidate {self.candidate} has no tensor input named {ref!r} "
            f"(inputs: {', '.join(s.name for s in self.inputs)})"
        )

    def call_values(self, constants: Sequence[Any], tensors: Sequence[Any]) -> list[Any]:
        """Each non-tensor argument of one call: its bound constant, or its value derived from the
        shapes of `tensors` (the call's tensor inputs, in contract order)."""
        return [
            arg.derived.value(lambda ref: tensors[self.input_index(ref)].shape) if arg.derived else constant
            for arg, constant in zip(self.non_tensor_args, constants)
        ]


class QuantityLimit(Record):
    """A model quantity whose range the source shows, declared by the model-family driver.

    E.g. num_objects in [1, 16] because the source buckets objects by 16. `dims` names the input dims
    that follow it; left empty, it is matched to varying dims whose observed values lie in range.
    """

    quantity: str
    low: int
    high: int
    evidence: str = ""
    dims: list[DimRef] = Field(default_factory=list)


class QuantitySchedule(Record):
    """The values declared quantities take together, one row per case, where the source ties them.

    E.g. a tracker that at frame t attends to min(t, 7) memory frames and min(t, 16) pointer frames:
    16 joint values, where the ranges alone would allow 7 x 16.
    """

    quantities: list[str]
    rows: list[list[int]]
    evidence: str = ""

    @model_validator(mode="after")
    def _rows_fit(self) -> QuantitySchedule:
        bad = [row for row in self.rows if len(row) != len(self.quantities)]
        if bad or not self.rows:
            raise ValueError(f"rows: each row needs one value per quantity {self.quantities}; got {self.rows}")
        return self


class ShapeStrategy(Record):
    """Exactly one ATC shape strategy for a candidate."""

    kind: Literal["static", "dynamic_batch_size", "dynamic_image_size", "dynamic_dims", "dynamic_shape"]
    # Input name -> shape, -1 marking a dynamic dim (ATC --input_shape).
    input_shapes: dict[str, list[int]]
    # dynamic_batch_size: [[b1], [b2]...]; dynamic_image_size: [[h,w],...]; dynamic_dims: one row per gear,
    # values of all -1 dims in input order.
    gears: Annotated[list[list[int]], DETAIL] = Field(default_factory=list)
    # dynamic_shape: input name -> per-dim [min, max] ranges ("1~16" in ATC syntax)
    ranges: dict[str, list[list[int]]] = Field(default_factory=dict)
    rationale: Annotated[str, DETAIL]  # also in the decision analyze_boundaries records

    def serves(self) -> str:
        """The input sizes a graph built with this strategy takes, in a line: `x 1x3x[96..320]x[96..320]`."""

        def dims_of(name: str, shape: list[int]) -> str:
            ranges = self.ranges.get(name)
            sizes = [
                f"[{ranges[k][0]}..{ranges[k][1]}]"
                if size == -1 and ranges and ranges[k][0] != ranges[k][1]
                else str(ranges[k][0] if size == -1 and ranges else size)
                for k, size in enumerate(shape)
            ]
            return f"{name} {'x'.join(sizes) or 'scalar'}"

        shapes = "; ".join(dims_of(name, shape) for name, shape in self.input_shapes.items())
        if self.kind in ("dynamic_batch_size", "dynamic_image_size", "dynamic_dims"):
            values = ", ".join("x".join(map(str, gear)) for gear in self.gears[:12]) + (
                " ..." if len(self.gears) > 12 else ""
            )
            unit = {"dynamic_batch_size": "batch", "dynamic_image_size": "HxW", "dynamic_dims": "-1 dims"}[self.kind]
            return f"{shapes}; {unit} in {{{values}}} ({len(self.gears)} gears)"
        return shapes


class BoundaryDecision(Record):
    candidate: SafeName
    exportable: bool
    reasons: Annotated[list[str], DETAIL]  # the evidence; the decision analyze_boundaries records says the verdict
    control_plane: Annotated[list[str], DETAIL] = Field(default_factory=list)  # what stays in Python, with evidence
    shape_strategy: ShapeStrategy | None = None
    merge_with: list[str] = Field(default_factory=list)
