import sharedprefix as sp
from sharedprefix.layout import SegmentTree, pack_row


def _tree():
    return SegmentTree([sp.Group([1, 2, 3], [[4, 5], [6]]), sp.Group([7], [[8, 9, 10]])])


def test_tree_positions_continue_from_parent():
    tree = _tree()
    segs = tree.segments
    assert [(s.parent, s.start, s.length, s.completion) for s in segs] == [
        (None, 0, 3, None),
        (0, 3, 2, 0),
        (0, 3, 1, 1),
        (None, 0, 1, None),
        (3, 1, 3, 2),
    ]
    assert tree.plain_tokens() == (3 + 2) + (3 + 1) + (1 + 3)


def test_prompt_chain_and_ancestors():
    tree = SegmentTree([sp.Group(list(range(10)), [[1], [2]])], prompt_chunk=4)
    assert tree.prompt_chain == [[0, 1, 2]]
    assert [tree.segments[s].start for s in (0, 1, 2)] == [0, 4, 8]
    leaf = tree.completion_ids[1]
    assert tree.ancestors(leaf) == [0, 1, 2] and tree.segments[leaf].start == 10


def _calls(row, window=None):
    return [
        (
            c.q_start,
            c.q_end,
            [(k.seg, k.start, k.end) for k in c.keys],
            c.cu_seqlens_q.tolist(),
            c.cu_seqlens_k.tolist(),
            c.causal,
            c.window,
        )
        for c in row.cascade(window).calls
    ]


def test_row_is_laid_out_level_by_level_without_padding():
    tree = _tree()
    row = pack_row(tree, [0, 1, 2, 3, 4], cached=set(), rows=[0, 1, 2])
    assert row.segments == [0, 3, 1, 2, 4]  # prompts first, then completions, each level in tree order
    assert row.input_ids.tolist() == [[1, 2, 3, 7, 4, 5, 6, 8, 9, 10]]
    assert row.position_ids.tolist() == [[0, 1, 2, 0, 3, 4, 3, 1, 2, 3]]
    # token 0 of each completion is predicted by its prompt's last token (rows 2 and 3)
    assert row.pred_index.tolist() == [2, 4, 2, 3, 7, 8]
    assert row.targets.tolist() == [4, 5, 6, 8, 9, 10]
    # each completion's values, read out as (rows, longest completion)
    assert row.out_index.tolist() == [[0, 1, 0], [2, 0, 0], [3, 4, 5]]
    assert row.out_mask.tolist() == [[True, True, False], [True, False, False], [True, True, True]]


def test_cascade_is_index_tensors_over_uncopied_key_runs():
    row = pack_row(_tree(), [0, 1, 2, 3, 4], cached=set())
    assert _calls(row) == [
        # every segment causally on itself
        (0, 10, [(None, 0, 10)], [0, 3, 4, 6, 7, 10], [0, 3, 4, 6, 7, 10], True, None),
        # completions (rows 4..10) against the prompts (rows 0..4): one entry per prompt, keys read once
        (4, 10, [(None, 0, 4)], [0, 3, 6], [0, 3, 4], False, None),
    ]
    assert row.cascade(None).copied_keys == 0


def test_deep_chain_one_dense_call_per_depth_and_level_with_gap_entries():
    # group 0's prompt is a chain of two segments; group 1's prompt is one segment with no depth-2 descendant
    tree = SegmentTree([sp.Group([1, 2, 3, 4], [[5], [6, 7]]), sp.Group([8, 9], [[1]])], prompt_chunk=2)
    segs = [s.id for s in tree.segments]
    row = pack_row(tree, segs, cached=set())
    # depth 0: [0, 1] (g0) and [8, 9] (g1); depth 1: [3, 4] (g0) and g1's completion; depth 2: g0's completions
    assert row.input_ids.tolist() == [[1, 2, 8, 9, 3, 4, 1, 5, 6, 7]]
    calls = _calls(row)
    assert len(calls) == 1 + 1 + 2  # causal, (1, 0), (2, 0), (2, 1)
    assert calls[1] == (4, 7, [(None, 0, 4)], [0, 2, 3], [0, 2, 4], False, None)
    assert calls[2] == (7, 10, [(None, 0, 2)], [0, 3], [0, 2], False, None)  # only g0's root: no other entry
    assert calls[3] == (7, 10, [(None, 4, 6)], [0, 3], [0, 2], False, None)


def test_cached_ancestors_are_key_sources():
    tree = SegmentTree([sp.Group(list(range(6)), [[1], [2, 3]])], prompt_chunk=3)
    row = pack_row(tree, [tree.completion_ids[0], tree.completion_ids[1]], cached={0, 1})
    calls = _calls(row)
    assert calls[1:] == [
        (0, 3, [(0, 0, 0)], [0, 3], [0, 3], False, None),
        (0, 3, [(1, 0, 0)], [0, 3], [0, 3], False, None),
    ]
    assert row.cached_reads == [0, 1] and row.h_sources == [1]
    assert row.pred_index.tolist() == [3, 3, 1]  # index 3 = L: the cached last hidden state of segment 1


def test_window_gathers_at_most_window_minus_one_ancestor_keys():
    tree = SegmentTree([sp.Group(list(range(1, 9)), [[1, 2, 3], [4]])])
    row = pack_row(tree, [0, 1, 2], cached=set())
    assert row.cascade(12).calls[0].window is None and len(row.cascade(12).calls) == 2  # never bites: full attention
    casc = row.cascade(3)
    (call,) = casc.calls
    assert call.causal and call.window == 2
    # prompt: its own 8 keys; each completion: the prompt's last 2 positions, then its own keys
    assert call.k_index.tolist() == list(range(8)) + [6, 7, 8, 9, 10] + [6, 7, 11]
    assert call.cu_seqlens_k.tolist() == [0, 8, 13, 16]
    assert casc.copied_keys == 16 and casc.copied_keys < row.length + 2 * 2 + 1
