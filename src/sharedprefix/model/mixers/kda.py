"""Kimi delta attention (KDA: Kimi Linear, Bailing-hybrid) over a packed row: one call per tree level, each segment
from its parent's final state.

KDA is a gated delta rule whose decay is per key channel: the state S (H, Dk, Dv) of one head takes, per token,
``S <- diag(exp(g)) S``, then ``S <- S + k (beta (v - S^T k))^T``, and reads ``o = S^T q`` (q, k l2-normalised inside
when the model asks). transformers computes it in ``chunk_kimi_delta_attention(q, k, v, g=..., beta=...,
initial_state=..., output_final_state=...)`` on (B, L, H, D) inputs, g (B, L, H, Dk), beta (B, L, H). The wrapper here
(its ``KIND``, registered in ``model.mixers.families``) runs, per level of the row's segment tree
(``layout.recurrence.level_index``), one such call over that level's segments as a right-padded batch, each started from
its parent's final state (the same row's previous level, or the prefix cache), and hands back the outputs of the real
tokens in row order.

Why the padding is neutral: a pad token has k = v = 0, beta = 0 and g = 0 (the model's own chunk padding,
``F.pad`` with zeros up to a multiple of the chunk size, uses the same values). With g = 0 the decay is exp(0) = 1 on
every channel, and with k = 0 the update adds nothing, so the state after the pads is the state after the segment's
last real token; the l2 normalisation maps a zero vector to zero (its epsilon keeps the division finite), and the
causal scan never lets a pad reach an earlier token's output. ``tests/model/test_hybrid_linear.py`` checks this on
the model's own function.

Notation: L = row length, B = segments of one level, T = the longest of them, H = heads, Dk / Dv = key / value head
dims, g = log decay per key channel (natural log, <= 0), beta = write strength in (0, 1).
"""

from __future__ import annotations

from sharedprefix.model.mixers.levels import delta_by_levels
from sharedprefix.model.mixers.seams import Kind


def packed_kda(
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
    """``chunk_kimi_delta_attention`` over a packed (1, L, H, D) row; returns ((1, L, H, Dv) outputs, None).

    ``own``: the model's function; ``state``: the pass (``attention.interface.pass_state``: layout, prefix cache);
    ``slot``: (mixer module, "kda"), the cache key of this layer's states; ``first``: record the recorded segments'
    final states (False when a checkpointed layer is recomputed in backward).
    """
    layout = state.layout
    L = layout.length
    if initial_state is not None or kwargs.get("cu_seqlens") is not None or query.shape[:2] != (1, L):
        raise RuntimeError(
            f"Kimi delta attention got queries {tuple(query.shape)} with an initial state or cu_seqlens on a packed "
            f"row of {L} tokens (the model ran with a cache); a bug."
        )
    if g is None or beta is None or g.shape != key.shape or beta.shape != key.shape[:3]:
        raise RuntimeError(
            f"Kimi delta attention got g {None if g is None else tuple(g.shape)} and beta "
            f"{None if beta is None else tuple(beta.shape)} for keys {tuple(key.shape)}; expected a decay per key "
            "channel (1, L, H, Dk) and a strength per head (1, L, H). This transformers version's KDA differs; a bug."
        )
    return delta_by_levels(own, state, slot, first, (query, key, value, g, beta), **kwargs)


KIND = Kind("kda", "chunk_kimi_delta_attention", packed_kda)
