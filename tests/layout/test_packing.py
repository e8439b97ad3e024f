import torch

import sharedprefix as sp
from sharedprefix.layout import SegmentTree, pack_row


def _tree():
    return SegmentTree([sp.Group([1, 2, 3], [[4, 5], [6]]), sp.Group([7], [[8, 9, 10]])])


def test_tree_positions_continue_from_parent():
    tree = _tree()
    segs = tree.segments
    assert [(s.parent, s.start, s.length, s.completion) for s in segs] == [
        (None, 0, 3, None), (0, 3, 2, 0), (0, 3, 1, 1), (None, 0, 1, None), (3, 1, 3, 2),
    ]
    assert tree.plain_tokens() == (3 + 2) + (3 + 1) + (1 + 3)


def test_prompt_chain_and_ancestors():
    tree = SegmentTree([sp.Group(list(range(10)), [[1], [2]])], prompt_chunk=4)
    assert tree.prompt_chain == [[0, 1, 2]]
    assert [tree.segments[s].start for s in (0, 1, 2)] == [0, 4, 8]
    leaf = tree.completion_ids[1]
    assert tree.ancestors(leaf) == [0, 1, 2] and tree.segments[leaf].start == 10


def test_row_packs_groups_without_padding_and_shares_prompt_keys():
    tree = _tree()
    row = pack_row(tree, [0, 1, 2, 3, 4], cached=set())
    assert row.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    assert row.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 0, 1, 2, 3]]
    # blocks: prompt 0 (plain causal), completions of group 0, prompt 1, completion of group 1
    assert [(b.q_start, b.q_end, b.plain_causal) for b in row.blocks] == [
        (0, 3, True), (3, 6, False), (6, 7, True), (7, 10, False),
    ]
    # the completions' keys are one contiguous slice (prompt + completions): no copy of the prompt
    assert [(k.start, k.end, k.cached) for k in row.blocks[1].keys] == [(0, 6, False)]
    mask = row.blocks[1].mask(None, "cpu")
    expected = torch.tensor([
        [1, 1, 1, 1, 0, 0],  # completion 0, token 0
        [1, 1, 1, 1, 1, 0],  # completion 0, token 1
        [1, 1, 1, 0, 0, 1],  # completion 1 sees the prompt and itself, never completion 0
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)
    # token 0 of each completion is predicted by the prompt's last token (row index 2)
    assert row.pred_index.tolist() == [2, 3, 2, 6, 7, 8]
    assert row.targets.tolist() == [4, 5, 6, 8, 9, 10]


def test_sliding_window_mask_and_no_op_window():
    tree = _tree()
    row = pack_row(tree, [0, 1, 2], cached=set())
    assert row.blocks[0].mask(3, "cpu") is None  # window covers the whole block: plain causal
    m = row.blocks[1].mask(2, "cpu")  # query at position p sees keys at positions > p - 2
    assert m[1].tolist() == [False, False, False, True, True, False]


def test_cached_ancestors_become_key_parts():
    tree = SegmentTree([sp.Group(list(range(6)), [[1], [2, 3]])], prompt_chunk=3)
    row = pack_row(tree, [tree.completion_ids[0], tree.completion_ids[1]], cached={0, 1})
    assert [k.seg for k in row.blocks[0].keys] == [0, 1, None]
    assert row.cached_reads == [0, 1] and row.h_sources == [1]
    assert row.pred_index.tolist() == [3, 3, 1]  # index 3 = L: the cached last hidden state of segment 1
