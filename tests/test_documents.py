"""The run's documents render: DELIVERY.md is valid Markdown with runnable, quoted commands and
links that resolve; report.html loads every picture and shows every candidate in a real browser
(Debian's chromium, headless, driven over the DevTools protocol)."""

from __future__ import annotations

import json
import os
import select
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlsplit

import numpy as np
import pytest
from markdown_it import MarkdownIt
from markdown_it.token import Token
from omskills.records.task import load_record
from omskills.report.render import inline_code, shell_line
from omskills.run_folder import RunFolder


def shell_words(line: str) -> list[str]:
    """The words bash reads in one command line: like shlex.split, but `;`, `|`, `&`... outside
    quotes are words of their own (shlex.split keeps `a;b` whole, bash ends the command there)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


# -- pieces that need no run ------------------------------------------------------------------


def test_the_driver_guides_examples_are_valid_code_records_and_checks():
    """docs/drivers.md's Python blocks parse, its YAML blocks load, and the comparison checks it
    shows are `OutputCheck`s the engine accepts."""
    import ast

    import yaml
    from omskills.records.verify import OutputCheck

    text = (Path(__file__).resolve().parents[1] / "docs" / "drivers.md").read_text()
    fences = [t for t in MarkdownIt("commonmark").parse(text) if t.type == "fence"]
    assert {t.info for t in fences} >= {"python", "yaml"}
    for fence in fences:
        if fence.info == "python":
            ast.parse(fence.content)
        elif fence.info == "yaml":
            assert isinstance(yaml.safe_load(fence.content), dict)
    shown = [f.content for f in fences if f.info == "python" and f.content.startswith("COMPARISON")]
    assert shown
    for block in shown:
        namespace: dict = {}
        exec(block, namespace)
        assert all(OutputCheck.model_validate(check) for check in namespace["COMPARISON"])


def test_an_atc_command_line_keeps_the_semicolons_of_its_input_shape_in_one_argument():
    argv = [
        "atc",
        "--model=onnx/my graph.onnx",
        "--framework=5",
        "--input_shape=pix_feat:-1,256,8,8;masks:-1,1,32,32",
        "--dynamic_dims=1;2;3",
        "--output=om/x/x",
    ]
    line = shell_line(argv)
    assert shell_words(line) == argv
    assert shell_words(" ".join(argv)) != argv, "unquoted, the shell would split the shapes at `;`"
    # bash itself reads the same arguments (unquoted, `;` would end the command there)
    echoed = subprocess.run(
        ["bash", "-c", f"printf '%s\\n' {shell_line(argv[1:])}"], capture_output=True, text=True, check=True
    )
    assert echoed.stdout.splitlines() == argv[1:]


def test_inline_code_holds_backticks_and_stays_one_code_span():
    for text in ["plain", "a`b", "``x``", "`starts"]:
        [paragraph] = [t for t in MarkdownIt("commonmark").parse(inline_code(text)) if t.type == "inline"]
        [code] = paragraph.children
        assert code.type == "code_inline" and code.content == text


def test_a_fence_glued_to_a_command_is_what_the_fence_check_catches():
    glued = "## Commands\n\n```bash\natc --model=a.onnx```\n\n## Known limits\n"
    assert fence_problems(glued), "an unclosed fence must be reported"
    assert fence_problems("```bash\natc --model=a.onnx\n```\n\n## Known limits\n") == []


def test_frame_axes_tick_whole_numbers_only():
    from matplotlib.figure import Figure
    from omskills.report.charts import integer_ticks

    for steps in ([0, 1], list(range(40))):
        axes = Figure().add_subplot()
        axes.plot(steps, np.ones(len(steps)))
        integer_ticks(axes, steps)
        ticks = [t for t in axes.get_xticks() if steps[0] <= t <= steps[-1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_overlays_carry_a_legend_with_each_objects_colour():
    from omskills.report.pictures import PALETTE, draw_instances
    from PIL import Image

    image = Image.new("RGB", (120, 80), (128, 128, 128))
    regions = np.zeros((2, 80, 120), dtype=bool)
    regions[0, 5:20, 5:30] = regions[1, 40:70, 60:110] = True
    drawn = draw_instances(image, [3, 8], regions, [[0.05, 0.06, 0.2, 0.2], [0.5, 0.5, 0.4, 0.35]], "run A")
    assert drawn.width == image.width and drawn.height > image.height
    strip = np.asarray(drawn)[image.height :].reshape(-1, 3)
    for obj_id in (3, 8):
        assert (strip == PALETTE[obj_id % len(PALETTE)]).all(axis=1).any(), f"no swatch for id {obj_id}"


# -- DELIVERY.md of the tiny adaptation -----------------------------------------------------------


def markdown() -> MarkdownIt:
    return MarkdownIt("commonmark").enable("table")


def fence_problems(text: str) -> list[str]:
    """Fences that never close (they swallow the rest of the document) or hold a fence marker."""
    lines = text.splitlines()
    problems = []
    for token in markdown().parse(text):
        if token.type != "fence":
            continue
        start, end = token.map
        closing = lines[end - 1].strip() if end - 1 > start and end <= len(lines) else ""
        if not (closing.startswith(token.markup) and set(closing) == {token.markup[0]}):
            problems.append(f"fence at line {start + 1} is not closed")
        if "```" in token.content:
            problems.append(f"fence at line {start + 1} holds a fence marker")
    return problems


def links(tokens: list[Token], kind: str = "link_open") -> list[str]:
    """Targets of the links (`link_open`) or pictures (`image`) in the document."""
    attribute = "src" if kind == "image" else "href"
    return [str(child.attrs[attribute]) for token in tokens for child in token.children or [] if child.type == kind]


def headings(tokens: list[Token]) -> list[str]:
    return [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "heading_open"]


def test_delivery_is_markdown_whose_fences_close_and_whose_headings_survive(tiny_adaptation):
    text = (tiny_adaptation / "DELIVERY.md").read_text()
    assert fence_problems(text) == []
    tokens = markdown().parse(text)
    # A fence left open turns every later heading into code: they must all be headings.
    assert {"Boundary", "Stages", "Commands", "Main path and fallbacks", "Pictures", "Known limits"} <= set(
        headings(tokens)
    )
    tables = sum(t.type == "table_open" for t in tokens)
    assert tables >= 5, f"{tables} tables"


def first_column_under(tokens: list[Token], heading: str) -> list[str]:
    """The first cell of each body row of the first table after the heading."""
    start = next(
        i
        for i, t in enumerate(tokens)
        if t.type == "inline" and t.content == heading and tokens[i - 1].type == "heading_open"
    )
    body = next(i for i in range(start, len(tokens)) if tokens[i].type == "tbody_open")
    cells, i = [], body
    while tokens[i].type != "tbody_close":
        if tokens[i].type == "tr_open":
            cells.append(tokens[i + 2].content)  # tr_open, td_open, inline
        i += 1
    return cells


def test_delivery_lists_every_candidate_through_the_stages_with_why_it_was_left_out(tiny_adaptation):
    record = load_record(tiny_adaptation / "task.yaml")
    text = (tiny_adaptation / "DELIVERY.md").read_text()
    candidates = first_column_under(markdown().parse(text), "Stages")
    graphs = sum((len(record.contracts_of(c.name)) or 1 for c in record.plan.candidates), 0)
    assert set(candidates) == {c.name for c in record.plan.candidates} and len(candidates) == graphs
    for cand in record.plan.candidates:
        if cand.name not in record.plan.first_batch:
            assert f"every stage not_run: {cand.status}: {cand.reason}" in text


def test_every_command_block_is_runnable_shell_and_each_atc_command_is_the_recorded_one(tiny_adaptation):
    record = load_record(tiny_adaptation / "task.yaml")
    blocks = [t for t in markdown().parse((tiny_adaptation / "DELIVERY.md").read_text()) if t.type == "fence"]
    commands = [shell_words(line) for block in blocks for line in block.content.splitlines() if line.strip()]
    assert all(argv[0] in ("omskills", "atc") for argv in commands), [argv[0] for argv in commands]
    atc = [argv for argv in commands if argv[0] == "atc"]
    recorded = {
        name: RunFolder(tiny_adaptation).command(chain.atc.command)
        for name, chain in record.toolchain.items()
        if chain.atc
    }
    assert len(recorded) == len(record.graphs()) and sorted(map(tuple, atc)) == sorted(map(tuple, recorded.values()))
    # One command per ATC block, the `;`-separated shapes kept whole in their argument.
    assert sum(1 for block in blocks if block.content.lstrip().startswith("atc")) == len(recorded)
    shapes = [arg for argv in atc for arg in argv if arg.startswith(("--input_shape=", "--dynamic_dims="))]
    assert any(";" in arg for arg in shapes), shapes
    # The paths are relative to the run folder and name files that are there.
    models = [arg.split("=", 1)[1] for argv in atc for arg in argv if arg.startswith("--model=")]
    assert models and all(not Path(m).is_absolute() and (tiny_adaptation / m).is_file() for m in models)


def test_delivery_links_resolve_in_the_run_folder_and_no_path_is_absolute(tiny_adaptation):
    text = (tiny_adaptation / "DELIVERY.md").read_text()
    tokens = markdown().parse(text)
    found = links(tokens) + links(tokens, "image")
    local = [unquote(urlsplit(link).path) for link in found if not urlsplit(link).scheme]
    missing = [link for link in local if not (tiny_adaptation / link).is_file()]
    assert not missing, missing
    assert "verify/report.html" in local
    # The pictures shown are the verification report's: charts and both runs side by side.
    record = load_record(tiny_adaptation / "task.yaml")
    assert links(tokens, "image") == record.verification.figures and len(record.verification.figures) >= 3
    assert str(tiny_adaptation.resolve()) not in text and str(tiny_adaptation) not in text


# -- report.html in a real browser ----------------------------------------------------------------


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip(
            "Debian's chromium is not installed and could not be installed here "
            "(`make test` installs it with apt-get, which needs root)"
        )
    return found


class DevTools:
    """Headless chromium driven over the DevTools protocol on a pipe (fds 3 and 4 in the child,
    messages separated by NUL): no port, no extra package."""

    def __init__(self, executable: str, timeout: float = 90.0):
        self.timeout = timeout
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        self._profile = tempfile.TemporaryDirectory()

        def pipes_at_3_and_4() -> None:
            os.dup2(to_child_r, 3)
            os.dup2(from_child_w, 4)

        self.process = subprocess.Popen(
            [
                executable,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--remote-debugging-pipe",
                f"--user-data-dir={self._profile.name}",
                "about:blank",
            ],
            pass_fds=(3, 4),
            preexec_fn=pipes_at_3_and_4,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self._buffer = b""
        self._next_id = 0

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> int:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_child, json.dumps(message).encode() + b"\0")
        return self._next_id

    def receive(self) -> dict:
        while b"\0" not in self._buffer:
            ready, _, _ = select.select([self._from_child], [], [], self.timeout)
            chunk = os.read(self._from_child, 1 << 20) if ready else b""
            if not chunk:
                raise AssertionError("chromium stopped answering on the DevTools pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        wanted = self.send(method, params, session)
        while (message := self.receive()).get("id") != wanted:
            pass
        assert "error" not in message, message
        return message["result"]

    def evaluate_after_load(self, url: str, expression: str) -> object:
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.call("Page.enable", session=session)
        self.call("Page.navigate", {"url": url}, session=session)
        while not (lambda m: m.get("method") == "Page.loadEventFired" and m.get("sessionId") == session)(
            self.receive()
        ):
            pass
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=session)
        return result["result"]["value"]

    def close(self) -> None:
        try:
            self.send("Browser.close")
            self.process.wait(timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
        os.close(self._to_child)
        os.close(self._from_child)
        self._profile.cleanup()


PAGE_FACTS = """(() => {
  const rows = (selector) => [...document.querySelectorAll(selector)];
  return {
    images: [...document.images].map(i => ({
      alt: i.alt, loaded: i.complete && i.naturalWidth > 0, width: i.naturalWidth})),
    sections: rows('h2[id]').map(h => h.id),
    stages: rows('table.stages tr[data-candidate]').map(r => ({
      candidate: r.dataset.candidate,
      columns: [...r.cells].reduce((n, c) => n + c.colSpan, 0),
      text: r.innerText})),
    stageHeader: rows('table.stages th').map(th => th.innerText),
    itemHeader: rows('table.items th').map(th => th.innerText),
    itemRows: rows('table.items tr').length - 1,
    text: document.body.innerText,
  };
})()"""


@pytest.fixture(scope="module")
def report_page(tiny_adaptation) -> dict:
    browser = DevTools(chromium())
    try:
        return browser.evaluate_after_load((tiny_adaptation / "verify" / "report.html").resolve().as_uri(), PAGE_FACTS)
    finally:
        browser.close()


def test_report_images_all_load_in_chromium(report_page):
    images = report_page["images"]
    assert len(images) >= 3, images  # compute share, checks per frame, at least one side-by-side picture
    assert all(i["loaded"] for i in images), [i["alt"] for i in images if not i["loaded"]]
    assert any("compute share" in i["alt"] for i in images)


def test_report_shows_every_candidate_through_every_stage(report_page, tiny_adaptation):
    from omskills.report.stage_status import STAGES

    record = load_record(tiny_adaptation / "task.yaml")
    assert {"compute-share", "stage-status", "per-item", "pictures"} <= set(report_page["sections"])
    assert report_page["stageHeader"][4:] == list(STAGES)
    rows = report_page["stages"]
    assert {r["candidate"] for r in rows} == {c.name for c in record.plan.candidates}
    assert all(r["columns"] == 4 + len(STAGES) for r in rows)
    # Deferred and excluded candidates are there with the plan's reason for not running.
    left_out = [c for c in record.plan.candidates if c.name not in record.plan.first_batch]
    assert left_out, "the tiny plan defers at least one candidate"
    for cand in left_out:
        [row] = [r for r in rows if r["candidate"] == cand.name]
        assert "not_run" in row["text"] and cand.reason in row["text"]
    # ATC cannot run here: each deployed graph says so, with the reason.
    deployed = [r for r in rows if r["candidate"] in record.plan.first_batch]
    assert deployed and all(
        "not_run\natc missing" in r["text"] or "not_run atc missing" in r["text"] for r in deployed
    ), [r["text"] for r in deployed]


def test_report_per_object_figures_are_a_table_not_a_python_dict(report_page, tiny_adaptation):
    record = load_record(tiny_adaptation / "task.yaml")
    iou = [f for f in record.verification.item_figures if f.metric == "iou"]
    assert iou and report_page["itemRows"] == len({(f.step, f.item) for f in iou})
    assert "mask IoU per object" in report_page["itemHeader"] and "obj_ids" in report_page["itemHeader"]
    assert "{'" not in report_page["text"] and '{"' not in report_page["text"]
