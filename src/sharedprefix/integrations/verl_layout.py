"""verl's no-padding rows <-> sharedprefix trees: pure functions, no verl import.

verl 0.9.1's FSDP engine receives each micro-batch in "no-padding" form: ``input_ids`` is a jagged
nested tensor of rows ``[prompt | response]`` (prompt without its left padding, response without
its right padding), and the model outputs it returns (``log_probs``, ``entropy``) are jagged
tensors of the same lengths, *shifted by one*: ``log_probs[i][t] = log p(row_i[t + 1] | row_i[:t + 1])``
(the entry at ``t = len_i - 1`` predicts nothing; verl's losses never read it, nor the prompt
entries). sharedprefix's tree results are aligned with the rows instead:
``lp[i, t] = log p(row_i[t] | row_i[:t])`` where token t is trained.

Notation: B = rows of a micro-batch, L = longest row, len_i = length of row i, P_i = its prompt
length, R_i = its response length (len_i = P_i + R_i), total = sum of len_i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import sharedprefix as sp


@dataclass
class Rows:
    """The rows of a micro-batch as a tree whose trained tokens are the response tokens.

    Attributes:
        tree: every row ``[prompt | response]``; trained: each response token (tool tokens too, so that
            every response position gets its log-prob, as in verl; its loss masks them).
        lengths: (B,) int64 len_i, CPU.
        prompt_lengths: (B,) int64 P_i, CPU.
    """

    tree: sp.Tree
    lengths: torch.Tensor
    prompt_lengths: torch.Tensor


def response_lengths(responses: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """(B,) R_i from verl's ``responses`` (nested, or right-padded (B, R) with the (B, P + R) attention mask)."""
    if responses.is_nested:
        return responses.offsets().diff().cpu()
    if attention_mask is None or attention_mask.is_nested:
        raise ValueError(
            "the micro-batch has padded 'responses' but no padded 'attention_mask'; expected verl's RL batch layout "
            "(left_right_2_no_padding keeps attention_mask), from which the response lengths are read."
        )
    return attention_mask[:, -responses.shape[1] :].sum(dim=1).cpu().to(torch.int64)


def rows_of(input_ids: torch.Tensor, resp_lengths: torch.Tensor) -> Rows:
    """(B, j) jagged ``input_ids`` and (B,) response lengths -> a ``Rows`` tree (response tokens trained)."""
    if not input_ids.is_nested:
        raise ValueError(
            f"input_ids is a dense tensor of shape {tuple(input_ids.shape)}; expected verl's no-padding layout "
            "(a jagged nested tensor, pad_mode=no_padding)."
        )
    offsets = input_ids.offsets().cpu()
    values = input_ids.values().cpu()
    lengths = offsets.diff()
    plen = lengths - resp_lengths
    if bool((plen < 1).any()):
        i = int((plen < 1).nonzero()[0])
        raise ValueError(
            f"row {i} has {int(lengths[i])} tokens of which {int(resp_lengths[i])} are response tokens; expected a "
            "non-empty prompt before the response (verl's losses assume it too)."
        )
    rows, trained = [], []
    for i in range(len(lengths)):
        a, b = int(offsets[i]), int(offsets[i + 1])
        rows.append(values[a:b])
        trained.append(torch.arange(b - a) >= int(plen[i]))
    return Rows(sp.Tree.from_rows(rows, trained), lengths, plen)


def check_positions(position_ids: torch.Tensor, lengths: torch.Tensor) -> None:
    """sharedprefix numbers positions itself (0..len_i-1 along each row); verl's must be the same."""
    if position_ids.dim() != 2 or not position_ids.is_nested:
        raise ValueError(
            f"position_ids has {position_ids.dim()} dimensions; expected one position per token (a jagged (B, j) "
            "tensor). 3-D position ids (mRoPE of vision-language models) are not supported by sharedprefix's verl "
            "engine; train text-only models with it."
        )
    got = position_ids.values().cpu()
    want = torch.cat([torch.arange(int(n)) for n in lengths])
    if got.shape != want.shape or not torch.equal(got.to(want.dtype), want):
        raise ValueError(
            "position_ids are not 0, 1, ..., len-1 along each row; sharedprefix computes each token's position from "
            "its place in the row (a completion continues its prompt), so other position ids would be silently "
            "ignored. Use verl's default position ids (the attention mask's cumulative sum)."
        )


def to_verl(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """(B, L) values aligned with the rows (``[i, t]`` about token t) -> (total,) in verl's shifted layout.

    Entry ``t`` of row i is ``values[i, t + 1]``; the last entry of each row is 0. Differentiable.
    """
    B, L = values.shape
    shifted = torch.cat([values[:, 1:], values.new_zeros(B, 1)], dim=1)  # (B, L): column t holds token t + 1
    keep = torch.arange(L, device=values.device)[None] < lengths.to(values.device)[:, None]
    return shifted[keep]  # row-major: row 0's len_0 entries, then row 1's, ...
