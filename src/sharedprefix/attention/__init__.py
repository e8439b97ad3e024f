"""Exact shared-prefix attention: one varlen primitive, a cascade over the tree, hooked into transformers."""

from sharedprefix.attention.cascade import cascade_attention
from sharedprefix.attention.interface import NAME, PassState, pass_state, shared_prefix_attention
from sharedprefix.attention.kernels import IMPLEMENTATIONS, select
from sharedprefix.attention.switch import activated

__all__ = [
    "IMPLEMENTATIONS",
    "NAME",
    "PassState",
    "activated",
    "cascade_attention",
    "pass_state",
    "select",
    "shared_prefix_attention",
]
