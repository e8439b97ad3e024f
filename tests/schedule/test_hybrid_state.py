"""The hybrid path's copies of a prompt's cache (``schedule.cache_path.state``): each completion batch starts from the
prompt's state, whatever an earlier batch's forward did to its own copy."""

import pytest
import torch

from sharedprefix.schedule.cache_path import state as cache_state


def _linear_cache(prompt_len: int):
    from transformers import DynamicCache
    from transformers.cache_utils import LinearAttentionLayer

    cache = DynamicCache()
    cache.layers = [LinearAttentionLayer()]
    cache.update_conv_state(torch.randn(1, 4, prompt_len, dtype=torch.float64), 0, conv_kernel_size=3)
    return cache


def test_each_copy_counts_from_the_prompts_length():
    """transformers 5.25's linear-attention layers count the tokens they have seen in a 0-d tensor, incremented in
    place, and a cache whose first layer is one answers ``get_seq_length`` (the next token's position) from it: a copy
    sharing the prompt's counter would start the next batch's completions after the previous batch's."""
    cache = _linear_cache(5)
    if not hasattr(cache.layers[0], "cumulative_length_linear"):
        pytest.skip("this transformers' linear-attention layers keep no token count")
    slots = cache_state.state_slots(cache)
    tensors = cache_state.read_states(cache, slots)
    first = cache_state.repeated_states(cache, slots, tensors, 2)
    first.update_conv_state(torch.randn(2, 4, 3, dtype=torch.float64), 0)  # a batch's completions, 3 tokens
    second = cache_state.repeated_states(cache, slots, tensors, 3)
    assert int(first.get_seq_length()) == 8
    assert int(second.get_seq_length()) == int(cache.get_seq_length()) == 5
    assert second.layers[0].conv_states[0].shape[0] == 3


def test_a_tensor_the_path_does_not_know_is_refused():
    """Any other tensor on a cache layer (a state the copies would share or drop) is refused, naming it."""
    cache = _linear_cache(5)
    cache.layers[0].extra_state = torch.zeros(1, 4)
    with pytest.raises(
        ValueError, match=r"holds tensors \['extra_state'\] that sharedprefix's hybrid path does not copy"
    ):
        cache_state.state_slots(cache)


def test_a_count_other_than_the_prompts_length_is_refused():
    """After the prompt's forward each counter must say where the completions begin (the prompt's length)."""
    cache = _linear_cache(5)
    if not hasattr(cache.layers[0], "cumulative_length_linear"):
        pytest.skip("this transformers' linear-attention layers keep no token count")
    slots = cache_state.state_slots(cache)
    cache_state.check_filled("Tiny", cache, slots, 5)
    want = (
        r"Tiny: cache layer 0 \(LinearAttentionLayer\) counts 5 tokens in its cumulative_length_linear "
        r"after a prompt of 6"
    )
    with pytest.raises(ValueError, match=want):
        cache_state.check_filled("Tiny", cache, slots, 6)
