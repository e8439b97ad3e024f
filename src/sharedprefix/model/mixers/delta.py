"""Gated delta rules on the packed path (the gated delta-nets of Qwen3-Next, Qwen3.5, OLMo-hybrid and Lara-mini):
``torch_chunk_gated_delta_rule(q, k, v, g=..., beta=..., initial_state=..., output_final_state=...)`` on
(1, L, H, D) inputs, one call per tree level, each segment from its parent's final state (``levels.by_levels``).

Padding: a pad token has k = v = 0, beta = 0 and g = 0 (the model's own chunk padding uses the same values): no
decay, no write, so a padded segment's final state is its state after its last real token.

Notation: L = row length, H = value heads, Dk / Dv = key / value head dims; a final state is (H, Dk, Dv).
"""

from __future__ import annotations

from sharedprefix.model.mixers.levels import delta_by_levels
from sharedprefix.model.mixers.seams import Kind


def packed_delta(
    own,
    state,
    slot,
    first,
    query,
    key,
    value,
    g=None,
    beta=None,
    initial_state=None,
    output_final_state=False,
    **kwargs,
):
    """``torch_chunk_gated_delta_rule`` over a packed row: one call per level, each segment from its parent's state."""
    layout = state.layout
    if initial_state is not None or kwargs.get("cu_seqlens") is not None or query.shape[:2] != (1, layout.length):
        raise RuntimeError(
            f"a gated delta rule got queries {tuple(query.shape)} with an initial state or cu_seqlens on a packed row "
            f"of {layout.length} tokens (the model ran with a cache); a bug."
        )
    return delta_by_levels(own, state, slot, first, (query, key, value, g, beta), **kwargs)


KIND = Kind("delta", "torch_chunk_gated_delta_rule", packed_delta)
