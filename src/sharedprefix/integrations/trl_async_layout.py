"""TRL's packed tree row (``trl.experimental.async_grpo.packing.TreeRow.pack``) as a ``sharedprefix.Tree``, and the
tree's log-probs back on the packed positions.

``AsyncGRPOTrainer`` folds a rank's samples into one prefix trie and lays it out as one packed row of N unique tokens:
S segments in DFS order, segment s at positions ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``, and its root-to-segment path
(the packed positions of its ancestors' tokens, then its own) at ``kv_index[cu_seqlens_k[s]:cu_seqlens_k[s+1]]``;
``position_ids`` are trie depths and ``shift_labels[p]`` is the next token position p predicts (-100: none). Every
sample ends on a leaf segment, so the rows are the leaves' paths, and a labelled position p lies on some leaf path
at index t, where its label is the path's token t + 1.

Notation: N = packed tokens, S = segments, R = leaf rows, M = labelled positions, L = longest row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import sharedprefix as sp


@dataclass
class PackedTree:
    """How a packed row maps onto the rows of a ``sharedprefix.Tree``.

    Attributes:
        tree: the leaves' rows, each token t >= 1 trained where its predecessor's position has a label.
        positions: (M,) long, the labelled packed positions.
        rows: (M,) long, a tree row through each labelled position.
        cols: (M,) long, the column of that row whose log-prob is the position's (its index on the path + 1).
        length: N, the packed row's length.
    """

    tree: sp.Tree
    positions: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    length: int


def packed_tree(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    shift_labels: torch.Tensor,
    tree_kv_index: torch.Tensor,
    tree_cu_seqlens_q: torch.Tensor,
    tree_cu_seqlens_k: torch.Tensor,
) -> PackedTree:
    """(1, N) ``input_ids``, ``position_ids``, ``shift_labels`` of one packed row and its tree index tensors (the
    keyword arguments ``AsyncGRPOTrainer.compute_loss`` passes the model) -> a ``PackedTree``. Raises ValueError for
    a layout that is not a prefix tree with trie-depth positions and next-token labels."""
    ids, pos, labels = (x.detach().reshape(-1).cpu() for x in (input_ids, position_ids, shift_labels))
    kv, cu_q, cu_k = (x.detach().cpu().long() for x in (tree_kv_index, tree_cu_seqlens_q, tree_cu_seqlens_k))
    n, segments = ids.numel(), cu_q.numel() - 1
    if segments < 1 or cu_k.numel() != cu_q.numel() or int(cu_q[0]) != 0 or int(cu_q[-1]) != n:
        raise ValueError(
            f"tree_cu_seqlens_q {cu_q.tolist()} and tree_cu_seqlens_k {cu_k.tolist()} for a packed row of {n} tokens; "
            "expected S + 1 offsets each, the first from 0 to the row's length, as TRL's TreeRow.pack lays them out."
        )
    paths, parent_ends = [], set()
    for s in range(segments):
        start, end = int(cu_q[s]), int(cu_q[s + 1])
        path = kv[int(cu_k[s]) : int(cu_k[s + 1])]
        own = end - start
        if own < 1 or path.numel() < own or not torch.equal(path[-own:], torch.arange(start, end)):
            raise ValueError(
                f"segment {s} (positions {start}:{end}) has the path {path.tolist()}; expected its ancestors' "
                "positions followed by its own, as TRL's TreeRow.pack lays them out."
            )
        if not torch.equal(pos[path], torch.arange(path.numel())):
            raise ValueError(
                f"segment {s} has position_ids {pos[path].tolist()} along its path; expected 0, 1, ... (each token's "
                "depth in the trie): sharedprefix numbers each row's tokens from 0."
            )
        if path.numel() > own:
            parent_ends.add(int(path[-own - 1]))
        paths.append(path)
    leaves = [p for p in paths if int(p[-1]) not in parent_ends]
    rows, trained = [], []
    owner = torch.full((n,), -1, dtype=torch.long)  # packed position -> (leaf row, index on its path)
    index = torch.zeros(n, dtype=torch.long)
    for i, path in enumerate(leaves):
        rows.append(ids[path])
        has_label = labels[path] != -100
        trained.append(torch.cat([torch.zeros(1, dtype=torch.bool), has_label[:-1]]))
        if bool(has_label[-1]):
            raise ValueError(
                f"packed position {int(path[-1])} ends a sample but has the label {int(labels[path[-1]])}; expected "
                "-100 there (no token follows it)."
            )
        fresh = owner[path] < 0
        owner[path[fresh]] = i
        index[path[fresh]] = torch.arange(path.numel())[fresh]
        nxt = ids[path[1:]][has_label[:-1]]
        if not torch.equal(labels[path[:-1]][has_label[:-1]], nxt):
            raise ValueError(
                "a packed position's shift_label is not the token that follows it on its sample's path; expected "
                "next-token labels, as TRL's TreeRow.pack sets them."
            )
    if bool((owner < 0).any()):
        raise ValueError(f"packed positions {torch.nonzero(owner < 0).flatten().tolist()} lie on no sample's path.")
    positions = torch.nonzero(labels != -100).flatten()
    return PackedTree(sp.Tree.from_rows(rows, trained), positions, owner[positions], index[positions] + 1, n)


TREE_KEYS = ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")


def packed_inputs(batch: dict) -> tuple[torch.Tensor, ...]:
    """One micro-step's batch (this rank's row of TRL's collated micro-batch, padded to the longest rank's) -> the
    (input_ids, position_ids, shift_labels, tree_kv_index, tree_cu_seqlens_q, tree_cu_seqlens_k) that
    ``AsyncGRPOTrainer.compute_loss`` passes its model, built as it builds them: the padding stripped by
    ``attention_mask``, the tree tensors' -1 padding dropped."""
    mask = batch["attention_mask"].bool()
    row = tuple(batch[key][mask].unsqueeze(0) for key in ("input_ids", "position_ids", "shift_labels"))
    return row + tuple(batch[key][batch[key] >= 0] for key in TREE_KEYS)


def to_packed(values: torch.Tensor, pt: PackedTree) -> torch.Tensor:
    """(R, L) values aligned with the tree's rows -> (1, N) on the packed positions, zero where nothing is labelled
    (as TRL's fused head gives them); differentiable."""
    dev = values.device
    picked = values[pt.rows.to(dev), pt.cols.to(dev)]
    return values.new_zeros(pt.length).index_copy(0, pt.positions.to(dev), picked)[None]
