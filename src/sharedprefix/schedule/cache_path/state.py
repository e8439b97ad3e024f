"""The layer state a hybrid model's prompt leaves in its cache (``cache_path.run``): read it, repeat it once per
completion row, and write updates into fresh tensors so that a state saved for backward is never overwritten.

Notation: n = rows of one batch, P = prompt length.
"""

from __future__ import annotations

import copy

import torch


def cache_arg_name(dec) -> str:
    import inspect

    params = inspect.signature(dec.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def new_cache(model):
    """An empty cache of the class the model's own forward would create: the cache class its modeling module
    defines where it has one (MiniMax's ``MiniMaxCache``), else ``DynamicCache(config=...)``."""
    import sys

    from transformers import DynamicCache
    from transformers.cache_utils import Cache

    mod = sys.modules[type(model).__module__]
    own = [
        v for v in vars(mod).values() if isinstance(v, type) and issubclass(v, Cache) and v.__module__ == mod.__name__
    ]
    if len(own) == 1:  # its tensors are checked by state_slots like any other cache's
        return own[0]()
    return _write_fresh(DynamicCache(config=model.config))


def _write_fresh(cache):
    """Make the cache's conv and recurrent state updates write into new memory.

    transformers' linear-attention cache layers copy each new state into the old state's tensor in place,
    after the layer's forward may have saved that tensor for its backward (the gated delta rule multiplies by
    its initial state): autograd would then refuse the backward. Each update here first replaces the stored
    tensor by a copy, so the tensor a forward read stays as it was; the values are the same.
    """
    for layer in cache.layers:
        if isinstance(layer, _cache_type("LinearAttentionCacheLayerMixin")):
            for name in ("conv_states", "recurrent_states"):
                method = f"update_{name[:-1]}"
                setattr(layer, method, _fresh_update(layer, name, getattr(type(layer), method)))
    return cache


def _fresh_update(layer, name: str, update):
    def fresh(states, state_idx: int = 0, **kwargs):
        stored = getattr(layer, name)
        if stored.get(state_idx) is not None:
            stored[state_idx] = stored[state_idx].clone()
        return update(layer, states, state_idx, **kwargs)

    return fresh


# -- the cache's tensors, read out and written back ---------------------------------------------------------------

LINEAR_CACHE = "linear_cache"  # MiniMaxCache: a list with each lightning-attention layer's (K^T V) state, on the cache
# a layer's count of the tokens it has seen (transformers 5.25's linear-attention layers): one number for every row,
# which the layer increments in place, so each copy of the cache gets a copy of it, not a repeat
COUNTERS = ("cumulative_length_linear",)


def _cache_type(name: str) -> type | tuple:
    """``transformers.cache_utils.<name>``, or ``()`` (which no layer is an instance of) on a release without it:
    ``DummyLayer`` (a layer that keeps no state) is new in 5.25, ``LinearAttentionCacheLayerMixin`` after 5.4."""
    from transformers import cache_utils

    return getattr(cache_utils, name, ())


def state_slots(cache) -> list[tuple[int, str, int | None]]:
    """Every tensor a filled cache holds: (layer, attribute, state index or None)."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    linear, dummy = _cache_type("LinearAttentionCacheLayerMixin"), _cache_type("DummyLayer")

    out: list[tuple[int, str, int | None]] = []
    for i, layer in enumerate(cache.layers):
        known = set()
        if isinstance(layer, dummy):
            continue
        length = getattr(type(layer), "get_seq_length", None)
        full = isinstance(layer, DynamicLayer) and length in _delegating(DynamicLayer)
        sliding = length in _delegating(DynamicSlidingWindowLayer)  # last window - 1
        if full or sliding:
            if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
                out += [(i, "keys", None), (i, "values", None)]
            known |= {"keys", "values"} | ({"_sliding_window_tensor"} if sliding else set())
        if isinstance(layer, linear):
            for name in ("conv_states", "recurrent_states"):
                for s, t in getattr(layer, name).items():
                    if t is not None:
                        out.append((i, name, s))
                known.add(name)
            known |= {c for c in COUNTERS if _is_count(getattr(layer, c, None))}
        if not known:
            raise ValueError(
                f"the cache layer {i} is a {type(layer).__name__}, which sharedprefix's hybrid path does not know how "
                "to copy per completion (it handles full-attention K/V and linear-attention conv/recurrent states), so "
                "it refuses the model rather than start a completion from a wrong state."
            )
        odd = [k for k, v in vars(layer).items() if isinstance(v, torch.Tensor) and k not in known]
        if odd:
            raise ValueError(
                f"the cache layer {i} ({type(layer).__name__}) holds tensors {odd} that sharedprefix's hybrid path "
                "does not copy per completion, so it refuses the model rather than start a completion from a wrong "
                "state."
            )
    out += [
        (i, LINEAR_CACHE, None) for i, t in enumerate(getattr(cache, LINEAR_CACHE, ())) if isinstance(t, torch.Tensor)
    ]
    odd = [k for k, v in vars(cache).items() if k not in ("layers", LINEAR_CACHE) and _holds_tensors(v)]
    if odd:
        raise ValueError(
            f"the cache ({type(cache).__name__}) holds tensors in {odd} that sharedprefix's hybrid path does not copy "
            "per completion, so it refuses the model rather than start a completion from a wrong state."
        )
    return out


def _delegating(base) -> set:
    """``base.get_seq_length`` and the hybrid layers' that call it (transformers 5.25 spells it out on its linear +
    full / sliding attention layers, so that their linear part's token count does not answer)."""
    from transformers import cache_utils

    hybrid = {cache_utils.DynamicLayer: "LinearAttentionAndFullAttentionLayer"}
    hybrid[cache_utils.DynamicSlidingWindowLayer] = "LinearAttentionAndSlidingWindowAttentionLayer"
    cls = getattr(cache_utils, hybrid[base], None)
    return {base.get_seq_length} | (
        {cls.get_seq_length} if cls is not None and "get_seq_length" in vars(cls) else set()
    )


def check_counts(cache, length: int, name: str) -> None:
    """Refuse a cache whose token counts (``COUNTERS``) are not the prompt's ``length`` after the prompt's forward:
    each completion starts from a copy of them, so they must say where the completion's tokens begin."""
    for i, layer in enumerate(cache.layers):
        for c in COUNTERS:
            count = vars(layer).get(c)
            if _is_count(count) and int(count) != length:
                raise ValueError(
                    f"{name}: cache layer {i} ({type(layer).__name__}) counts {int(count)} tokens in its {c} after a "
                    f"prompt of {length}; sharedprefix's hybrid path starts each completion from the prompt's state "
                    "and needs that count to be the prompt's length, so it refuses the model."
                )


def check_filled(name: str, cache, slots, length: int) -> None:
    """After a prompt of ``length`` tokens: every layer that mixes tokens left its state in the cache (none did
    silently without one), its token counts are the prompt's, and its K/V hold every prompt key (not compressed)."""
    have, dummy = {i for i, _, _ in slots}, _cache_type("DummyLayer")
    layers = cache.layers + [None] * (len(cache) - len(cache.layers))  # MiniMax: linear layers not in .layers
    missing = [i for i, layer in enumerate(layers) if i not in have and not isinstance(layer, dummy)]
    if missing:
        raise ValueError(
            f"{name}: after the prompt's forward, cache layers {missing} hold no state, so its "
            "completions would start from nothing instead of the prompt's state. This model's cache use is not "
            "supported by sharedprefix's hybrid path."
        )
    check_counts(cache, length, name)
    for (i, attr, _), t in zip(slots, read_states(cache, slots)):
        if attr != "keys":
            continue
        window = cache.layers[i].sliding_window if getattr(cache.layers[i], "is_sliding", False) else None
        need = length if window is None else min(length, window - 1)  # a sliding layer keeps the last window - 1
        if t.shape[-2] != need:
            raise ValueError(
                f"{name}: cache layer {i} holds K/V of {t.shape[-2]} tokens after a prompt of "
                f"{length}, where {need} were expected (a compressed cache); sharedprefix's hybrid path needs every "
                "prompt key a completion can see."
            )


def _is_count(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point()


def _holds_tensors(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        value = list(value.values())
    return isinstance(value, (list, tuple)) and any(_holds_tensors(v) for v in value)


def read_states(cache, slots) -> list[torch.Tensor]:
    out = []
    for i, name, s in slots:
        if name == LINEAR_CACHE:
            out.append(getattr(cache, name)[i])
            continue
        v = getattr(cache.layers[i], name)
        out.append(v if s is None else v[s])
    return out


def repeated_states(cache, slots, tensors, n: int):
    """A copy of ``cache`` whose tensors are ``tensors`` repeated ``n`` times along the batch (new memory: the
    model updates conv and recurrent states in place; gradients flow back to ``tensors`` through the repeat)."""
    new = copy.copy(cache)
    new.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in new.layers:  # per-state dicts (states, flags) and token counts of its own
        for name, value in list(vars(layer).items()):
            if isinstance(value, dict):
                setattr(layer, name, dict(value))
            elif name in COUNTERS and _is_count(value):
                setattr(layer, name, value.clone())
    if hasattr(cache, LINEAR_CACHE):
        setattr(new, LINEAR_CACHE, list(getattr(cache, LINEAR_CACHE)))
    _write_fresh(new)
    for (i, name, s), t in zip(slots, tensors):
        r = t.repeat(n, *([1] * (t.dim() - 1)))
        if name == LINEAR_CACHE:
            getattr(new, name)[i] = r
        elif s is None:
            setattr(new.layers[i], name, r)
        else:
            getattr(new.layers[i], name)[s] = r
    return new


def prompt_chunks(length: int, max_tokens: int | None) -> list[tuple[int, int]]:
    """[start, end) chunks of a prompt of ``length`` tokens, each at most ``max_tokens`` (>= 3) long and none
    after the first of 1 token (a 1-token continuation would take the in-place decode kernels)."""
    if max_tokens is None or length <= max_tokens:
        return [(0, length)]
    ends = list(range(max_tokens, length, max_tokens)) + [length]
    if length - ends[-2] == 1:
        ends[-2] -= 1
    return list(zip([0] + ends[:-1], ends))
