"""ATC: validated options, the exact command line, and running it where CANN is installed.

Parameter rules follow CANN's "ATC离线模型编译工具" guide (8.0.0; pages `atlasatcparam_16_*`,
see skills/onnx-atc-pipeline/references/atc-parameters.md). Where atc is not installed the
command is written as a ready-to-run script and the result says `not_run: atc missing`; a
result says `converted` only when atc exited 0 and the .om file is there.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from omskills.errors import InputError
from omskills.files import sha256_file
from omskills.records.base import Record
from omskills.records.choices import PRECISION_MODES, PrecisionMode  # noqa: F401 (re-exported)
from omskills.records.contracts import ShapeStrategy
from omskills.records.intake import KNOWN_SOCS  # the --soc_version names, kept where records can read them
from omskills.records.toolchain import AtcErrorAdvice, AtcInstall, AtcResult
from pydantic import Field, ValidationError, field_validator, model_validator

ShapeStrategyKind = Literal["static", "dynamic_batch_size", "dynamic_image_size", "dynamic_dims", "dynamic_shape"]

SOC_FLAG = "--soc_version="


def soc_problem(soc: str) -> str | None:
    """Why `soc` is not a --soc_version ATC knows (with the closest known names), None if it is."""
    if soc in KNOWN_SOCS:
        return None
    by_lower = {known.lower(): known for known in KNOWN_SOCS}
    close = [by_lower[m] for m in difflib.get_close_matches(soc.lower(), list(by_lower), n=3, cutoff=0.6)]
    hint = f"; did you mean {' or '.join(close)}?" if close else f"; known: {', '.join(KNOWN_SOCS)}"
    return f"unknown SoC {soc!r} (the name `npu-smi info` shows, prefixed 'Ascend'){hint}"


def check_soc(soc: str, field: str) -> str:
    """`soc` if ATC knows it, else an InputError naming `field` with a did-you-mean."""
    problem = soc_problem(soc)
    if problem:
        raise InputError(f"{field}: {problem}")
    return soc


def soc_of_command(command: list[str]) -> str | None:
    """The --soc_version an ATC command line was written for (None if it names none)."""
    return next((arg.removeprefix(SOC_FLAG) for arg in command if arg.startswith(SOC_FLAG)), None)


InputFormat = Literal["NCHW", "NHWC", "ND", "NCDHW", "NDHWC"]
AtcLogLevel = Literal["debug", "info", "warning", "error", "null"]

# Gear counts accepted by --dynamic_batch_size, --dynamic_image_size and --dynamic_dims: (1, 100].
MIN_GEARS, MAX_GEARS = 2, 100
ONNX_FRAMEWORK = "5"
DEFAULT_TOOLKIT_HOMES = ("/usr/local/Ascend/ascend-toolkit/latest",)
_NAME_RE = re.compile(r"^[^:;,\s\"']+$")


class AtcOptions(Record):
    """One ATC conversion. Exactly one shape strategy: none of the four dynamic fields (static),
    or one of them. -1 in `input_shapes` marks a dimension the strategy makes dynamic."""

    model: str
    output: str  # path prefix; ATC appends .om (a trailing .om is dropped here)
    soc_version: str
    input_shapes: dict[str, list[int]] = Field(default_factory=dict)
    dynamic_batch_size: list[int] | None = None  # gears of the batch (dim 0) size
    dynamic_image_size: list[list[int]] | None = None  # gears of [height, width]
    dynamic_dims: list[list[int]] | None = None  # per gear, the values of every -1, inputs in order
    # per input, per dim: [n] fixed, [min, max] range, [-1] unbounded (ATC "n", "min~max", "-1")
    dynamic_shape: dict[str, list[list[int]]] | None = None
    precision_mode: PrecisionMode | None = None
    keep_dtype: str | None = None  # file naming the nodes kept at their original dtype (--keep_dtype)
    input_format: InputFormat | None = None
    log: AtcLogLevel = "error"

    @field_validator("output")
    @classmethod
    def _drop_om_suffix(cls, value: str) -> str:
        return value[: -len(".om")] if value.endswith(".om") else value

    @field_validator("soc_version")
    @classmethod
    def _known_soc(cls, value: str) -> str:
        problem = soc_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("input_shapes")
    @classmethod
    def _valid_shapes(cls, shapes: dict[str, list[int]]) -> dict[str, list[int]]:
        for name, dims in shapes.items():
            if not _NAME_RE.match(name):
                raise ValueError(
                    f"input name {name!r} cannot be passed to --input_shape (no ':', ';', ',', quotes or spaces)"
                )
            if any(d < -1 or d == 0 for d in dims):
                raise ValueError(f"input {name!r}: dims must be positive or -1, got {dims}")
        return shapes

    @model_validator(mode="after")
    def _one_strategy(self) -> AtcOptions:
        given = [
            k
            for k in ("dynamic_batch_size", "dynamic_image_size", "dynamic_dims", "dynamic_shape")
            if getattr(self, k) is not None
        ]
        if len(given) > 1:
            raise ValueError(
                f"shape strategies {given} given together; ATC accepts exactly one (or none, for static shapes)"
            )
        check = {
            "static": self._check_static,
            "dynamic_batch_size": self._check_batch,
            "dynamic_image_size": self._check_image,
            "dynamic_dims": self._check_dims,
            "dynamic_shape": self._check_ranges,
        }[self.strategy]
        check()
        self._check_precision_files()
        return self

    def _check_precision_files(self) -> None:
        if self.keep_dtype is not None and self.precision_mode == "must_keep_origin_dtype":
            raise ValueError("keep_dtype has no effect under must_keep_origin_dtype (every op keeps its dtype already)")

    @property
    def strategy(self) -> ShapeStrategyKind:
        for kind in ("dynamic_batch_size", "dynamic_image_size", "dynamic_dims", "dynamic_shape"):
            if getattr(self, kind) is not None:
                return kind  # type: ignore[return-value]
        return "static"

    def _dynamic_positions(self) -> dict[str, list[int]]:
        return {name: [i for i, d in enumerate(dims) if d == -1] for name, dims in self.input_shapes.items()}

    def _check_static(self) -> None:
        dynamic = {n: p for n, p in self._dynamic_positions().items() if p}
        if dynamic:
            raise ValueError(f"input_shapes has -1 in {sorted(dynamic)} but no dynamic strategy is given")

    def _check_gear_count(self, field: str, gears: list) -> None:
        if not MIN_GEARS <= len(gears) <= MAX_GEARS:
            raise ValueError(f"{field}: {len(gears)} gear(s); ATC accepts {MIN_GEARS} to {MAX_GEARS}")

    def _check_batch(self) -> None:
        gears = self.dynamic_batch_size or []
        self._check_gear_count("dynamic_batch_size", gears)
        if any(g <= 0 for g in gears):
            raise ValueError(f"dynamic_batch_size: gears must be positive, got {gears}")
        positions = self._dynamic_positions()
        if not any(p == [0] for p in positions.values()) or any(p not in ([], [0]) for p in positions.values()):
            raise ValueError("dynamic_batch_size: input_shapes must have -1 on dim 0 (the batch) and nowhere else")

    def _check_image(self) -> None:
        gears = self.dynamic_image_size or []
        self._check_gear_count("dynamic_image_size", gears)
        if any(len(g) != 2 or min(g) <= 0 for g in gears):
            raise ValueError(f"dynamic_image_size: each gear is [height, width] > 0, got {gears}")
        positions = self._dynamic_positions()
        if not any(len(p) == 2 for p in positions.values()) or any(len(p) not in (0, 2) for p in positions.values()):
            raise ValueError("dynamic_image_size: input_shapes must have -1 on exactly the two spatial dims (H, W)")

    def _check_dims(self) -> None:
        gears = self.dynamic_dims or []
        self._check_gear_count("dynamic_dims", gears)
        wanted = sum(len(p) for p in self._dynamic_positions().values())
        if wanted == 0:
            raise ValueError("dynamic_dims: input_shapes has no -1; mark the dims that vary with -1")
        bad = [g for g in gears if len(g) != wanted or min(g) <= 0]
        if bad:
            raise ValueError(
                f"dynamic_dims: each gear needs {wanted} positive value(s), one per -1 in input_shapes; bad gears {bad}"
            )
        if self.input_format not in (None, "ND"):
            raise ValueError(f"dynamic_dims needs input_format ND, got {self.input_format}")

    def _check_ranges(self) -> None:
        ranges = self.dynamic_shape or {}
        if self.input_shapes and set(ranges) != set(self.input_shapes):
            raise ValueError(
                f"dynamic_shape: inputs {sorted(ranges)} differ from input_shapes {sorted(self.input_shapes)}"
            )
        for name, dims in ranges.items():
            if not _NAME_RE.match(name):
                raise ValueError(f"dynamic_shape: input name {name!r} cannot be passed to --input_shape")
            for dim in dims:
                if not (dim == [-1] or (len(dim) == 1 and dim[0] > 0) or (len(dim) == 2 and 0 < dim[0] <= dim[1])):
                    raise ValueError(f"dynamic_shape: input {name!r}: each dim is [n], [min, max] or [-1], got {dim}")
            declared = self.input_shapes.get(name)
            if declared is not None and len(declared) != len(dims):
                raise ValueError(
                    f"dynamic_shape: input {name!r} has rank {len(dims)}, input_shapes says {len(declared)}"
                )

    @classmethod
    def checked(cls, **fields: object) -> AtcOptions:
        """Build and validate; a problem raises InputError with one line naming the field."""
        try:
            return cls(**fields)
        except ValidationError as err:
            problems = []
            for e in err.errors():
                where = ".".join(str(p) for p in e["loc"])
                message = str(e["msg"]).removeprefix("Value error, ")
                problems.append(f"{where}: {message}" if where else message)
            raise InputError("atc options: " + "; ".join(problems)) from None

    @classmethod
    def from_strategy(
        cls, strategy: ShapeStrategy, model: str, output: str, soc_version: str, **options: object
    ) -> AtcOptions:
        """Options from the boundary analysis's shape strategy (records.contracts.ShapeStrategy)."""
        fields: dict[str, object] = {"input_shapes": strategy.input_shapes}
        if strategy.kind == "dynamic_batch_size":
            fields["dynamic_batch_size"] = [g[0] for g in strategy.gears]
        elif strategy.kind == "dynamic_image_size":
            fields["dynamic_image_size"] = strategy.gears
        elif strategy.kind == "dynamic_dims":
            fields["dynamic_dims"] = strategy.gears
        elif strategy.kind == "dynamic_shape":
            fields["dynamic_shape"] = {name: [_range_dim(d) for d in dims] for name, dims in strategy.ranges.items()}
        return cls.checked(model=model, output=output, soc_version=soc_version, **fields, **options)


def _range_dim(dim: list[int]) -> list[int]:
    return [dim[0]] if len(dim) == 2 and dim[0] == dim[1] else dim


def _join(values: list[int]) -> str:
    return ",".join(str(v) for v in values)


def _range_text(dim: list[int]) -> str:
    return "~".join(str(v) for v in dim)


def build_atc_command(options: AtcOptions, atc: str = "atc") -> list[str]:
    """The atc argv (no shell quoting needed: each option is one argument)."""
    cmd = [
        atc,
        f"--model={options.model}",
        f"--framework={ONNX_FRAMEWORK}",
        f"--output={options.output}",
        f"{SOC_FLAG}{options.soc_version}",
    ]
    if options.dynamic_shape is not None:
        shape = ";".join(
            f"{name}:{','.join(_range_text(d) for d in dims)}" for name, dims in options.dynamic_shape.items()
        )
        cmd.append(f"--input_shape={shape}")
    elif options.input_shapes:
        cmd.append("--input_shape=" + ";".join(f"{name}:{_join(dims)}" for name, dims in options.input_shapes.items()))
    if options.dynamic_batch_size is not None:
        cmd.append(f"--dynamic_batch_size={_join(options.dynamic_batch_size)}")
    if options.dynamic_image_size is not None:
        cmd.append("--dynamic_image_size=" + ";".join(_join(g) for g in options.dynamic_image_size))
    if options.dynamic_dims is not None:
        cmd.append("--dynamic_dims=" + ";".join(_join(g) for g in options.dynamic_dims))
    input_format = options.input_format or ("ND" if options.dynamic_dims is not None else None)
    if input_format:
        cmd.append(f"--input_format={input_format}")
    if options.precision_mode:
        cmd.append(f"--precision_mode={options.precision_mode}")
    if options.keep_dtype:
        cmd.append(f"--keep_dtype={options.keep_dtype}")
    cmd.append(f"--log={options.log}")
    return cmd


# -- finding atc ----------------------------------------------------------------------------


def find_atc(env: Mapping[str, str] | None = None, toolkit_homes: tuple[str, ...] | None = None) -> AtcInstall | None:
    """atc on PATH (environment already set), else a CANN toolkit at $ASCEND_TOOLKIT_HOME or
    the default install path, whose set_env.sh must be sourced before atc runs."""
    env = os.environ if env is None else env
    toolkit_homes = DEFAULT_TOOLKIT_HOMES if toolkit_homes is None else toolkit_homes
    on_path = shutil.which("atc", path=env.get("PATH", ""))
    if on_path:
        return AtcInstall(atc=on_path, toolkit_home=env.get("ASCEND_TOOLKIT_HOME"))
    homes = ([env["ASCEND_TOOLKIT_HOME"]] if env.get("ASCEND_TOOLKIT_HOME") else []) + list(toolkit_homes)
    for home in map(Path, homes):
        atc = next((p for p in (home / "bin" / "atc", home / "compiler" / "bin" / "atc") if p.is_file()), None)
        if atc is None:
            continue
        set_env = next((p for p in (home / "set_env.sh", home.parent / "set_env.sh") if p.is_file()), None)
        return AtcInstall(atc=str(atc), set_env=str(set_env) if set_env else None, toolkit_home=str(home))
    return None


# -- running it -----------------------------------------------------------------------------

# Error codes and messages seen from ATC, with what to do. Codes and texts from CANN's error
# code reference ("GE Errors", maintenref/troubleshooting/atlaserrorcode_15_*).
_ADVICE: tuple[tuple[str, re.Pattern[str], str], ...] = (
    (
        "E19010",
        re.compile(r"\bE19010\b|\bEZ9010\b|No parser is registered for Op", re.I),
        "ATC's ONNX parser has no entry for this op at the model's opset (the optype in the message reads "
        "ai.onnx::<opset>::<Op>). Export at opset <= 18 or convert down with onnx.version_converter, or "
        "replace the op; run precheck_ops to see every such op before converting.",
    ),
    (
        "E10001",
        re.compile(r"\bE10001\b"),
        "An argument value is invalid; the message names the parameter and the reason. Fix that option.",
    ),
    (
        "E10014",
        re.compile(r"\bE1000[3]\b|\bE1001[45]\b"),
        "A --parameter value is invalid; run `atc -h` and check the option named in the message "
        "(shape string syntax, gear list, soc_version).",
    ),
    (
        "E10054",
        re.compile(r"\bE10054\b"),
        "A required ATC parameter is empty, or a value was not quoted (quote --input_shape and gear lists in a shell).",
    ),
    (
        "E19999",
        re.compile(r"\bE[0-9A-Z]9999\b"),
        "Internal error of a CANN module: read the lines before it in the log and the plog "
        "($HOME/ascend/log); re-run with --log=info for detail.",
    ),
    (
        "message",
        re.compile(r"soc_version.*(invalid|not support)|not support.*soc", re.I),
        "The --soc_version is not supported by this CANN installation: use the exact name from `npu-smi info`.",
    ),
)


_CODE_RE = re.compile(r"E[0-9A-Z]\d{4}")


def advise(log_text: str) -> list[AtcErrorAdvice]:
    """Known error codes/messages in an ATC log, one entry per code, first line that shows it."""
    found: list[AtcErrorAdvice] = []
    seen: set[str] = set()
    for line in log_text.splitlines():
        for label, pattern, advice in _ADVICE:
            match = pattern.search(line)
            if label in seen or match is None:
                continue
            seen.add(label)
            code = match.group(0) if _CODE_RE.fullmatch(match.group(0)) else label
            found.append(AtcErrorAdvice(code=code, message=line.strip()[:500], advice=advice))
    return found


def conversion_script(options: AtcOptions, install: AtcInstall | None, folder: Path) -> str:
    """A bash script in `folder` that runs the same conversion on a machine with CANN. Its paths
    are relative to its own folder, which it runs from, so it moves with the run folder."""
    return atc_script(
        paths_relative_to(build_atc_command(options), folder), install.set_env if install else None, from_own_folder="."
    )


def paths_relative_to(command: list[str], folder: Path) -> list[str]:
    """`--flag=/abs/path` arguments rewritten relative to `folder` (`--model=../../onnx/a.onnx`)."""

    def relative(arg: str) -> str:
        flag, sep, value = arg.partition("=")
        if sep and value.startswith("/"):
            return f"{flag}={os.path.relpath(value, folder.resolve())}"
        return arg

    return [relative(arg) for arg in command]


def atc_script(command: list[str], set_env: str | None = None, from_own_folder: str | None = None) -> str:
    """A bash script running `command` (every argument shell-quoted), sourcing CANN's set_env.sh
    when atc is not on PATH. `from_own_folder`: a folder, relative to the script's own, to run from
    (for scripts whose paths are relative, as in a bundle)."""
    set_env = set_env or "/usr/local/Ascend/ascend-toolkit/set_env.sh"
    cd = f'cd "$(dirname "${{BASH_SOURCE[0]}}")/{from_own_folder}"\n' if from_own_folder else ""
    return (
        "#!/usr/bin/env bash\n"
        "# ATC conversion written by omskills. Run on a machine with CANN installed.\n"
        "set -euo pipefail\n"
        f'SET_ENV="${{ASCEND_SET_ENV:-{set_env}}}"\n'
        'if ! command -v atc >/dev/null 2>&1; then source "$SET_ENV"; fi\n'
        f"{cd}{shlex.join(command)}\n"
    )


def run_atc(options: AtcOptions, workdir: str | Path, timeout: float | None = None) -> AtcResult:
    """Run ATC where it is installed; otherwise write the script and return `not_run`."""
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    if not Path(options.model).is_file():
        raise InputError(f"model: ONNX file not found: {options.model}")
    name = Path(options.output).name
    install = find_atc()
    script = work / f"convert_{name}.sh"
    script.write_text(conversion_script(options, install, work))
    script.chmod(0o755)
    command = build_atc_command(options)
    if install is None:
        return AtcResult(status="not_run", reason="atc missing", command=command, script=str(script))
    return _execute(options, install, command, script, work / f"atc_{name}.log", timeout)


def _execute(
    options: AtcOptions, install: AtcInstall, command: list[str], script: Path, log: Path, timeout: float | None
) -> AtcResult:
    argv = [install.atc, *command[1:]]
    if install.set_env:
        argv = ["bash", "-c", f"source {shlex.quote(install.set_env)} && exec {shlex.join(argv)}"]
    Path(options.output).parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    base = dict(command=command, script=str(script), atc=install.atc, log=str(log))
    with log.open("w") as log_file:
        log_file.write(f"$ {shlex.join(argv)}\n")
        log_file.flush()
        try:
            proc = subprocess.run(argv, stdout=log_file, stderr=subprocess.STDOUT, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return AtcResult(
                status="failed",
                reason=f"atc timed out after {timeout} s",
                seconds=round(time.time() - started, 1),
                **base,
            )
    seconds = round(time.time() - started, 1)
    errors = advise(log.read_text(errors="replace"))
    if proc.returncode != 0:
        return AtcResult(
            status="failed",
            reason=f"atc exited {proc.returncode}",
            exit_code=proc.returncode,
            seconds=seconds,
            errors=errors,
            **base,
        )
    om = _produced_om(options.output, started)
    if om is None:
        return AtcResult(
            status="failed",
            reason=f"atc exited 0 but wrote no {options.output}.om",
            exit_code=0,
            seconds=seconds,
            errors=errors,
            **base,
        )
    return AtcResult(
        status="converted",
        exit_code=0,
        seconds=seconds,
        om_path=str(om),
        om_sha256=sha256_file(om),
        om_bytes=om.stat().st_size,
        errors=errors,
        **base,
    )


def _produced_om(output: str, since: float) -> Path | None:
    """`<output>.om`, or an .om ATC wrote with a platform suffix (`<output>_linux_x86_64.om`)."""
    exact = Path(output + ".om")
    if exact.is_file() and exact.stat().st_mtime >= since - 1:
        return exact
    prefix = Path(output)
    fresh = [p for p in prefix.parent.glob(prefix.name + "*.om") if p.stat().st_mtime >= since - 1]
    return max(fresh, key=lambda p: p.stat().st_mtime) if fresh else None
