"""Decoders that number their tokens themselves (the BART family): their position module is renumbered, exactly.

BART-family decoders take no ``position_ids``: they number their input 0..L-1 and hand the numbers to a
position-embedding module (``positions``). sharedprefix renumbers that module's call during its passes, so each
completion continues its prompt: learned positions with BART's offset of 2 (BART, mBART), learned without it
(Blenderbot), sinusoidal tables returned as (L, d) (Marian, Pegasus). Exact against plain rows in float64, in one
pass and under budgets that split a group, in every prefix_activations mode; and the checks fail when the
renumbering is dropped or off by one.
"""

import pytest
import torch
import transformers as tf

import sharedprefix as sp
from helpers import assert_matches_plain_rows, plain_logprobs, tiny_model
from sharedprefix.model import positions

# the zoo's tiny encoder-decoder families as causal LMs: their positions are renumbered (learned or sinusoidal)
MODELS = {
    "bart": "learned, offset 2, (1, L, d)",
    "mbart": "learned, offset 2",
    "blenderbot": "learned, no offset, (L, d)",
    "marian": "sinusoidal, (L, d)",
    "pegasus": "sinusoidal",
}


def _model(name, seed=0):
    """The zoo's tiny ``name`` with 64 positions, no dropout and one encoder layer (unused by the causal LM)."""
    return tiny_model(name, seed=seed, max_position_embeddings=64, dropout=0.0, encoder_layers=1)


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return _model(request.param)


def _groups():
    # positions reach 9 + 6 = 15 in the first group; the second group's prompt is one token
    return [
        sp.Group([5, 6, 7, 8, 9, 10, 11, 12, 13], [[14, 15, 16, 17, 18], [19, 20, 21], [22, 23, 24, 25, 26, 27]]),
        sp.Group([30], [[31, 32, 33, 34]]),
    ]


@pytest.mark.parametrize("budget", [None, 12])
def test_renumbered_decoder_matches_plain_rows(model, budget):
    assert_matches_plain_rows(model, _groups(), budget)


@pytest.mark.parametrize("mode", ["keep", "offload", "recompute"])
def test_every_prefix_mode_is_exact(mode):
    assert_matches_plain_rows(_model("bart", seed=1), _groups(), 12, mode)


def test_no_hook_or_attribute_stays_on_the_model(model):
    mods = positions.candidates(model.get_decoder())
    before = [(dict(m._forward_pre_hooks), dict(m._forward_hooks), dict(vars(m))) for m in mods]
    with torch.no_grad():
        sp.logprobs(model, _groups(), max_tokens=12)
    assert before == [(dict(m._forward_pre_hooks), dict(m._forward_hooks), dict(vars(m))) for m in mods]


def test_the_check_fails_without_renumbering(model, monkeypatch):
    """Positions 0..L-1 along the packed row (the decoder's own numbering) give different log-probs."""
    groups = _groups()
    ref = plain_logprobs(model, groups)[0]
    with torch.no_grad():
        sp.logprobs(model, groups)  # verified with the real renumbering before it is broken
    real = positions._hooked
    monkeypatch.setattr(positions, "_hooked", lambda modules, position_ids: real(modules, None))
    with torch.no_grad():
        assert (sp.logprobs(model, groups).logprobs - ref).abs().max() > 1e-3


def test_a_renumbering_off_by_one_is_refused(monkeypatch):
    """The verification holds the renumbered module to the model's own numbering: off by one, it refuses."""
    real = positions._with_positions
    monkeypatch.setattr(positions, "_with_positions", lambda m, a, k, p: real(m, a, k, p + 1))
    with pytest.raises(
        ValueError, match=r"BartLearnedPositionalEmbedding\) the row.s own positions 0\.\.2 changes its output"
    ):
        sp.logprobs(_model("bart"), _groups())


def test_a_position_module_that_ignores_position_ids_is_refused(monkeypatch):
    own = tf.models.bart.modeling_bart.BartLearnedPositionalEmbedding.forward
    monkeypatch.setattr(
        tf.models.bart.modeling_bart.BartLearnedPositionalEmbedding,
        "forward",
        lambda self, input_ids, cache_length=0, position_ids=None: own(self, input_ids, cache_length),
    )
    with pytest.raises(ValueError, match="takes no position_ids: it numbers .* does not return what it returns"):
        sp.logprobs(_model("bart"), _groups())


def test_a_decoder_without_a_position_module_is_refused(monkeypatch):
    model = _model("bart")
    monkeypatch.setattr(positions, "candidates", lambda dec: [])
    with pytest.raises(ValueError, match="none of its modules takes position_ids"):
        sp.logprobs(model, _groups())
