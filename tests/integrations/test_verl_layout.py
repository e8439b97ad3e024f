"""The pure layout functions of the verl integration (no verl needed): verl's shifted jagged layout, its rows."""

import pytest
import torch

from sharedprefix.integrations.verl_layout import (
    check_positions,
    response_lengths,
    rows_of,
    to_verl,
)


def _nested(rows):
    return torch.nested.as_nested_tensor([torch.tensor(r) for r in rows], layout=torch.jagged)


def test_to_verl_shifts_by_one_and_ends_each_row_with_zero():
    values = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, 5.0, 6.0, 0.0]])  # (B, L) about token t
    out = to_verl(values, torch.tensor([4, 3]))
    assert out.tolist() == [1.0, 2.0, 3.0, 0.0, 5.0, 6.0, 0.0]  # entry t of a row predicts token t + 1


def test_rows_train_the_response_tokens_only():
    ids = _nested([[7, 8, 9, 4, 5], [7, 8, 1]])
    rows = rows_of(ids, torch.tensor([2, 1]))
    assert rows.prompt_lengths.tolist() == [3, 2]
    assert [m.tolist() for m in rows.tree.trained] == [[False, False, False, True, True], [False, False, True]]
    with pytest.raises(ValueError, match="row 1 has 3 tokens of which 3 are response tokens"):
        rows_of(ids, torch.tensor([2, 3]))


def test_response_lengths_from_padded_or_nested():
    attn = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])  # P = 2 prompt columns, R = 3
    assert response_lengths(torch.zeros(2, 3), attn).tolist() == [2, 3]
    assert response_lengths(_nested([[1, 2], [3]]), None).tolist() == [2, 1]


def test_positions_must_count_along_each_row():
    check_positions(_nested([[0, 1, 2], [0, 1]]), torch.tensor([3, 2]))
    with pytest.raises(ValueError, match="not 0, 1, ..., len-1"):
        check_positions(_nested([[0, 1, 2], [3, 4]]), torch.tensor([3, 2]))
