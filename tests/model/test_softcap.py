"""Gemma 2's attention-score soft-capping on the CPU: exact against the plain forward of every row.

Gemma 2's plain forward runs its eager attention (SDPA has no soft-capping), whose softmax is float32 even in a
float64 model; the test swaps in the same eager attention with a float64 softmax (both runs use it), so that the
plain float64 forward is float64 throughout and 1e-9 can fail. The cap (0.002) bites on tiny random weights, whose
scores are ~1e-3; sliding-window layers and final-logit soft-capping are on as in Gemma 2.
"""

import pytest
import torch
from transformers.models.gemma2 import modeling_gemma2

import sharedprefix as sp
from helpers import assert_matches_plain_rows, plain_logprobs, random_groups, tiny_model
from sharedprefix.attention import interface
from support.softcap import eager64

CAP = 0.002


@pytest.fixture
def model(monkeypatch):
    monkeypatch.setattr(modeling_gemma2, "eager_attention_forward", eager64)
    return tiny_model(
        "gemma2",
        attn="eager",
        max_position_embeddings=128,
        bos_token_id=2,
        eos_token_id=1,
        sliding_window=4,
        attn_logit_softcapping=CAP,
        final_logit_softcapping=30.0,
    )


def _groups():
    return random_groups(0, 2, (9, 6), ((5, 3, 6, 1), (2, 7)))


@pytest.mark.parametrize("budget, mode", [(None, "keep"), (12, "keep"), (12, "recompute"), (7, "offload")])
def test_softcapped_attention_matches_plain_rows(model, budget, mode):
    assert_matches_plain_rows(model, _groups(), budget, mode)


def test_the_check_fails_when_the_cap_is_ignored(model, monkeypatch):
    groups = _groups()
    ref = plain_logprobs(model, groups)[0]
    orig = interface.cascade_attention
    monkeypatch.setattr(interface, "cascade_attention", lambda *a: orig(*a[:8], None))
    with torch.no_grad():
        assert (sp.logprobs(model, groups).logprobs - ref).abs().max() > 1e-5
