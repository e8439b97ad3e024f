import pytest
import torch

import sharedprefix as sp
from helpers import tiny_model


def test_group_accepts_lists_and_tensors_and_keeps_order():
    g = sp.Group([3, 1, 2], [torch.tensor([5, 4], dtype=torch.int32), [7]])
    assert g.prompt.tolist() == [3, 1, 2]
    assert [c.tolist() for c in g.completions] == [[5, 4], [7]]
    assert g.prompt.dtype == torch.int64 and g.group_size == 2


@pytest.mark.parametrize(
    "prompt, completions, err, match",
    [
        ([], [[1]], ValueError, "prompt is empty"),
        ([1], [], ValueError, "completions is empty"),
        ([1], [[1], []], ValueError, r"completions\[1\] is empty"),
        ([1, 2.5], [[1]], TypeError, r"prompt\[1\] is 2.5"),
        ([1], [[1, "a"]], TypeError, r"completions\[0\]\[1\] is 'a'"),
        (torch.tensor([1.0]), [[1]], TypeError, "dtype torch.float32"),
        (torch.tensor([[1, 2]]), [[1]], ValueError, r"shape \(1, 2\)"),
        # a tokenizer's (1, P) input_ids, completions alike: a batch dimension, not one stream of frames
        (torch.tensor([[1, 2]]), [torch.tensor([[3]])], ValueError, r"prompt has shape \(1, 2\); .*without a batch"),
        ([[1, 2]], [[[3]]], ValueError, r"prompt has shape \(1, 2\); .*without a batch"),
        ("hello", [[1]], TypeError, "Tokenize text"),
        ([1], torch.tensor([[1, 2]]), TypeError, "completions is a Tensor"),
    ],
)
def test_group_validation_messages(prompt, completions, err, match):
    with pytest.raises(err, match=match):
        sp.Group(prompt, completions)


def test_a_list_of_scalar_tensors_is_token_ids():
    """``list(ids)`` of a 1-D tensor: 0-d integer tensors are token ids (as numpy scalars are), not token streams."""
    ids = torch.tensor([3, 1, 2])
    g = sp.Group(list(ids), [list(torch.tensor([5, 4])), [7]])
    assert g.prompt.tolist() == [3, 1, 2] and g.completions[0].tolist() == [5, 4] and g.streams is None


def test_ids_outside_vocabulary_name_group_and_value():
    model = tiny_model("llama")
    groups = [sp.Group([1, 2], [[3]]), sp.Group([1], [[4], [97]])]
    with pytest.raises(ValueError, match=r"groups\[1\]\.completions\[1\] holds token id 97, outside .*\[0, 97\)"):
        sp.logprobs(model, groups)
    with pytest.raises(ValueError, match=r"groups\[0\]\.prompt holds token id -1"):
        sp.logprobs(model, [sp.Group([1, -1], [[3]])])


def test_groups_that_are_not_a_list_of_groups_are_refused():
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="single Group"):
        sp.logprobs(model, sp.Group([1], [[2]]))
    with pytest.raises(ValueError, match="groups is empty"):
        sp.logprobs(model, [])
    with pytest.raises(TypeError, match=r"groups\[0\] is a list"):
        sp.logprobs(model, [[1, 2]])
