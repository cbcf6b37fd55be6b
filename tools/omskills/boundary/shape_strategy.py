"""The ATC shape strategy of one candidate: which input dims are dynamic and which values they take.

A dim is dynamic when it varies across the observed calls or when the model-family driver binds
it to a quantity whose range the source shows (`QuantityLimit`). A bound dim may follow several
quantities linearly (`DimRef.scale`): a tracker's memory length is HW x memory frames + 16 x
pointer frames. Declared quantities take every value of their range, unless a `QuantitySchedule`
says which values they take together (the memory frames and pointer frames grow with the frame
index, so 16 pairs occur of the 7 x 16 possible). Gears are then the dim values of those
assignments, crossed with the value combinations observed for unbound dims.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from omskills.contracts.batch_axes import batch_axes
from omskills.errors import OmskillsError
from omskills.records.contracts import ContractSpec, QuantityLimit, QuantitySchedule, ShapeStrategy

# ATC accepts 2..100 gears for --dynamic_batch_size, --dynamic_image_size and --dynamic_dims.
MIN_GEARS = 2
MAX_GEARS = 100

SourceLimits = dict[str, list[int]] | list[QuantityLimit | QuantitySchedule]


@dataclass
class _Dim:
    """One dynamic dimension of one input, with its value in each distinct call shape."""

    input_index: int
    input_name: str
    dim: int
    per_call: tuple[int, ...]
    terms: list[tuple[QuantityLimit, int]] = field(default_factory=list)  # value = sum(scale x quantity)

    @property
    def observed(self) -> list[int]:
        return sorted(set(self.per_call))

    def value(self, assignment: dict[str, int]) -> int:
        return sum(scale * assignment[q.quantity] for q, scale in self.terms)

    def bounds(self) -> tuple[int, int]:
        return sum(s * q.low for q, s in self.terms), sum(s * q.high for q, s in self.terms)


@dataclass
class _Symbol:
    """Dims that move together: bound to the same quantities, or equal in every observed call."""

    dims: list[_Dim]
    spanned: bool = False  # bound to the range between the extremes several input sets showed

    @property
    def declared(self) -> bool:
        return bool(self.dims[0].terms)

    def range(self) -> list[int]:
        if self.declared:
            return list(self.dims[0].bounds())
        return [min(self.dims[0].observed), max(self.dims[0].observed)]

    def describe(self) -> str:
        dims = ", ".join(f"{d.input_name}[{d.dim}]" for d in self.dims)
        if not self.declared:
            return f"{dims} observed {self.dims[0].observed}"
        terms = self.dims[0].terms
        formula = " + ".join(f"{s} x {q.quantity}" if s != 1 else q.quantity for q, s in terms)
        ranges = ", ".join(
            f"{q.quantity} in [{q.low}, {q.high}]" + (f" ({q.evidence})" if q.evidence else "") for q, _ in terms
        )
        if self.spanned:
            return f"{dims} take every size in [{terms[0][0].low}, {terms[0][0].high}] ({terms[0][0].evidence})"
        return f"{dims} follow {formula}; {ranges} from the source"


@dataclass
class _Limits:
    quantities: list[QuantityLimit]
    schedules: list[QuantitySchedule]


def _as_limits(source_limits: SourceLimits | None) -> _Limits:
    if source_limits is None:
        return _Limits([], [])
    if isinstance(source_limits, dict):
        limits = []
        for quantity, bounds in source_limits.items():
            if len(bounds) != 2 or bounds[0] > bounds[1]:
                raise OmskillsError(f"source_limits[{quantity!r}] must be [low, high] with low <= high, got {bounds}")
            limits.append(
                QuantityLimit(quantity=quantity, low=bounds[0], high=bounds[1], evidence="declared by the driver")
            )
        return _Limits(limits, [])
    return _Limits(
        [q for q in source_limits if isinstance(q, QuantityLimit)],
        [s for s in source_limits if isinstance(s, QuantitySchedule)],
    )


def _input_index(contract: ContractSpec, ref: str, quantity: str) -> int:
    try:
        return contract.input_index(ref)
    except KeyError as exc:
        raise OmskillsError(f"source limit {quantity}: {exc.args[0]}") from exc


def _per_call(contract: ContractSpec, index: int, dim: int) -> tuple[int, ...]:
    shapes = contract.call_shapes or []
    values = tuple(s.inputs[index][dim] for s in shapes if dim < len(s.inputs[index]))
    return values or (contract.inputs[index].shape[dim],)


def _bound_dims(contract: ContractSpec, limits: list[QuantityLimit]) -> dict[tuple[int, int], _Dim]:
    """Dims the driver binds to quantities, each with its terms; ranges checked against the calls."""
    dims: dict[tuple[int, int], _Dim] = {}
    for limit in limits:
        for ref in limit.dims:
            index = _input_index(contract, ref.input, limit.quantity)
            spec = contract.inputs[index]
            if not 0 <= ref.dim < len(spec.shape):
                raise OmskillsError(
                    f"source limit {limit.quantity}: input {spec.name} has no dim {ref.dim} (shape {spec.shape})"
                )
            found = dims.setdefault(
                (index, ref.dim), _Dim(index, spec.name, ref.dim, _per_call(contract, index, ref.dim))
            )
            found.terms.append((limit, ref.scale))
    for found in dims.values():
        low, high = found.bounds()
        outside = [v for v in found.observed if not low <= v <= high]
        if outside:
            ranges = ", ".join(f"{q.quantity} [{q.low}, {q.high}]" for q, _ in found.terms)
            raise OmskillsError(
                f"source limit {ranges} does not hold for {found.input_name}[{found.dim}] "
                f"(allowed [{low}, {high}]): observed {found.observed}"
            )
    # A dim whose quantities have a single value is not dynamic (e.g. 1 bucket of objects).
    return {key: d for key, d in dims.items() if d.bounds()[0] < d.bounds()[1]}


def _collect_dims(contract: ContractSpec, limits: _Limits) -> tuple[list[_Dim], list[str]]:
    """Dynamic dims: those bound to declared quantities, and those observed to vary."""
    notes: list[str] = []
    dims = _bound_dims(contract, limits.quantities)
    unbound = [q for q in limits.quantities if not q.dims]
    for index, spec in enumerate(contract.inputs):
        for dim_key in spec.dynamic_dims:
            dim = int(dim_key)
            if (index, dim) in dims:
                continue
            found = _Dim(index, spec.name, dim, _per_call(contract, index, dim))
            fitting = [q for q in unbound if all(q.low <= v <= q.high for v in found.observed)]
            if len(fitting) == 1:
                found.terms = [(fitting[0], 1)]
            elif len(fitting) > 1:
                notes.append(
                    f"{spec.name}[{dim}] fits several declared quantities "
                    f"({', '.join(q.quantity for q in fitting)}): bind it with DimRef to use a source range"
                )
            dims[(index, dim)] = found
    return sorted(dims.values(), key=lambda d: (d.input_index, d.dim)), notes


def _symbols(dims: list[_Dim]) -> list[_Symbol]:
    symbols: list[_Symbol] = []
    for dim in dims:
        key = [(id(q), s) for q, s in dim.terms]
        for symbol in symbols:
            head = symbol.dims[0]
            same_terms = bool(key) and key == [(id(q), s) for q, s in head.terms]
            same_values = not key and not head.terms and head.per_call == dim.per_call
            if same_terms or same_values:
                symbol.dims.append(dim)
                break
        else:
            symbols.append(_Symbol([dim]))
    return symbols


def _span_observed(symbols: list[_Symbol], input_sets: int) -> None:
    """Each symbol seen only in calls bound to a quantity ranging from its smallest to its largest
    value seen: the calls came from several input sets chosen to bound the sizes to serve, so every
    size between theirs is one the deployment must take, not only those the sets happened to show."""
    for symbol in symbols:
        if symbol.declared:
            continue
        low, high = symbol.range()
        head = symbol.dims[0]
        limit = QuantityLimit(
            quantity=f"{head.input_name}[{head.dim}]",
            low=low,
            high=high,
            evidence=f"between the sizes the {input_sets} input sets showed",
        )
        for dim in symbol.dims:
            dim.terms = [(limit, 1)]
        symbol.spanned = True


def _input_shapes(contract: ContractSpec, dims: list[_Dim]) -> dict[str, list[int]]:
    shapes = {spec.name: list(spec.shape) for spec in contract.inputs}
    for dim in dims:
        shapes[dim.input_name][dim.dim] = -1
    return shapes


def _assignment_count(quantities: list[QuantityLimit], schedules: list[QuantitySchedule]) -> int:
    scheduled = {q for s in schedules for q in s.quantities}
    free = [q for q in quantities if q.quantity not in scheduled]
    return math.prod(q.high - q.low + 1 for q in free) * math.prod(len(s.rows) for s in schedules)


def _assignments(quantities: list[QuantityLimit], schedules: list[QuantitySchedule]) -> list[dict[str, int]]:
    """Every joint value of the declared quantities: scheduled rows crossed with free ranges."""
    scheduled = {q for s in schedules for q in s.quantities}
    free = [q for q in quantities if q.quantity not in scheduled]
    parts: list[list[dict[str, int]]] = [[{q.quantity: v} for v in range(q.low, q.high + 1)] for q in free]
    parts += [[dict(zip(s.quantities, row)) for row in s.rows] for s in schedules]
    return [{k: v for part in combo for k, v in part.items()} for combo in itertools.product(*parts)]


def _relevant_schedules(declared: list[QuantityLimit], schedules: list[QuantitySchedule]) -> list[QuantitySchedule]:
    names = {q.quantity for q in declared}
    relevant = []
    for schedule in schedules:
        if not set(schedule.quantities) & names:
            continue
        missing = sorted(set(schedule.quantities) - names)
        if missing:
            raise OmskillsError(f"quantity schedule {schedule.quantities}: {missing} bound to no dim of this candidate")
        for q in declared:
            if q.quantity in schedule.quantities:
                column = [row[schedule.quantities.index(q.quantity)] for row in schedule.rows]
                if not all(q.low <= v <= q.high for v in column):
                    raise OmskillsError(
                        f"quantity schedule {schedule.quantities}: {q.quantity} leaves its range "
                        f"[{q.low}, {q.high}] ({sorted(set(column))})"
                    )
        relevant.append(schedule)
    return relevant


def _gears(
    contract: ContractSpec, symbols: list[_Symbol], dims: list[_Dim], schedules: list[QuantitySchedule]
) -> tuple[int, list[list[int]]]:
    """Number of gears and, when within ATC's limit, one row per gear: every -1 dim's value, input order.

    Declared quantities contribute their assignments (ranges, or a schedule's rows); observed-only
    symbols contribute the value combinations actually seen together in one call (not their
    cross product).
    """
    declared_dims = [d for d in dims if d.terms]
    declared = list({id(q): q for d in declared_dims for q, _ in d.terms}.values())
    schedules = _relevant_schedules(declared, schedules)
    observed = [s for s in symbols if not s.declared]
    calls = len(observed[0].dims[0].per_call) if observed else 0
    observed_rows = sorted({tuple(s.dims[0].per_call[c] for s in observed) for c in range(calls)}) or [()]
    count = len(observed_rows) * _assignment_count(declared, schedules)
    if count > MAX_GEARS:
        return count, []
    declared_rows = {tuple(d.value(a) for d in declared_dims) for a in _assignments(declared, schedules)}
    _check_calls_covered(contract, declared_dims, declared_rows)
    rows = set()
    for declared_values in declared_rows:
        for observed_values in observed_rows:
            by_dim = dict(zip((id(d) for d in declared_dims), declared_values))
            by_dim.update({id(d): v for s, v in zip(observed, observed_values) for d in s.dims})
            rows.add(tuple(by_dim[id(d)] for d in dims))
    return len(rows), [list(r) for r in sorted(rows)]


def _check_calls_covered(contract: ContractSpec, declared_dims: list[_Dim], rows: set[tuple[int, ...]]) -> None:
    """Every observed call must be one of the declared gears: else the driver's source facts are wrong."""
    if not declared_dims:
        return
    calls = len(declared_dims[0].per_call)
    for c in range(calls):
        seen = tuple(d.per_call[c] for d in declared_dims)
        if seen not in rows:
            named = ", ".join(f"{d.input_name}[{d.dim}]={v}" for d, v in zip(declared_dims, seen))
            raise OmskillsError(
                f"{contract.candidate}: observed call with {named} is none of the gears the source "
                "limits and schedules allow: the declared quantities do not describe this call"
            )


def _image_sizes(dims: list[_Dim], contract: ContractSpec, gears: list[list[int]]) -> list[list[int]] | None:
    """[[h, w], ...] when only H and W of 4-D inputs vary, every such input having the same H and W."""
    inputs = {d.input_index for d in dims}
    if not all(
        len(contract.inputs[i].shape) == 4 and {d.dim for d in dims if d.input_index == i} == {2, 3} for i in inputs
    ):
        return None
    # dims are in input order, so each row is h1, w1, h2, w2, ...
    if any(len(set(row[0::2])) > 1 or len(set(row[1::2])) > 1 for row in gears):
        return None
    return [list(p) for p in sorted({(row[0], row[1]) for row in gears})]


def _static(
    contract: ContractSpec, limits: _Limits, input_shapes: dict[str, list[int]], notes: list[str]
) -> ShapeStrategy:
    if contract.calls <= 1:
        known = (
            "no source limit known"
            if not limits.quantities
            else (
                f"the declared quantities ({', '.join(q.quantity for q in limits.quantities)}) name no dim of it "
                "(bind them with DimRef)"
            )
        )
        why = (
            f"only one call observed and {known}: static on the observed shapes "
            "(a single sample cannot show which dims vary)"
        )
    else:
        why = (
            f"{contract.calls} call{'s' if contract.calls != 1 else ''} observed, "
            "no dimension varies and no source range is declared"
        )
    return ShapeStrategy(kind="static", input_shapes=input_shapes, rationale="; ".join([why] + notes))


def _ranges(contract: ContractSpec, symbols: list[_Symbol]) -> dict[str, list[list[int]]]:
    ranges: dict[str, list[list[int]]] = {}
    for symbol in symbols:
        for dim in symbol.dims:
            spec = contract.inputs[dim.input_index]
            ranges.setdefault(spec.name, [[size, size] for size in spec.shape])[dim.dim] = symbol.range()
    return ranges


def _other_batches(contract: ContractSpec, strategy: ShapeStrategy) -> str:
    """What a batch that is no gear does: run as gear-sized calls, or fall back to PyTorch and why."""
    axes = batch_axes(contract, strategy)
    if isinstance(axes, str):
        return f"A batch that is no gear falls back to PyTorch: it cannot run as gear-sized calls ({axes})."
    return "A batch between the gears or beyond the largest runs as gear-sized calls, the last one padded."


def propose_shape_strategy(contract: ContractSpec, source_limits: SourceLimits | None = None) -> ShapeStrategy:
    """Exactly one ATC shape strategy, from observed varying dims and declared source ranges."""
    limits = _as_limits(source_limits)
    dims, notes = _collect_dims(contract, limits)
    input_shapes = _input_shapes(contract, dims)
    if not dims:
        return _static(contract, limits, input_shapes, notes)
    symbols = _symbols(dims)
    if contract.input_sets > 1:
        _span_observed(symbols, contract.input_sets)
    described = "; ".join(s.describe() for s in symbols)
    only_observed = not any(s.declared for s in symbols)
    caveat = (
        (
            " Gears cover only values seen on the main path; a call outside them falls back to PyTorch — "
            "declare a QuantityLimit in the driver where the source shows the real range."
        )
        if only_observed
        else ""
    )
    count, gears = _gears(contract, symbols, dims, limits.schedules)
    fits_gears = MIN_GEARS <= count <= MAX_GEARS
    image_sizes = _image_sizes(dims, contract, gears) if fits_gears else None

    if fits_gears and len(symbols) == 1 and all(d.dim == 0 for d in dims):
        batches = [[b] for b in sorted({row[0] for row in gears})]  # one value per gear: the batch size
        strategy = ShapeStrategy(
            kind="dynamic_batch_size",
            input_shapes=input_shapes,
            gears=batches,
            rationale=f"only dim 0 varies, the same in every input: {described}.",
        )
        return strategy.model_copy(update={"rationale": f"{strategy.rationale} {_other_batches(contract, strategy)}"})
    if image_sizes is not None:
        return ShapeStrategy(
            kind="dynamic_image_size",
            input_shapes=input_shapes,
            gears=image_sizes,
            rationale=f"only H and W of 4-D image inputs vary: {described}.{caveat}",
        )
    if fits_gears:
        scheduled = "".join(
            f"; {s.quantities} take {len(s.rows)} joint values ({s.evidence})"
            for s in _relevant_schedules(list({id(q): q for d in dims for q, _ in d.terms}.values()), limits.schedules)
        )
        return ShapeStrategy(
            kind="dynamic_dims",
            input_shapes=input_shapes,
            gears=gears,
            rationale=f"{count} gears over {len(dims)} dynamic dims: {described}{scheduled}.{caveat}",
        )
    too_many = f"exceed ATC's {MAX_GEARS}" if count > MAX_GEARS else f"are below ATC's minimum of {MIN_GEARS}"
    why = f"{count} value combinations {too_many} gears: dynamic shape with ranges; {described}"
    if only_observed:
        why += "; ranges are the observed min/max only"
    return ShapeStrategy(
        kind="dynamic_shape",
        input_shapes=input_shapes,
        ranges=_ranges(contract, symbols),
        rationale="; ".join([why] + notes),
    )
