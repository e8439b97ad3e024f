"""Token mixers outside attention (hybrid models): which families run where, and the packed path's short
convolutions, gated delta rules, Kimi delta attention and Mamba2 scans, driven from the row's segment tree at the seams
transformers calls for them.

``families`` is the registry: one table, model type -> path (packed here, or the cache path ``schedule.cache_path``)
and, for the packed ones, the mixer modules and the kinds of seams they call. ``seams`` wraps the modeling module's
functions (and hooks the mixer modules) for the duration of one call; ``levels`` is the per-level loop the
recurrences share (each segment from its parent's final state); one file per kind of seam: ``conv``
(``causal_conv1d_fn``), ``conv_module`` (a mixer's own ``nn.Conv1d`` where there is no such function), ``delta``
(``torch_chunk_gated_delta_rule``), ``kda`` (``chunk_kimi_delta_attention``), ``ssm`` (``mamba2_chunk_scan``). The
family files import ``levels`` and ``seams``; ``families`` imports the family files; nothing imports back.

A recorded segment's conv tail (1, C, K) and final recurrent state (H, Dk, Dv) or (H, P, N) go to the prefix cache
like its K/V (``write_state``), and later passes read them back (``read_state``).

Notation: L = row length, C = conv channels, K = conv kernel - 1, H = value heads, Dk / Dv = key / value head dims.
"""

from sharedprefix.model.mixers.families import (
    CACHE,
    FAMILIES,
    KINDS,
    PACKED,
    PACKED_LAYER_TYPES,
    Family,
    active,
    attention_free,
    check_active,
    check_reachable,
    conv_modules,
    mixer_modules,
    model_types,
    on_cache_path,
    on_packed_path,
    on_path,
)
from sharedprefix.model.mixers.seams import Kind, current_mixer

__all__ = [
    "CACHE",
    "FAMILIES",
    "KINDS",
    "PACKED",
    "PACKED_LAYER_TYPES",
    "Family",
    "Kind",
    "active",
    "attention_free",
    "check_active",
    "check_reachable",
    "conv_modules",
    "current_mixer",
    "mixer_modules",
    "model_types",
    "on_cache_path",
    "on_packed_path",
    "on_path",
]
