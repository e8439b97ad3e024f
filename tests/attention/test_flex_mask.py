"""The FlexAttention path's visibility (``attention.kernels.flex.visibility``, the block mask of soft-capped layers on
CUDA) equals the tree's definition (``helpers.tree_mask``) for every query and key, on the CPU: trees, cached
prompts, sliding windows and attention chunks. (FlexAttention itself runs in tests/gpu.)"""

import pytest
import torch

from helpers import TREE_GROUPS, tree_mask
from sharedprefix.attention.kernels import flex
from sharedprefix.layout import SegmentTree, pack_row


@pytest.mark.parametrize("window, chunk", [(None, None), (2, None), (5, None), (None, 3), (None, 8)])
@pytest.mark.parametrize("prompt_chunk", [None, 4])
@pytest.mark.parametrize("cached", [False, True], ids=["in_row", "cached_prompts"])
def test_flex_visibility_is_the_tree_mask(window, chunk, prompt_chunk, cached):
    tree = SegmentTree(TREE_GROUPS, prompt_chunk=prompt_chunk)
    row_of = (lambda s: s.completion is not None or s.group == 1) if cached else (lambda s: True)
    segs = [s.id for s in tree.segments if row_of(s)]
    anc = {a for s in segs for a in tree.ancestors(s)} - set(segs)
    row = pack_row(tree, segs, anc)
    assert bool(row.cached_reads) == cached
    start, off = {}, 0
    for s in tree.segments:
        start[s.id] = off
        off += s.length
    span = lambda s: torch.arange(start[s], start[s] + tree.segments[s].length)  # noqa: E731
    q_index = torch.cat([span(s) for s in row.segments])  # row token -> token of the tree (segment id order)
    k_index = torch.cat([q_index] + [span(c) for c in row.cached_reads])
    mask_mod, n_keys = flex.visibility(row, row.cached_reads, window, chunk, "cpu")
    assert n_keys == k_index.numel()
    got = mask_mod(0, 0, torch.arange(row.length)[:, None], torch.arange(n_keys)[None, :])
    want = tree_mask(tree, window, chunk)[q_index][:, k_index]
    assert got.shape == want.shape and torch.equal(got, want)
    assert bool(want.any()) and not bool(want.all())


def test_flex_is_refused_off_cuda():
    assert "only on CUDA" in flex.unavailable(torch.zeros(1).device)
    assert "only on CUDA" in flex.unavailable("cpu")
