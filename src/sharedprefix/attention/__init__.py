"""Exact shared-prefix attention: one varlen primitive, a cascade over the tree, hooked into transformers."""

from sharedprefix.attention.cascade import cascade_attention
from sharedprefix.attention.interface import NAME, PassState, pass_state, shared_prefix_attention
from sharedprefix.attention.kernels import BACKENDS, IMPLEMENTATIONS, KernelCall, select
from sharedprefix.attention.merge import merge_state
from sharedprefix.attention.switch import activated

__all__ = [
    "BACKENDS",
    "IMPLEMENTATIONS",
    "KernelCall",
    "NAME",
    "PassState",
    "activated",
    "cascade_attention",
    "merge_state",
    "pass_state",
    "select",
    "shared_prefix_attention",
]
