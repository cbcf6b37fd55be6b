"""What the reports say, read as a user reads them: a check that reached only the review tier says
review (never pass), a count says what it counts (the study's calls, the verification's), a count
that means "not applicable" is not printed, and a step's name agrees with its number.

One real `omskills adapt` of a two-function driver of a small net whose steps are "batches" and
whose one check can at best reach the review tier; the rendered DELIVERY.md, report.html, inventory
report and the adapt summary are read back.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest
from conftest import omskills

BATCHES_DRIVER = """\
import torch

STEP_NAME = "batch"
SEED_CANDIDATES = [("head", "head")]
# A max abs below 0 is never reached: the scores can at best reach the review tier.
COMPARISON = [
    {
        "output": "scores",
        "metric": "tensor",
        "label": "scores",
        "gates": {"pass_min_cosine": 0.9999, "pass_max_abs": 0.0, "review_min_cosine": 0.99, "review_max_abs": 1.0},
    }
]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.body(x))


def build_model(spec):
    return Net()


def run_main_path(model, inputs):
    for batch in range(2):  # two batches, the head called twice in each
        x = torch.ones(3, 4) * (batch + 1)
        yield {"scores": model(x) + model.head(model.body(x))}
"""


@pytest.fixture(scope="module")
def adapted(tmp_path_factory) -> tuple[Path, str]:
    """The run folder of the adaptation, and what `omskills adapt` printed on stderr."""
    folder = tmp_path_factory.mktemp("batches")
    (folder / "batches_driver.py").write_text(BATCHES_DRIVER)
    (folder / "task.yaml").write_text("id: batches\nintake:\n  model:\n    driver: batches_driver.py\n  inputs: {}\n")
    result = omskills("adapt", str(folder / "task.yaml"), "--out", str(folder / "run"))
    assert result.returncode == 0, result.stderr[-3000:]
    return folder / "run", result.stderr


def _html_text(path: Path) -> str:
    """report.html as a reader sees it: tags and embedded pictures left out."""
    page = re.sub(r"data:[^\"']*", "", path.read_text())
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page)))


def test_a_check_in_the_review_tier_reads_as_review_never_as_a_plain_pass(adapted):
    run, stderr = adapted
    delivery = (run / "DELIVERY.md").read_text()
    assert "**Verdict: pass, review tier: scores** over 2 batches — scores: worst " in delivery
    assert re.search(r"scores: worst [0-9.e+-]+ \(review tier\); fallbacks 0", delivery)
    assert "**Verdict: pass** " not in delivery
    report = _html_text(run / "verify" / "report.html")
    assert "Verdict: pass, review tier: scores" in report
    assert re.search(r"scores tensor parity gates [0-9.e+-]+ review tier True", report)  # held: review, not True
    assert re.search(r"main path: pass, review tier: scores \| .* scores worst [0-9.e+-]+ \(review tier\)", stderr)


def test_calls_say_which_run_they_count(adapted):
    run, _ = adapted
    delivery = (run / "DELIVERY.md").read_text()
    # The plan counts the study's calls, the verification its own: each says whose they are.
    study = r"\*\*head\*\*: [0-9.]+% of main-path time, 4 calls in the study run of 2 steps \(2\.00 per step\)"
    assert re.search(study, delivery)
    assert "| calls over the 2 batches | from memory |" in delivery
    report = _html_text(run / "verify" / "report.html")
    assert "integrated on onnxruntime:CPUExecutionProvider, 4 calls over the 2 batches verified, 0 fallbacks" in report


def test_a_count_that_does_not_apply_is_not_printed_and_nouns_agree_with_their_numbers(adapted):
    run, stderr = adapted
    inventory = (run / "plan" / "inventory_report.md").read_text()
    assert re.search(r"Total [0-9.]+ s over 2 main-path steps; ", inventory)  # the driver marks no prompts
    assert "prompts" not in inventory
    texts = [inventory, (run / "DELIVERY.md").read_text(), _html_text(run / "verify" / "report.html"), stderr]
    assert not any(re.search(r"\bbatchs\b|\b1 calls\b", text) for text in texts)
    assert "2 batches" in stderr


@pytest.mark.parametrize(
    ("noun", "one", "two"),
    [
        ("frame", "1 frame", "2 frames"),
        ("batch", "1 batch", "2 batches"),
        ("query", "1 query", "2 queries"),
        ("day", "1 day", "2 days"),
        ("main-path step", "1 main-path step", "2 main-path steps"),
    ],
)
def test_a_noun_agrees_with_its_count(noun, one, two):
    from omskills.report.wording import counted

    assert (counted(1, noun), counted(2, noun), counted(0, noun)) == (one, two, two.replace("2", "0", 1))
