"""``sharedprefix.Tree``: any rows, with the tokens to train; every shared prefix is found by a token trie.

Notation: N = rows, L = longest row, L_i = length of row i.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sharedprefix.layout.groups import Group, as_ids, check_all_in_vocab


def _as_mask(value, n: int, what: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.dtype != torch.bool:
            raise TypeError(f"{what} is a tensor of dtype {value.dtype}; expected a bool tensor (True = trained).")
        if value.dim() != 1:
            raise ValueError(f"{what} has shape {tuple(value.shape)}; expected a 1-D bool tensor.")
        mask = value.detach().to("cpu").clone()
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if not all(isinstance(x, bool) or (isinstance(x, int) and x in (0, 1)) for x in value):
            raise TypeError(f"{what} holds values other than booleans; expected one bool per token (True = trained).")
        mask = torch.tensor([bool(x) for x in value], dtype=torch.bool)
    else:
        raise TypeError(f"{what} is a {type(value).__name__}; expected a list of bools or a 1-D bool tensor.")
    if mask.numel() != n:
        raise ValueError(f"{what} has {mask.numel()} entries but its row has {n} tokens; expected one per token.")
    return mask


class Tree:
    """Rows of token ids and which of their tokens are trained, to be computed with every common prefix once.

    Build it with ``Tree.from_rows``. Results of ``sp.logprobs(model, tree)`` are (N, L), aligned with
    the rows: ``[i, t] = log p(row_i[t] | row_i[:t])`` where row i trains token t and t >= 1, else 0.
    """

    def __init__(
        self, rows: tuple[torch.Tensor, ...], trained: tuple[torch.Tensor, ...], index: tuple[int, ...] | None = None
    ):
        self.rows = rows
        self.trained = trained
        self.index = tuple(range(len(rows))) if index is None else index  # rows' positions in the tree sharded from

    def subset(self, rows: list[int]) -> Tree:
        """The tree of the rows at positions ``rows`` (in that order); ``.index`` maps back to the original rows."""
        return Tree(
            tuple(self.rows[i] for i in rows), tuple(self.trained[i] for i in rows), tuple(self.index[i] for i in rows)
        )

    def copy(self) -> Tree:
        """This tree sharing no tensor with it (its rows and masks copied), as ``sp.plan_call`` keeps it."""
        return Tree(tuple(r.clone() for r in self.rows), tuple(m.clone() for m in self.trained), self.index)

    @classmethod
    def from_rows(cls, rows, trained=None) -> Tree:
        """Args:
        rows: N >= 1 token sequences (lists of ints or 1-D integer tensors), each of length >= 1.
        trained: None (every token t >= 1 is trained) or N bool sequences of the rows' lengths:
            which tokens are trained (e.g. assistant turns yes, tool results no). Token 0 of a row
            has no prediction; its flag is ignored.
        """
        if isinstance(rows, torch.Tensor) or not isinstance(rows, Sequence) or isinstance(rows, (str, bytes)):
            raise TypeError(f"rows is a {type(rows).__name__}; expected a list of token sequences (one per row).")
        if len(rows) == 0:
            raise ValueError("rows is empty; expected at least one row of token ids.")
        ids = []
        for i, r in enumerate(rows):
            t = as_ids(r, f"rows[{i}]")
            if t.numel() == 0:
                raise ValueError(f"rows[{i}] is empty; expected at least one token. Drop empty rows before the call.")
            ids.append(t)
        if trained is None:
            masks = [torch.ones(t.numel(), dtype=torch.bool) for t in ids]
        else:
            if not isinstance(trained, Sequence) or isinstance(trained, (str, bytes, torch.Tensor)):
                raise TypeError(f"trained is a {type(trained).__name__}; expected None or a list of N bool sequences.")
            if len(trained) != len(ids):
                raise ValueError(f"trained has {len(trained)} masks for {len(ids)} rows; expected one mask per row.")
            masks = [_as_mask(m, t.numel(), f"trained[{i}]") for i, (m, t) in enumerate(zip(trained, ids))]
        for m in masks:
            m[0] = False
        return cls(tuple(ids), tuple(masks))

    def __len__(self) -> int:
        return len(self.rows)

    def __repr__(self) -> str:
        return f"Tree(rows={len(self.rows)}, tokens={sum(r.numel() for r in self.rows)})"

    def check_vocab(self, vocab_size: int) -> None:
        if not self.rows:
            raise ValueError("the tree has no rows (a shard with nothing on this rank?); expected at least one row.")
        check_all_in_vocab([(f"rows[{i}]", r) for i, r in enumerate(self.rows)], vocab_size)


def copied(source):
    """``source`` sharing no tensor with the caller's: a ``Tree``'s or each ``Group``'s copy (token ids and
    ``prompt_inputs``); anything else as it is, for validation to refuse. What a call keeps to read later (a plan, a
    deferred backward) is this copy, so that no in-place edit of the caller's tensors after the call reaches it."""
    if isinstance(source, Tree):
        return source.copy()
    if isinstance(source, Sequence) and not isinstance(source, (str, bytes)):
        return [g.copy() if isinstance(g, Group) else g for g in source]
    return source
