"""Attention-score soft-capping on CUDA (Gemma 2's ``attn_logit_softcapping``) through FlexAttention.

torch's CUDA flash ops cannot soft-cap, so a soft-capped layer on CUDA runs the row's whole tree attention as one
``flex_attention`` call: ``score_mod`` caps the scores (s -> c * tanh(s / c)), and the block mask is the tree's
visibility, read from the layout's index tensors: per query and per key its segment and position, and an (S, S)
table of which segment is an ancestor of which. A query at position p of segment x sees a key at position p' of
segment y when y is an ancestor of x, or y = x and p' <= p; under a sliding window of w tokens also p - p' < w; under
attention chunks of C positions also p // C = p' // C. The keys are the row's, then the cached segments' (their
concatenation is the one copy this path makes; autograd carries dK, dV back to the cached leaves). FlexAttention's
own backward (autograd) gives the gradients; no merge is needed, as one call covers every key.

``flex_attention`` is compiled once per process with dynamic shapes (``torch.compile(dynamic=True)``); the block
mask is built once per pass and window (``create_block_mask(_compile=True)``) and reused by every layer.
Bidirectional blocks and attention sinks are refused here (no soft-capped model has them). FlexAttention has no
backward on the CPU, where the ``cpu`` kernel soft-caps exactly; ``tests/gpu`` runs this path.

Notation: L = row length, K = keys (row, then cached), S = segments of the tree, H / Hkv = heads, D = head dim.
"""

from __future__ import annotations

import torch

_COMPILED: dict = {}  # "flex" -> the compiled flex_attention; softcap value -> its score_mod


def unavailable(device: torch.device | str) -> str | None:
    """Why the FlexAttention path cannot run on ``device``, or None."""
    if torch.device(device).type != "cuda":
        return "FlexAttention runs only on CUDA here (on the CPU it has no backward)"
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention (torch>=2.5 does)"
    return None


def visibility(layout, cached_keys: list[int], window: int | None, chunk: int | None, device):
    """The tree's visibility as index tensors and its ``mask_mod``: (mask_mod, K).

    Keys: the row's L tokens, then each segment of ``cached_keys`` whole, in that order. ``mask_mod(b, h, q, k)`` takes
    (broadcastable) int tensors of query and key indices and returns bool, True where the query sees the key.
    """
    segs, tree = layout.tree.segments, layout.tree
    q_seg = torch.empty(layout.length, dtype=torch.int64)
    q_pos = torch.empty(layout.length, dtype=torch.int64)
    for s in layout.segments:
        r0, r1 = layout.row_start[s], layout.row_end[s]
        q_seg[r0:r1] = s
        q_pos[r0:r1] = torch.arange(segs[s].start, segs[s].end)
    k_seg = torch.cat([q_seg] + [torch.full((segs[c].length,), c, dtype=torch.int64) for c in cached_keys])
    k_pos = torch.cat([q_pos] + [torch.arange(segs[c].start, segs[c].end) for c in cached_keys])
    anc = torch.zeros(len(segs), len(segs), dtype=torch.bool)
    for s in layout.segments:
        for a in tree.ancestors(s):
            anc[s, a] = True
    q_seg, q_pos, k_seg, k_pos, anc = (t.to(device) for t in (q_seg, q_pos, k_seg, k_pos, anc))

    def mask_mod(b, h, qi, ki):
        sq, sk, pq, pk = q_seg[qi], k_seg[ki], q_pos[qi], k_pos[ki]
        ok = anc[sq, sk] | ((sq == sk) & (pk <= pq))
        if window is not None:
            ok = ok & (pq - pk < window)
        if chunk is not None:
            ok = ok & (pq // chunk == pk // chunk)
        return ok

    return mask_mod, int(k_seg.numel())


def _flex():
    if "flex" not in _COMPILED:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED["flex"] = torch.compile(flex_attention, dynamic=True)
    return _COMPILED["flex"]


def _score_mod(softcap: float):
    """One function per soft-cap value, so that the compiled call sees the same ``score_mod`` every time."""
    key = ("cap", softcap)
    if key not in _COMPILED:

        def cap(score, b, h, qi, ki):
            return softcap * torch.tanh(score / softcap)

        _COMPILED[key] = cap
    return _COMPILED[key]


def block_mask(layout, window: int | None, chunk: int | None, device):
    """The row's block mask for ``window`` / ``chunk``, built once per layout (every layer reuses it)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def build():
        mask_mod, n_keys = visibility(layout, layout.cached_reads, window, chunk, device)
        return create_block_mask(mask_mod, None, None, layout.length, n_keys, device=device, _compile=True)

    key = ("flex", window, chunk, str(device))
    if key not in layout._cascades:  # kept with the plan's packed row: built outside inference mode (``layout.once``)
        with torch.inference_mode(False), torch.no_grad():
            layout._cascades[key] = build()
    return layout._cascades[key]


def flex_row_attention(layout, query, key, value, read_kv, scale: float, softcap: float, window, chunk) -> torch.Tensor:
    """Soft-capped shared-prefix attention of a packed row: query (1, H, L, D), key / value (1, Hkv, L, D) as
    transformers passes them, ``read_kv`` (segment -> its cached (k, v), each (1, Hkv, len, D)); returns (1, L, H, D).
    ``window`` in tokens (a transformers sliding window) or None; ``chunk`` in positions or None."""
    if layout.blocks:
        raise ValueError(
            f"bidirectional blocks {layout.blocks} with attention-score soft-capping: no model combines the two, and "
            "the FlexAttention path does not define their combination."
        )
    if layout.cached_reads:
        kv = [read_kv(a) for a in layout.cached_reads]
        key = torch.cat([key] + [k for k, _ in kv], dim=2)
        value = torch.cat([value] + [v for _, v in kv], dim=2)
    mask = block_mask(layout, window, chunk, query.device)
    gqa = query.shape[1] != key.shape[1]
    out = _flex()(query, key, value, score_mod=_score_mod(float(softcap)), block_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)
