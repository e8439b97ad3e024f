"""DeepSeek sparse attention (DSA): attention over the keys an indexer selects per query, on a packed row.

Models with layers of type ``"indexed_attention"`` (DeepSeek-V3.2, GLM-MoE-DSA, HY-V4, AXK2, dots3) run a
lightning indexer inside each attention module: it scores every key for every query
(``sum_h w_h * relu(q_h . k)``, without grad), adds the layer's causal mask, and keeps the ``index_topk`` best
keys per query. With an attention implementation other than eager/SDPA the module passes those row indices
to the attention function as ``indices`` (1, L, topk), next to the unchanged mask.

On a packed row this is exact when the indexer sees, as its mask, what each token may see in the tree (its
ancestors' tokens and the earlier tokens of its own segment): the scores of the keys a token sees are the
plain row's scores (same hidden states, same positions), every other key scores -inf, so the selected keys
among the visible ones are the plain row's. Row indices differ from plain positions, but the selected *set*
is the same. When ``index_topk`` exceeds a query's visible keys, torch's top-k also returns invisible keys
(scored -inf); the attention keeps them masked, as the plain run's mask does.

So, for these models only (``activated`` switches them to ``INDEXED_NAME``), transformers' mask builder is
answered with ``visible_mask``: one (1, 1, L, L) bool tensor per pass, handed to every layer (the indexer reads
it; a dense layer of the same model ignores it and runs the cascade). That is a row x row tensor, which the
rest of sharedprefix never builds; the model's own indexer already builds (L, index heads, L) float32 scores
per layer, so this mask costs less than what the model itself computes.

``sparse_attention`` then computes softmax(q k^T * scale) v over the keys that are visible AND selected, with
one SDPA call on the (L, L) mask, and autograd for the backward. Cost: the dense (L, L) score matrix per head
(torch's math kernel; a masked memory-efficient kernel on CUDA), not topk keys per query: a first, exact
version, not a sparse kernel. It runs on torch's SDPA whatever ``backend`` the call names (never run on a GPU
here).

With attention sinks (HY-V4: one more logit per head, its value dropped) the softmax is written out
explicitly, with the sink logit as one more column.

Not supported (refused): a budget that splits a group across passes (the indexer of a completion would need
the cached prompt's indexer keys, which sharedprefix does not keep), an indexed layer with a sliding window,
chunks or soft-capping.

Exactness caveat: the plain run itself is only defined up to ties. Keys with exactly equal index scores at
the top-k boundary (e.g. several keys whose every head score is clipped to 0 by the ReLU) are broken by
``torch.topk`` in an unspecified order, which depends on the row's length and layout; and the indexer computes
its scores in float32 even in a float64 model, so two keys within float32 rounding of each other can swap.
A swap changes which keys attend, in sharedprefix as in a plain run padded differently.

Notation: L = packed row length, S = segments of the row, H = query heads, Hkv = key/value heads,
D = query/key head dim, Dv = value head dim, topk = keys the indexer selects per query.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sharedprefix.layout.packing import RowLayout

NAME = "sharedprefix_indexed"  # the attention (and mask) implementation of models with indexed layers
LAYER_TYPE = "indexed_attention"


def is_indexed(configs) -> bool:
    """True when any of ``configs`` declares layers of type ``"indexed_attention"``."""
    for cfg in configs:
        types = vars(cfg).get("layer_types") or ()  # the instance's own (per-layer configs refuse getattr)
        if any(str(t) == LAYER_TYPE for t in types):
            return True
    return False


def split_refusal(name: str) -> str:
    """The refusal of a plan that caches a prefix across passes, for a model with an indexer."""
    return (
        f"{name} selects the keys of each query with an indexer (DeepSeek sparse attention, layers of type "
        f"{LAYER_TYPE!r}) that scores every key the query sees; sharedprefix does not keep the indexer's keys of a "
        "cached prompt, so it cannot split a group (or a long prompt) across passes for this model. Use "
        "max_tokens=None, or a budget that fits every group and every prompt in one pass."
    )


def visible_mask(layout: RowLayout, device) -> torch.Tensor:
    """(1, 1, L, L) bool: True where row token i may attend to row token j (j is in an ancestor segment of i's, or
    in i's own segment at or before i). Every ancestor must be in the row (no cached prefix)."""
    if layout.cached_reads or layout.record:
        raise ValueError(split_refusal("this model"))
    n_seg = len(layout.segments)
    local = {s: i for i, s in enumerate(layout.segments)}
    sees = torch.eye(n_seg, dtype=torch.bool)  # (S, S): sees[a, b] when b is a or an ancestor of a
    for s in layout.segments:
        for a in layout.tree.ancestors(s):
            sees[local[s], local[a]] = True
    lengths = torch.tensor([layout.row_end[s] - layout.row_start[s] for s in layout.segments])
    seg = torch.repeat_interleave(torch.arange(n_seg), lengths).to(device)  # (L,) local segment of each row token
    sees = sees.to(device)
    idx = torch.arange(layout.length, device=device)
    same = seg[:, None] == seg[None, :]
    ok = sees[seg[:, None], seg[None, :]] & (~same | (idx[None, :] <= idx[:, None]))
    return ok[None, None]


def sparse_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor, indices: torch.Tensor,
    scale: float, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each query over its visible keys that the indexer selected.

    Args:
        query: (1, H, L, D); key: (1, Hkv, L, D); value: (1, Hkv, L, Dv), H a multiple of Hkv.
        visible: (1, 1, L, L) bool, ``visible_mask`` of the row.
        indices: (1, L, topk) integer row indices of the keys selected for each query (may include invisible keys).
        scale: the softmax scale (the module's ``scaling``).
        sinks: (H,) attention-sink logits (one more logit per head in the softmax, whose value is dropped: HY-V4),
            or None.

    Returns:
        (1, L, H, Dv), in the query's dtype.
    """
    L = query.shape[2]
    idx = indices.to(device=query.device, dtype=torch.long)
    if idx.dim() != 3 or idx.shape[:2] != (1, L):
        raise RuntimeError(f"indexer indices of shape {tuple(indices.shape)}; expected (1, {L}, topk).")
    selected = torch.zeros(L, L, dtype=torch.bool, device=query.device).scatter_(1, idx[0], True)
    # every query keeps at least one key: with topk keys selected, its best visible ones, itself included when it
    # sees fewer than topk (visible keys score above the -inf of the others)
    allowed = visible & selected
    rep = query.shape[1] // key.shape[1]
    if rep > 1:
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    if sinks is None:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scale)
        return out.transpose(1, 2)
    # explicit softmax with one sink logit per head (exact; autograd gives the sinks' own gradient)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale  # (1, H, L, L)
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(1, scores.shape[1], L, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(value.dtype), value).transpose(1, 2)
