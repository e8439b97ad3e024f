"""Doge's dynamic mask attention (a learned bias per key and head, folded into Q and K) against plain rows."""

import pytest
import torch

import sharedprefix as sp
from helpers import assert_matches_plain_rows, float64_faithful, random_groups, tiny_model
from sharedprefix.attention import dynamic_mask


def _doge(window=None, keep=2048):
    # float32 first and float64_faithful last, so that A's draw below follows the weights' (float64_faithful draws)
    model = tiny_model("doge", dtype=torch.float32, sliding_window=window, keep_window_size=keep).double()
    with torch.no_grad():  # A starts at zero (a bias of 1 on every key, which softmax ignores): make it bite
        for layer in model.model.layers:
            layer.self_attn.A.normal_(0.0, 1.0)
    return float64_faithful(model)


GROUPS = lambda: random_groups(0, 3, [9, 5, 7], [[4, 1, 6], [3, 2], [5]])  # noqa: E731


@pytest.mark.parametrize(
    "window, budget, mode", [(None, None, None), (None, 12, "keep"), (None, 12, "recompute"), (4, 12, "offload")]
)
def test_dynamic_mask_matches_plain_rows(window, budget, mode):
    assert_matches_plain_rows(_doge(window), GROUPS(), budget, mode)


def test_the_bias_matters():
    """Without its bias (zeroed before folding), the result moves far beyond the tolerance: the test above sees it."""
    model = _doge()
    ref = sp.logprobs(model, GROUPS()).logprobs.detach()
    fold = dynamic_mask.fold_key_bias
    try:
        dynamic_mask.fold_key_bias = lambda m, q, k, v, mask, scale: fold(m, q, k, v, torch.zeros_like(mask), scale)
        with torch.no_grad():
            moved = (sp.logprobs(model, GROUPS()).logprobs - ref).abs().max()
    finally:
        dynamic_mask.fold_key_bias = fold
    assert moved > 1e-3


def test_rows_longer_than_keep_window_size_are_refused():
    """Past keep_window_size keys Doge keeps the top keys of each query: refused before any pass when a plain row
    is longer (even if a budget would keep every pass shorter) or when a pass would pack more tokens."""
    model = _doge(keep=16)
    long_rows = random_groups(1, 1, [12], [[8, 8]])  # plain rows of 20 tokens
    for budget in (None, 16):
        with pytest.raises(ValueError, match=r"longest \[prompt \+ completion\] row here has 20 tokens"):
            sp.logprobs(model, long_rows, max_tokens=budget)
    with pytest.raises(ValueError, match=r"a pass here packs \d+ tokens.*max_tokens <= 16"):
        sp.logprobs(model, GROUPS())  # rows of at most 15 tokens, packed into one longer pass
    assert_matches_plain_rows(model, GROUPS(), 16, "keep")  # a budget that keeps every pass within it is exact
