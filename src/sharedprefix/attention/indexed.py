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
answered with ``visible_mask``: one (1, 1, L, C + L) bool tensor per pass, handed to every layer (the indexer reads
it; a dense layer of the same model ignores it and runs the cascade). That is a row x row tensor, which the
rest of sharedprefix never builds; the model's own indexer already builds (L, index heads, L) float32 scores
per layer, so this mask costs less than what the model itself computes.

A pass that reads cached prompts (a budget that splits a group, or a long prompt computed in chunks): the keys of
a pass are the cached segments' tokens (``layout.cached_reads``, in that order, C tokens in all) followed by the
row's. The indexer gets them through its own cache protocol: for the duration of a sharedprefix call,
``key_hooks`` hands each indexer module (``module.indexer`` of an attention module) a stand-in for its cache
argument, ``IndexerKeys``, whose ``update_indexer`` records the row's indexer keys of the segments the pass
caches and returns the cached segments' indexer keys followed by the row's. Indexer keys carry no gradient (the
indexer runs without autograd, in the plain run too), so they are kept detached beside the prompt K/V
(``PrefixCache.write_index``). Its top-k indices then index the same C + L keys the attention gets: the cached
K/V of those segments followed by the row's.

``sparse_attention`` then computes softmax(q k^T * scale) v over the keys that are visible AND selected, with
one SDPA call on the (L, C + L) mask, and autograd for the backward (the cached K/V's gradients reach the prompt's
pass as every cached K/V's do). Cost: the dense (L, C + L) score matrix per head (torch's math kernel; a masked
memory-efficient kernel on CUDA), not topk keys per query: a first, exact version, not a sparse kernel. It runs
on torch's SDPA whatever ``backend`` the call names (never run on a GPU here).

With attention sinks (HY-V4: one more logit per head, its value dropped) the softmax is written out
explicitly, with the sink logit as one more column.

Not supported (refused): an indexed layer with a sliding window, chunks or soft-capping; a budget that splits a
group for a model whose indexers sharedprefix cannot reach (no ``indexer`` module with a cache argument); an
indexed layer that hands attention a mask of its own instead of ``indices`` (``overlay_refusal``: Kolibri 1.1's
indexer lays its selection over the mask, counting sink and local keys along the row, which a packed row shifts).

Exactness caveat: the plain run itself is only defined up to ties. Keys with exactly equal index scores at
the top-k boundary (e.g. several keys whose every head score is clipped to 0 by the ReLU) are broken by
``torch.topk`` in an unspecified order, which depends on the row's length and layout; and the indexer computes
its scores in float32 even in a float64 model, so two keys within float32 rounding of each other can swap.
A swap changes which keys attend, in sharedprefix as in a plain run padded differently.

Notation: L = packed row length, C = cached tokens a pass reads, S = segments of the row, H = query heads,
Hkv = key/value heads, D = query/key head dim, Dv = value head dim, topk = keys the indexer selects per query.
"""

from __future__ import annotations

import inspect

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
    """The refusal of a plan that caches a prefix across passes, for an indexed model whose indexers ``key_hooks``
    cannot reach."""
    return (
        f"{name} selects the keys of each query with an indexer (DeepSeek sparse attention, layers of type "
        f"{LAYER_TYPE!r}) that scores every key the query sees, and sharedprefix finds no indexer module it can hand "
        "a cached prompt's indexer keys to (an attention module's `indexer` whose forward takes a `cache` or "
        "`past_key_values` argument), so it cannot split a group (or a long prompt) across passes for this model. "
        "Use max_tokens=None, or a budget that fits every group and every prompt in one pass."
    )


def overlay_refusal(name: str, mask: torch.Tensor) -> str:
    """The refusal of an indexed layer that hands attention a mask of its own instead of the visibility mask
    sharedprefix gave it (and the indexer's ``indices``)."""
    return (
        f"{name} attends with a mask of shape {tuple(mask.shape)} other than the visibility mask sharedprefix gave "
        "its layer (an indexer that overlays its own selection on the attention mask, as Kolibri 1.1's does), "
        "where sharedprefix expects that mask itself and the indexer's `indices`. Such an indexer counts "
        "its sink, local and pooled keys along the row's positions, and on a packed row the tokens of other "
        "completions lie between a completion's prompt and its own tokens, so its selection would not be the plain "
        "run's. This model is not supported."
    )


def indexers(model: torch.nn.Module) -> dict[torch.nn.Module, tuple[str, int]]:
    """The indexer modules of ``model`` (``module.indexer`` of any module) that take a cache argument -> (that
    argument's name, its positional index)."""
    out: dict[torch.nn.Module, tuple[str, int]] = {}
    for m in model.modules():
        ix = getattr(m, "indexer", None)
        if isinstance(ix, torch.nn.Module) and ix not in out:
            params = list(inspect.signature(ix.forward).parameters)
            name = next((n for n in ("cache", "past_key_values") if n in params), None)
            if name is not None:
                out[ix] = (name, params.index(name))
    return out


class IndexerKeys:
    """What an indexer gets as its cache inside a sharedprefix pass (see the module docstring).

    ``update_indexer(keys, layer_idx)``, keys (1, L, D) of the row: records the keys of the segments the pass caches
    (``layout.record``) and returns (1, C + L, D): the cached segments' keys (``layout.cached_reads`` order), then
    the row's. Any other use of the cache is refused: sharedprefix gives the indexer nothing else.
    """

    def __init__(self, indexer: torch.nn.Module, state):
        self._indexer, self._state = indexer, state

    def update_indexer(self, keys: torch.Tensor, layer_idx=None) -> torch.Tensor:
        layout, state = self._state.layout, self._state
        if keys.dim() != 3 or keys.shape[:2] != (1, layout.length):
            raise RuntimeError(
                f"{type(self._indexer).__name__} gave indexer keys of shape {tuple(keys.shape)}; sharedprefix expects "
                f"(1, {layout.length}, D) for the packed row. This model is not supported."
            )
        for s in layout.record:
            state.store.write_index(self._indexer, s, keys[:, layout.row_start[s] : layout.row_end[s]])
        if not layout.cached_reads:
            return keys
        cached = [state.store.read_index(self._indexer, a).to(keys.dtype) for a in layout.cached_reads]
        return torch.cat(cached + [keys], dim=1)

    def __getattr__(self, name):
        raise ValueError(
            f"{type(self._indexer).__name__} used {name!r} of its cache; inside a sharedprefix pass an indexer's cache "
            "only answers update_indexer (the cached prompts' indexer keys), so this model is not supported."
        )


def key_hooks(model: torch.nn.Module, current) -> list:
    """Forward pre-hooks that hand every indexer of ``model`` an ``IndexerKeys`` of the pass ``current()`` returns
    (nothing outside a pass); the caller removes the returned handles."""
    handles = []
    for ix, (name, pos) in indexers(model).items():

        def hook(module, args, kwargs, name=name, pos=pos):
            state = current()
            if state is None:
                return None
            given = args[pos] if pos < len(args) else kwargs.get(name)
            if isinstance(given, IndexerKeys):  # a nested sharedprefix call's hook ran first: the same pass
                return None
            if given is not None:
                raise ValueError(
                    f"{type(module).__name__} got a cache ({type(given).__name__}) inside a sharedprefix pass; "
                    "sharedprefix runs the model without one. Do not pass a cache to the model."
                )
            keys = IndexerKeys(module, state)
            if pos < len(args):
                return args[:pos] + (keys,) + args[pos + 1 :], kwargs
            return args, {**kwargs, name: keys}

        handles.append(ix.register_forward_pre_hook(hook, with_kwargs=True))
    return handles


def visible_mask(layout: RowLayout, device) -> torch.Tensor:
    """(1, 1, L, C + L) bool: True where row token i may attend to key j, the keys being the C tokens of the cached
    segments (``layout.cached_reads`` order) followed by the row's: key j is in an ancestor segment of i's, or in
    i's own segment at or before i."""
    tree, cached = layout.tree, list(layout.cached_reads)
    cols = cached + list(layout.segments)  # the segments of the keys, in key order
    local = {s: i for i, s in enumerate(cols)}
    n_row = len(layout.segments)
    sees = torch.zeros(n_row, len(cols), dtype=torch.bool)  # (S, S + cached): sees[a, b] when b is a or an ancestor
    for i, s in enumerate(layout.segments):
        sees[i, local[s]] = True
        for a in tree.ancestors(s):
            sees[i, local[a]] = True
    n_cached = sum(tree.segments[a].length for a in cached)
    lengths = torch.tensor([layout.row_end[s] - layout.row_start[s] for s in layout.segments])
    q_seg = torch.repeat_interleave(torch.arange(n_row), lengths).to(device)  # (L,) local row segment of each query
    k_len = torch.tensor([tree.segments[a].length for a in cached] + lengths.tolist(), dtype=torch.long)
    k_seg = torch.repeat_interleave(torch.arange(len(cols)), k_len).to(device)  # (C + L,) key segment
    sees = sees.to(device)
    q_at = torch.arange(layout.length, device=device) + n_cached  # each query's own key index
    k_at = torch.arange(n_cached + layout.length, device=device)
    same = (q_seg + len(cached))[:, None] == k_seg[None, :]
    ok = sees[q_seg[:, None], k_seg[None, :]] & (~same | (k_at[None, :] <= q_at[:, None]))
    return ok[None, None]


def sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each query over its visible keys that the indexer selected.

    Args:
        query: (1, H, L, D); key: (1, Hkv, T, D); value: (1, Hkv, T, Dv), H a multiple of Hkv; T = C + L keys (the
            cached segments' then the row's).
        visible: (1, 1, L, T) bool, ``visible_mask`` of the row.
        indices: (1, L, topk) integer indices into the T keys of the keys selected for each query (may include
            invisible keys).
        scale: the softmax scale (the module's ``scaling``).
        sinks: (H,) attention-sink logits (one more logit per head in the softmax, whose value is dropped: HY-V4),
            or None.

    Returns:
        (1, L, H, Dv), in the query's dtype.
    """
    L, T = query.shape[2], key.shape[2]
    idx = indices.to(device=query.device, dtype=torch.long)
    if idx.dim() != 3 or idx.shape[:2] != (1, L):
        raise RuntimeError(f"indexer indices of shape {tuple(indices.shape)}; expected (1, {L}, topk).")
    if tuple(visible.shape) != (1, 1, L, T):
        raise RuntimeError(f"a visibility mask of shape {tuple(visible.shape)} for {L} queries over {T} keys.")
    selected = torch.zeros(L, T, dtype=torch.bool, device=query.device).scatter_(1, idx[0], True)
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
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale  # (1, H, L, T)
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(1, scores.shape[1], L, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(value.dtype), value).transpose(1, 2)
