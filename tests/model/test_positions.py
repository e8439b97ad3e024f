"""RoBERTa-style position numbering: exact against the plain forward of every row, padding tokens inside included.

RoBERTa's decoder numbers a row itself when given no position ids: padding index + 1 + the count of non-padding
tokens so far, and the padding index on a padding token. sharedprefix gives each token of the packed row the
number its own plain row gives it (``model.checks.decoder_position_ids``). The groups here hold the padding token (0)
in a prompt and in a completion, where the plain numbering stops counting.
"""

import pytest
import torch

import sharedprefix as sp
from helpers import assert_matches_plain_rows, plain_logprobs, tiny_model
from sharedprefix.model import checks as modeling
from sharedprefix.schedule import executor

PAD = 0


def _roberta():
    return tiny_model(
        "roberta", max_position_embeddings=64, bos_token_id=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )


@pytest.fixture(scope="module")
def model():
    return _roberta()


def _groups():
    return [
        sp.Group([5, 6, PAD, 7, 8, 9, 10, 11, 12], [[13, PAD, 14, 15, 16], [17, 18, 19], [20, 21, 22, 23, 24, 25]]),
        sp.Group([30, 31, 32, 33], [[PAD, 34, 35, 36]]),
    ]


@pytest.mark.parametrize("budget", [None, 12])
def test_roberta_numbering_matches_plain_rows(model, budget):
    assert_matches_plain_rows(model, _groups(), budget)


@pytest.mark.parametrize("mistake", ["positions 0..L-1", "padding counted"])
def test_the_check_fails_with_another_numbering(model, monkeypatch, mistake):
    groups = _groups()
    ref = plain_logprobs(model, groups)[0]
    with torch.no_grad():
        sp.logprobs(model, groups)  # verified once per model with the real numbering, before it is broken
    if mistake == "positions 0..L-1":
        monkeypatch.setattr(executor, "decoder_position_ids", lambda m, layout: layout.position_ids)
    else:
        monkeypatch.setattr(modeling, "padding_numbered", lambda ids, pad: torch.arange(ids.shape[-1]) + pad + 1)
    with torch.no_grad():
        assert (sp.logprobs(model, groups).logprobs - ref).abs().max() > 1e-3


def test_a_decoder_that_counts_padding_is_refused():
    """A decoder numbering pad + 1 + the index of each token (padding counted) is neither 0..L-1 nor RoBERTa's
    numbering: the check refuses it before any pass."""
    counting = _roberta()
    counting.roberta.embeddings.create_position_ids_from_input_ids = lambda ids, pad, cache_length=0: (
        torch.arange(ids.shape[-1], device=ids.device).expand_as(ids) + pad + 1 + cache_length
    )
    with pytest.raises(ValueError, match="numbers the positions of a row differently from 0..L-1"):
        sp.logprobs(counting, _groups())


def test_a_forward_that_changes_state_is_refused_for_that_reason():
    """spectral_norm in training mode runs a power iteration step per forward: the same row gives other hidden
    states on a second forward, which the check names (it named the positions before). In eval mode it is exact."""
    from torch.nn.utils.parametrizations import spectral_norm

    model = tiny_model()
    for layer in model.model.layers:
        spectral_norm(layer.self_attn.o_proj)
    groups = [sp.Group([1, 2, 3, 4, 5, 6], [[7, 8], [9]]), sp.Group([4, 5], [[6, 7, 8]])]
    model.eval()
    assert_matches_plain_rows(model, groups, budget=7)
    model.train()
    with pytest.raises(ValueError, match="gives other hidden states for the same row on a second forward"):
        sp.logprobs(model, groups)
