"""Stage 1 inventory: a static (`ast`) scan of the model source, with file:line evidence.

It answers, without importing the model: which builders exist (and is the configured one
there), which classes a user calls (those defining the driver's entry methods, e.g. a
predictor's request dispatchers, with the request types they route), what Python control plane
surrounds the network (tokenizer, session store, frame cache, object ids, prompts), and where the
code is CUDA-only. Only what building and running the model loads is scanned (training and
evaluation code is left out): the import closure inside the package of the builder's module, of the
modules defining the driver's entry classes and of those defining classes the model was seen to run
(an earlier study's profile). A model built from dotted names (Hydra's `_target_`, a registry,
`importlib`) imports its classes where no import statement shows: a dotted string naming a module of
the package counts as an import, and the entry classes are found by name wherever they are defined.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

from omskills.errors import InputError, OmskillsError
from omskills.records.inventory import (
    BuilderFunction,
    ControlPlaneSite,
    Inventory,
    PortabilityFinding,
    PredictorClass,
    RequestRoute,
)

DETAIL_CHARS = 160


# --- locating and parsing the source -----------------------------------------------------


@dataclass
class SourceFile:
    rel: str  # path relative to the source root, posix
    module: str  # dotted module name
    is_package: bool  # an __init__.py
    text: str

    @cached_property
    def tree(self) -> ast.Module | None:
        """Parsed on first use (most files of a package are never looked at); None if unparsable."""
        try:
            return ast.parse(self.text, filename=self.rel)
        except (SyntaxError, ValueError):
            return None

    @property
    def parsed(self) -> bool:
        return "tree" in self.__dict__

    @cached_property
    def lines(self) -> list[str]:
        return self.text.splitlines()

    def code(self, line: int) -> str:
        text = self.lines[line - 1].strip() if 0 < line <= len(self.lines) else ""
        return text if len(text) <= DETAIL_CHARS else text[: DETAIL_CHARS - 3] + "..."


def read_package(root: Path, package: str) -> dict[str, SourceFile]:
    """Every .py file of the package by dotted module name (read, parsed lazily)."""
    files: dict[str, SourceFile] = {}
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root)
        parts = list(rel.with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        files[module] = SourceFile(
            rel.as_posix(), module, is_package, path.read_text(encoding="utf-8", errors="replace")
        )
    return files


def package_state(root: Path, package: str) -> list[tuple[str, int, int]]:
    """Each .py file of the package with its size and modification time: what `read_package` would
    read, checked without reading it (a scan of an unchanged package is reused)."""
    return [
        (path.relative_to(root).as_posix(), stat.st_size, stat.st_mtime_ns)
        for path in sorted((root / package).rglob("*.py"))
        for stat in [path.stat()]
    ]


# "pkg.module.Class": a string a factory imports by (`importlib.import_module`, Hydra's `_target_`).
_DOTTED_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


def _imported_modules(source: SourceFile) -> Iterator[str]:
    """Every module an import statement anywhere in the file names (lazy imports included), and
    every dotted string that may name one (`"pkg.module.Class"`: the module and its parent)."""
    package = source.module if source.is_package else source.module.rpartition(".")[0]
    for node in ast.walk(source.tree or ast.Module(body=[], type_ignores=[])):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _DOTTED_NAME.fullmatch(node.value):
            yield node.value
            yield node.value.rpartition(".")[0]
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_closure(files: dict[str, SourceFile], starts: Sequence[str]) -> list[SourceFile]:
    """Files reachable from the `starts` modules through imports inside the package (+ parent __init__s)."""
    seen: set[str] = set()
    todo = list(starts)
    while todo:
        module = todo.pop()
        if module in seen or module not in files:
            continue
        seen.add(module)
        parts = module.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        todo.extend(m for m in _imported_modules(files[module]) if m in files)
    return [files[m] for m in sorted(seen, key=lambda m: files[m].rel) if files[m].tree is not None]


def defining_modules(files: dict[str, SourceFile], class_names: Iterable[str]) -> list[str]:
    """Modules of the package defining a class of one of these names, wherever the builder's
    imports lead (a factory may import them by name only)."""
    names = set(class_names)
    found = []
    for module, source in files.items():
        if not any(f"class {name}" in source.text for name in names) or source.tree is None:
            continue  # cheap filter before parsing
        if any(isinstance(node, ast.ClassDef) and node.name in names for node in ast.walk(source.tree)):
            found.append(module)
    return found


# --- builders and predictors -------------------------------------------------------------


def find_builders(files: Iterable[SourceFile], builder: str = "") -> list[BuilderFunction]:
    """Module-level `build_*` functions, and the configured builder whatever its name."""
    builders = []
    for source in files:
        if ("def build_" not in source.text and f"def {builder}(" not in source.text) or source.tree is None:
            continue  # cheap filter before parsing
        for node in source.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                node.name.startswith("build_") or node.name == builder
            ):
                params = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
                params += [f"*{node.args.vararg.arg}"] if node.args.vararg else []
                params += [f"**{node.args.kwarg.arg}"] if node.args.kwarg else []
                builders.append(
                    BuilderFunction(
                        name=node.name,
                        signature=f"({ast.unparse(node.args)})",
                        parameters=params,
                        file=source.rel,
                        line=node.lineno,
                    )
                )
    return builders


def _dotted(node: ast.AST) -> str | None:
    """ "torch.cuda.current_device" for an attribute chain on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id] + parts[::-1])
    return None


def _self_method_called(statements: list[ast.stmt]) -> str | None:
    """First `self.<method>(...)` called in a branch body: the method the request is routed to."""
    for statement in statements:
        for node in ast.walk(statement):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if isinstance(node.func.value, ast.Name) and node.func.value.id == "self":
                    return node.func.attr
    return None


def _request_selectors(method: ast.FunctionDef) -> set[str]:
    """Names that stand for the request in a dispatcher: its request parameter and the locals
    assigned from it (`request_type = request["type"]`, `kind = request.kind`)."""
    params = [a.arg for a in method.args.args if a.arg not in ("self", "cls")]
    selectors = set(params[:1])
    for node in ast.walk(method):
        if isinstance(node, ast.Assign) and any(
            isinstance(n, ast.Name) and n.id in selectors for n in ast.walk(node.value)
        ):
            selectors.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return selectors


def _is_type_selector(node: ast.expr, selectors: set[str]) -> bool:
    """`request_type`, `request["type"]`, `kind` (assigned from the request)...: names a request type."""
    return "type" in ast.unparse(node).lower() or any(
        isinstance(n, ast.Name) and n.id in selectors for n in ast.walk(node)
    )


def _compared_request_type(test: ast.expr, selectors: set[str]) -> tuple[str, int] | None:
    for node in ast.walk(test):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Eq, ast.In)):
            sides = [node.left, node.comparators[0]]
            constants = [s for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)]
            others = [s for s in sides if s not in constants]
            if constants and others and _is_type_selector(others[0], selectors):
                return constants[0].value, node.lineno
    return None


def _routes_in(method: ast.FunctionDef, source: SourceFile) -> list[RequestRoute]:
    selectors = _request_selectors(method)
    routes = []
    for node in ast.walk(method):
        if isinstance(node, ast.If):
            found = _compared_request_type(node.test, selectors)
            if found:
                routes.append(
                    RequestRoute(
                        request_type=found[0],
                        dispatcher=method.name,
                        method=_self_method_called(node.body),
                        file=source.rel,
                        line=found[1],
                    )
                )
        elif isinstance(node, ast.Match) and _is_type_selector(node.subject, selectors):
            for case in node.cases:
                if isinstance(case.pattern, ast.MatchValue) and isinstance(case.pattern.value, ast.Constant):
                    routes.append(
                        RequestRoute(
                            request_type=str(case.pattern.value.value),
                            dispatcher=method.name,
                            method=_self_method_called(case.body),
                            file=source.rel,
                            line=case.pattern.lineno,
                        )
                    )
        elif isinstance(node, ast.Dict):  # {"start_session": self.start_session, ...}
            for key, value in zip(node.keys, node.values):
                if (
                    isinstance(key, ast.Constant)
                    and isinstance(key.value, str)
                    and isinstance(value, ast.Attribute)
                    and isinstance(value.value, ast.Name)
                    and value.value.id == "self"
                ):
                    routes.append(
                        RequestRoute(
                            request_type=key.value,
                            dispatcher=method.name,
                            method=value.attr,
                            file=source.rel,
                            line=key.lineno,
                        )
                    )
    return routes


def _calls_super(method: ast.FunctionDef) -> bool:
    for node in ast.walk(method):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method.name:
            inner = node.func.value
            if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name) and inner.func.id == "super":
                return True
    return False


def find_predictors(
    files: Iterable[SourceFile], entry_methods: Sequence[str], entry_classes: Sequence[str] = ()
) -> list[PredictorClass]:
    """Classes defining one of the entry methods (only those named in `entry_classes`, when given),
    with the request types their dispatchers route."""
    predictors = []
    for source in files:
        for node in ast.walk(source.tree):
            if not isinstance(node, ast.ClassDef) or (entry_classes and node.name not in entry_classes):
                continue
            methods = [m for m in node.body if isinstance(m, ast.FunctionDef) and m.name in entry_methods]
            if not methods:
                continue
            predictors.append(
                PredictorClass(
                    name=node.name,
                    bases=[ast.unparse(b) for b in node.bases],
                    file=source.rel,
                    line=node.lineno,
                    dispatchers=[m.name for m in methods],
                    routes=[r for m in methods for r in _routes_in(m, source)],
                    delegates_to_base=[m.name for m in methods if _calls_super(m)],
                )
            )
    return _inherit_routes(predictors)


def _inherit_routes(predictors: list[PredictorClass]) -> list[PredictorClass]:
    """A dispatcher that calls super() also serves its base's routes (evidence stays in the base)."""
    by_name = {p.name: p for p in predictors}
    for predictor in predictors:
        for base_name in predictor.bases:
            base = by_name.get(base_name.rpartition(".")[2])
            if base is None:
                continue
            inherited = [r for r in base.routes if r.dispatcher in predictor.delegates_to_base]
            own = [
                r
                for r in predictor.routes
                if r.method is not None or not any(i.request_type == r.request_type for i in inherited)
            ]
            known = {(r.request_type, r.dispatcher) for r in own}
            predictor.routes = own + [r for r in inherited if (r.request_type, r.dispatcher) not in known]
    return predictors


# --- control plane -----------------------------------------------------------------------


class _Pattern(NamedTuple):
    category: str
    regex: re.Pattern[str]


def _patterns(*pairs: tuple[str, str]) -> list[_Pattern]:
    return [_Pattern(c, re.compile(r, re.IGNORECASE)) for c, r in pairs]


# First match wins; object ids come before prompts so `_obj_id_to_idx` is bookkeeping.
CLASS_PATTERNS = _patterns(
    ("tokenizer", r"tokeniz"),
    ("session_store", r"session"),
    ("frame_cache", r"(frame|video|image).*(loader|decoder|cache)"),
    ("prompt_management", r"prompt"),
)
FUNCTION_PATTERNS = _patterns(
    ("object_ids", r"obj_id|obj_idx|object_id"),
    ("tokenizer", r"tokeniz"),
    ("session_store", r"session|^init_state$|^reset_state$"),
    ("frame_cache", r"load_.*frame|frame_loader|image_feature|cached_feature"),
    ("prompt_management", r"prompt|^add_new_|^clear_.*(point|input)|^remove_object$"),
)
ATTRIBUTE_PATTERNS = _patterns(
    ("object_ids", r"obj_id|obj_idx|object_id"),
    ("tokenizer", r"tokenizer"),
    ("session_store", r"^_?all_.*states$|(inference|session|tracker)_states?$|sessions$|session_store"),
    ("frame_cache", r"frame.*(cache|loader)|cached_feature"),
)
STATE_KEY_PATTERNS = _patterns(
    ("object_ids", r"^obj_id|^obj_idx|^object_id"),
    ("frame_cache", r"^cached_features$|^images$"),
    ("prompt_management", r"point_inputs|mask_inputs|prompt"),
)
CALL_PATTERNS = _patterns(("tokenizer", r"tokeniz"))


def _classify(name: str, patterns: list[_Pattern]) -> str | None:
    return next((p.category for p in patterns if p.regex.search(name)), None)


def _assigned_names(node: ast.AST, declared: set[int]) -> Iterator[tuple[str, int]]:
    """Names bound by an assignment: module/class-level names (ids in `declared`) and self.<attr>.

    Local variables are left out: they are the control plane's plumbing, not its state.
    """
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    for target in targets:
        if isinstance(target, ast.Name) and id(node) in declared:
            yield target.id, target.lineno
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
            yield target.attr, target.lineno


def _is_nn_module(node: ast.ClassDef) -> bool:
    # Networks are compute, not control plane (PromptEncoder is a candidate, Prompt is not).
    return any("Module" in ast.unparse(base) or "nn." in ast.unparse(base) for base in node.bases)


def _control_candidates(source: SourceFile) -> Iterator[tuple[str, str, str, int]]:
    """(category, kind, name, line) for every control-plane-looking name in a file."""
    # Statements at module level or directly in a class body; ast.walk visits a class before
    # its body, so the set is complete for each assignment when it is reached.
    declared = {id(statement) for statement in source.tree.body}
    for node in ast.walk(source.tree):
        if isinstance(node, ast.ClassDef):
            declared.update(id(statement) for statement in node.body)
            found = [] if _is_nn_module(node) else [("class", node.name, node.lineno, CLASS_PATTERNS)]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found = [("function", node.name, node.lineno, FUNCTION_PATTERNS)]
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            found = [("attribute", name, line, ATTRIBUTE_PATTERNS) for name, line in _assigned_names(node, declared)]
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.slice, ast.Constant)
            and isinstance(node.slice.value, str)
        ):
            found = [("state_key", node.slice.value, node.lineno, STATE_KEY_PATTERNS)]
        elif isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
            name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            found = [("call", name, node.lineno, CALL_PATTERNS)]
        else:
            continue
        for kind, name, line, patterns in found:
            category = _classify(name, patterns)
            if category:
                yield category, kind, name, line


def find_control_plane(files: Iterable[SourceFile]) -> list[ControlPlaneSite]:
    sites = []
    for source in files:
        counts: Counter[tuple[str, str, str]] = Counter()
        first: dict[tuple[str, str, str], int] = {}
        for category, kind, name, line in _control_candidates(source):
            key = (category, kind, name)
            counts[key] += 1
            first[key] = min(first.get(key, line), line)
        for (category, kind, name), count in counts.items():
            line = first[(category, kind, name)]
            sites.append(
                ControlPlaneSite(
                    category=category,
                    name=name,
                    kind=kind,
                    file=source.rel,  # type: ignore[arg-type]
                    line=line,
                    occurrences=count,
                    detail=source.code(line),
                )
            )
    return sorted(sites, key=lambda s: (s.category, s.file, s.line))


# --- CUDA-only sites ---------------------------------------------------------------------


class _Site(NamedTuple):
    kind: str
    line: int
    end_line: int
    what: str


def _const_str(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _is_cuda_str(node: ast.AST | None) -> bool:
    value = _const_str(node)
    return value is not None and value.startswith("cuda")


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_bf16(node: ast.AST | None) -> bool:
    return node is not None and _dotted(node) in ("torch.bfloat16", "torch.bf16")


def _is_cuda_autocast(call: ast.Call, name: str) -> bool:
    if name.startswith("torch.cuda.amp") and name.endswith("autocast"):
        return True
    if not name.endswith("autocast"):
        return False
    device_type = _keyword(call, "device_type") or (call.args[0] if call.args else None)
    return _is_cuda_str(device_type)


def _call_sites(call: ast.Call) -> Iterator[_Site]:
    name = _dotted(call.func) or ""
    attr = call.func.attr if isinstance(call.func, ast.Attribute) else ""
    # Method calls are reported (and seen at run time) on the line of the method name.
    line = call.func.end_lineno if isinstance(call.func, ast.Attribute) and call.func.end_lineno else call.lineno
    end = call.end_lineno or line
    autocast = _is_cuda_autocast(call, name)
    if autocast:
        yield _Site("autocast", call.lineno, end, "CUDA autocast")
    elif name.startswith("torch.cuda."):
        yield _Site("cuda_query", call.lineno, end, f"{name}()")
    if attr == "cuda" and not name.startswith("torch."):
        yield _Site("cuda_call", line, end, ".cuda()")
    if attr == "pin_memory":
        yield _Site("pin_memory", line, end, ".pin_memory()")
    if isinstance(_keyword(call, "pin_memory"), ast.Constant) and _keyword(call, "pin_memory").value is True:  # type: ignore[union-attr]
        yield _Site("pin_memory", call.lineno, end, "pin_memory=True")
    if (name == "torch.device" or attr == "to") and call.args and _is_cuda_str(call.args[0]):
        yield _Site("device_cuda", line, end, f"{name or attr}({_const_str(call.args[0])!r})")
    for keyword in call.keywords:
        if (
            keyword.arg
            and keyword.arg.endswith("device")
            and keyword.arg != "device_type"
            and _is_cuda_str(keyword.value)
        ):
            yield _Site("device_cuda", call.lineno, end, f"{keyword.arg}={_const_str(keyword.value)!r}")
    if attr == "bfloat16" and not call.args:
        yield _Site("bf16_cast", line, end, ".bfloat16()")
    elif not autocast and (_is_bf16(_keyword(call, "dtype")) or (attr == "to" and any(_is_bf16(a) for a in call.args))):
        yield _Site("bf16_cast", line, end, "cast to torch.bfloat16")


def _import_sites(node: ast.Import | ast.ImportFrom) -> Iterator[_Site]:
    modules = (
        [a.name for a in node.names]
        if isinstance(node, ast.Import)
        else [node.module or ""] + [f"{node.module or ''}.{a.name}" for a in node.names]
    )
    line, end = node.lineno, node.end_lineno or node.lineno
    if any(m == "triton" or m.startswith("triton.") or ".triton" in m or m.endswith("_triton") for m in modules):
        yield _Site("triton", line, end, "imports triton (CUDA/ROCm kernels)")
    if any("flash_attn" in m or m.endswith(".fa3") or ".fa3." in m for m in modules):
        yield _Site("flash_attention", line, end, "imports flash attention")
    if any(m.split(".")[0] == "pkg_resources" for m in modules):
        yield _Site("pkg_resources", line, end, "imports pkg_resources (removed from new setuptools)")


def _default_sites(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> Iterator[_Site]:
    args = node.args
    positional = args.posonlyargs + args.args
    pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults))
    pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
    for arg, default in pairs:
        if "device" in arg.arg and _is_cuda_str(default):
            yield _Site("device_cuda", default.lineno, default.lineno, f"default {arg.arg}={_const_str(default)!r}")


def _node_sites(node: ast.AST) -> Iterator[_Site]:
    if isinstance(node, ast.Call):
        yield from _call_sites(node)
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
        yield from _import_sites(node)
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        yield from _default_sites(node)
    elif isinstance(node, (ast.If, ast.IfExp, ast.While)) and "use_fa3" in ast.unparse(node.test):
        yield _Site(
            "flash_attention",
            node.test.lineno,
            node.test.end_lineno or node.test.lineno,
            "branch on use_fa3 (FlashAttention-3)",
        )


def find_portability_sites(files: Iterable[SourceFile]) -> list[PortabilityFinding]:
    findings: dict[tuple[str, int, str], PortabilityFinding] = {}
    for source in files:
        for node in ast.walk(source.tree):
            for site in _node_sites(node):
                key = (source.rel, site.line, site.kind)
                if key not in findings:
                    findings[key] = PortabilityFinding(
                        file=source.rel,
                        line=site.line,
                        end_line=site.end_line,
                        kind=site.kind,
                        detail=f"{site.what}: {source.code(site.line)}",
                        in_static_scan=True,
                    )
    return sorted(findings.values(), key=lambda f: (f.file, f.line, f.kind))


# --- the scan ----------------------------------------------------------------------------


def scan_source(
    source_root: Path,
    package: str,
    builder: str | None,
    *,
    family: str,
    entry_methods: Sequence[str] = (),
    entry_classes: Sequence[str] = (),
    runtime_classes: Sequence[str] = (),
    source: str | None = None,
) -> Inventory:
    """Static inventory of `package` under `source_root`, from the builder's module (from the
    package's __init__ when no builder is named), the modules defining `entry_classes` and those
    defining `runtime_classes` (class names the model was seen to run)."""
    source_root = Path(source_root)
    if not (source_root / package).is_dir():
        raise InputError(f"intake.model.source: {source_root / package} does not exist")
    files = read_package(source_root, package)
    builders = find_builders(files.values(), builder or "")
    if builder:
        chosen = next((b for b in builders if b.name == builder), None)
        if chosen is None:
            known = ", ".join(sorted({b.name for b in builders})) or "none"
            raise OmskillsError(
                f"intake.model.builder: builder {builder!r} not found in {source_root / package} "
                f"(builders there: {known})"
            )
        start_file = chosen.file
    else:
        start_file = f"{package}/__init__.py"
    start = next(m for m, f in files.items() if f.rel == start_file)
    starts = list(dict.fromkeys([start, *defining_modules(files, [*entry_classes, *runtime_classes])]))
    closure = import_closure(files, starts)
    return Inventory(
        family=family,
        source=source or str(source_root),
        source_root=str(source_root.resolve()),
        package=package,
        builder=builder or "",
        builder_file=start_file,
        scanned_from=[files[m].rel for m in starts],
        entry_methods=list(entry_methods),
        entry_classes=list(entry_classes),
        files_scanned=len(closure),
        builders=builders,
        predictors=find_predictors(closure, entry_methods, entry_classes),
        control_plane=find_control_plane(closure),
        portability=find_portability_sites(closure),
        unparsed_files=sorted(f.rel for f in files.values() if f.parsed and f.tree is None),
    )
