"""``attention.merge.merge_state``: its doctest runs here (pytest collects ``tests/`` only), and the merge of the
parts of a split key set equals the attention over all keys, in float64 and with parts that see no key."""

import doctest

import torch

from sharedprefix.attention import merge
from sharedprefix.attention.merge import merge_state


def test_merge_state_doctest():
    res = doctest.testmod(merge, raise_on_error=False)
    assert res.attempted >= 5 and res.failed == 0, res


def _attend(q, k, v, visible):
    """(out (Tq, H, Dv), lse (Tq, H)) of q over the keys where ``visible`` (Tq, Tk), float64; 0 / -inf with no key."""
    s = torch.einsum("ihd,jhd->ihj", q, k).masked_fill(~visible[:, None, :], float("-inf"))
    lse = s.logsumexp(-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("ihj,jhd->ihd", p, v), lse


def test_merge_state_of_three_parts_equals_one_attention_with_rows_seeing_nothing():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 3, 5, generator=g, dtype=torch.float64) for n in (6, 9, 9))
    visible = torch.rand(6, 9, generator=g) < 0.5
    visible[0] = False  # a query that sees no key at all
    visible[1, :3] = False  # one that sees none in the first part
    cuts = [(0, 3), (3, 7), (7, 9)]
    parts = [_attend(q, k[a:b], v[a:b], visible[:, a:b]) for a, b in cuts]
    out, lse = parts[0]
    for o, m in parts[1:]:
        out, lse = merge_state(out, lse, o, m)
    want, want_lse = _attend(q, k, v, visible)
    assert torch.isneginf(lse[0]).all() and (out[0] == 0).all()
    torch.testing.assert_close(out, want, rtol=0, atol=1e-13)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-13)
