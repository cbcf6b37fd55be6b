"""A graph whose inputs derive from user inputs and the model's constants alone answers a call with
inputs it has seen from memory: the backend runs once per distinct input, the caller gets the same
values and may write into them. A graph fed from session state, a random op or an untraced tensor
always runs, and the rule says why."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omskills.contracts import ProvenanceTracker, capture_contracts
from omskills.records.contracts import Provenance
from omskills.splicing.memo import MAX_INPUT_BYTES, why_not_memoisable
from omskills.splicing.splice import splice
from test_splice import TorchBackendDouble
from test_splice_traffic import Pipeline
from torch import nn


def _contracts(host, x, encoder_inputs):
    with torch.no_grad():
        enc, dec = capture_contracts(host, {"enc": "enc", "dec": "dec"}, lambda: host(x))
    tagged = [s.model_copy(update={"provenance": Provenance(kind=encoder_inputs)}) for s in enc.inputs]
    return enc.model_copy(update={"inputs": tagged}), dec


def test_a_graph_fed_from_user_inputs_runs_once_per_distinct_input():
    host, x = Pipeline(), torch.randn(2, 3)
    enc, dec = _contracts(host, x, "input")
    double = TorchBackendDouble(host.enc, enc)
    with splice(host, [(enc, double)]) as handle, torch.no_grad():
        first = host.enc(x)
        first.add_(100)  # the caller writes into what it got: the memory must not change
        again = host.enc(x.clone())
        other = host.enc(x + 1)
    torch.testing.assert_close(again, x * 2 + 1)
    torch.testing.assert_close(other, (x + 1) * 2 + 1)
    [stats] = handle.stats()
    assert (stats.calls, stats.backend_calls, stats.memo_hits) == (3, 2, 1) and len(double.feeds) == 2
    assert [g.calls for s in handle.traffic.steps() for g in s.graphs] == [2]  # a call from memory moves nothing


def test_a_graph_fed_from_another_modules_output_always_runs():
    host, x = Pipeline(), torch.randn(2, 3)
    enc, dec = _contracts(host, x, "module_output")
    double = TorchBackendDouble(host.enc, enc)
    with splice(host, [(enc, double)]) as handle, torch.no_grad():
        host.enc(x)
        host.enc(x)
    [stats] = handle.stats()
    assert (stats.backend_calls, stats.memo_hits) == (2, 0)


def test_outputs_computed_ahead_survive_a_save_and_stay_however_many_calls_follow(tmp_path):
    from omskills.splicing.memo import ENTRIES, OutputMemo, load_entries, save_entries

    computed = OutputMemo()
    feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
    key = computed.key(feeds)
    computed.put(key, {"y": feeds["x"] * 2, "n": np.array(3)})
    saved = save_entries(tmp_path / "memo" / "enc.npz", computed.entries())
    deployed = OutputMemo()
    deployed.preload(load_entries(saved))
    for k in range(ENTRIES + 2):  # more distinct calls than the memory keeps
        other = {"x": np.full((2, 3), k, np.float32)}
        deployed.put(deployed.key(other), {"y": other["x"]})
    got = deployed.get(key)
    np.testing.assert_array_equal(got["y"], feeds["x"] * 2)
    assert got["n"] == 3 and deployed.hits == 1


# --------------------------------------------------------------------------- the rule, on real provenance

CONTEXT, WIDTH, VOCAB = 6, 8, 50


class Tower(nn.Module):
    """A text tower's shape: embeddings in, masked self-attention, embeddings out."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(x @ x.transpose(-1, -2) + attn_mask, dim=-1)
        return weights @ self.proj(x)


class TextModel(nn.Module):
    """CLIP's encode_text up to its transformer: the tower's input is the token embedding plus a
    positional parameter, its mask a buffer. `extra` is added to the tower's input when given."""

    def __init__(self) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(VOCAB, WIDTH)
        self.positional_embedding = nn.Parameter(torch.randn(CONTEXT, WIDTH))
        self.register_buffer("attn_mask", torch.full((CONTEXT, CONTEXT), float("-inf")).triu(1), persistent=False)
        self.transformer = Tower()

    def forward(self, text: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        x = self.token_embedding(text) + self.positional_embedding
        if extra is not None:
            x = x + extra
        return self.transformer(x, attn_mask=self.attn_mask)


def tokenize(prompts: list[str]) -> torch.Tensor:
    """Token ids made in Python, as a tokenizer makes them (`torch.tensor` of a list)."""
    return torch.tensor([[ord(c) % VOCAB for c in p[:CONTEXT].ljust(CONTEXT)] for p in prompts])


PROMPTS = ["a cat", "a dog"]


def _tower_contract(model: TextModel, extra=lambda tracker: None, before=lambda model: None):
    tracker = ProvenanceTracker()

    def run() -> None:
        with torch.no_grad():
            before(model)
            model(tokenize(PROMPTS), extra(tracker))

    [contract] = capture_contracts(model, {"text_tower": "transformer"}, run, tracker)
    return contract


def test_a_text_tower_fed_by_token_and_positional_embeddings_and_a_mask_buffer_is_remembered():
    torch.manual_seed(0)
    model = TextModel().eval()
    contract = _tower_contract(model)
    x, mask = contract.inputs
    assert (x.provenance.kind, x.provenance.source) == ("module_output", "token_embedding")  # not "input"
    assert x.provenance.roots == {"constant": "torch.tensor", "parameter": "token_embedding.weight"}
    assert mask.provenance.roots == {"parameter": "attn_mask"}
    assert why_not_memoisable(contract) is None

    double = TorchBackendDouble(model.transformer, contract)
    with splice(model, [(contract, double)]) as handle, torch.no_grad():
        first = model(tokenize(PROMPTS))
        again = model(tokenize(PROMPTS))  # the same prompts: answered from memory
        other = model(tokenize(["a bird", "a fish"]))
    torch.testing.assert_close(again, first)
    assert not torch.equal(other, first)
    [stats] = handle.stats()
    assert (stats.calls, stats.backend_calls, stats.memo_hits) == (3, 2, 1) and len(double.feeds) == 2


def _session_state(tracker: ProvenanceTracker) -> torch.Tensor:
    return tracker.tag(torch.zeros(CONTEXT, WIDTH), "session", "session.memory_bank")


def _write_the_mask_buffer(model: TextModel) -> None:
    model.attn_mask.clamp_(min=-1e9)  # a buffer the run writes into is state, not a constant


@pytest.mark.parametrize(
    ("extra", "before", "why"),
    [
        (_session_state, lambda m: None, "input 'x' comes from session state (session.memory_bank)"),
        (lambda t: torch.randn(CONTEXT, WIDTH), lambda m: None, "input 'x' derives from a random op (torch.randn)"),
        (
            lambda t: torch.from_numpy(np.ones((CONTEXT, WIDTH), np.float32)),  # no torch function sees it made
            lambda m: None,
            "input 'x' derives from a tensor the study could not trace",
        ),
        (
            lambda t: nn.functional.dropout(torch.ones(CONTEXT, WIDTH), 0.1, training=True),
            lambda m: None,
            "input 'x' derives from a random op (torch.dropout)",
        ),
        (
            lambda t: None,
            _write_the_mask_buffer,
            "input 'attn_mask' comes from session state (attn_mask, written by clamp_ during the run)",
        ),
    ],
    ids=["session-state", "random-op", "untraced", "dropout-while-training", "buffer-written-during-the-run"],
)
def test_a_graph_whose_input_depends_on_anything_but_inputs_and_constants_always_runs(extra, before, why):
    torch.manual_seed(0)
    model = TextModel().eval()
    contract = _tower_contract(model, extra, before)
    assert why_not_memoisable(contract).startswith(why)
    with splice(model, [(contract, TorchBackendDouble(model.transformer, contract))]) as handle, torch.no_grad():
        model(tokenize(PROMPTS), None)
        model(tokenize(PROMPTS), None)
    [stats] = handle.stats()
    assert (stats.backend_calls, stats.memo_hits) == (2, 0)


def test_dropout_in_eval_mode_draws_nothing_and_keeps_a_graph_remembered():
    torch.manual_seed(0)
    contract = _tower_contract(
        TextModel().eval(), lambda t: nn.functional.dropout(torch.ones(CONTEXT, WIDTH), 0.1, training=False)
    )
    assert why_not_memoisable(contract) is None


def test_a_graph_whose_inputs_are_too_big_to_digest_on_every_call_always_runs():
    torch.manual_seed(0)
    model = TextModel().eval()
    contract = _tower_contract(model)
    big = [s.model_copy(update={"shape": [MAX_INPUT_BYTES, WIDTH]}) if s.name == "x" else s for s in contract.inputs]
    why = why_not_memoisable(contract.model_copy(update={"inputs": big}))
    assert why.startswith(f"its inputs are {4 * MAX_INPUT_BYTES * WIDTH + 4 * CONTEXT * CONTEXT:,} bytes a call")


def test_a_contract_recorded_before_roots_were_traced_is_remembered_only_for_inputs_as_given():
    host, x = Pipeline(), torch.randn(2, 3)
    as_given, derived = (
        _contracts(host, x, "input")[0],
        _contracts(host, x, "module_output")[0],
    )
    assert why_not_memoisable(as_given) is None
    assert "no recorded roots" in why_not_memoisable(derived) and "study again" in why_not_memoisable(derived)
