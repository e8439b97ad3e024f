"""Exact shared-prefix attention, registered with transformers' attention interface."""

from sharedprefix.attention.backends import BACKENDS, eager_block, sdpa_block
from sharedprefix.attention.interface import NAME, PassState, activated, pass_state, shared_prefix_attention

__all__ = ["BACKENDS", "NAME", "PassState", "activated", "eager_block", "pass_state", "sdpa_block", "shared_prefix_attention"]
