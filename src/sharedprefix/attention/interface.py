"""The shared-prefix attention function, hooked into transformers' attention interface.

sharedprefix registers one attention function, ``"sharedprefix"``, with
``transformers.AttentionInterface``; ``attention.switch.activated(model)`` switches a model to it for the duration of
a call. The function checks each call (``attention.checks``), records the K/V of the segments later passes read, and
attends over the row's cascade. It reads the layout of the current pass from a
process-global stack (not a thread-local: autograd may run the recomputation of a
checkpointed layer on another thread).

Models with indexed layers (DeepSeek sparse attention, ``attention.indexed``) are switched to a second name,
``"sharedprefix_indexed"``: the same attention function, plus a mask builder registered with
``transformers.masking_utils.AttentionMaskInterface`` that answers with the row's visibility mask, which their
indexers need. No other model gets a mask: for them the attention function refuses any mask.

Shapes as transformers passes them: query (1, H, L, D), key/value (1, Hkv, L, D), where L is
the packed row; the function returns (1, L, H, D).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from sharedprefix.attention import checks, compiled, indexed
from sharedprefix.attention.cascade import cascade_attention
from sharedprefix.attention.kernels import flex
from sharedprefix.attention.layers import layer_pattern
from sharedprefix.attention.state import PassState, PrefixStore, current_pass, pass_state

NAME = "sharedprefix"
__all__ = ["NAME", "PassState", "PrefixStore", "current_pass", "indexed_mask", "pass_state", "shared_prefix_attention"]


def shared_prefix_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, softcap=None, **kwargs
):
    """transformers' attention function under ``NAME``: refuse what it cannot reproduce (``checks.checked``), record the
    row's K/V of the segments later passes read (``_record``), attend over the cascade (``_attend``). Inside a
    compiled layer: the same checks on what the layer passes, then one operator (``attention.compiled``)."""
    if torch.compiler.is_compiling():
        return _compiled(
            module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, kwargs
        ), None
    state = current_pass()
    if state is None:
        raise RuntimeError(
            "the 'sharedprefix' attention ran outside a sharedprefix call; it needs a packed-row layout. "
            "Call sharedprefix.logprobs / sharedprefix.backward instead of the model directly; with gradient "
            "checkpointing, leave sharedprefix.logprobs(defer=None) so that the recomputation runs inside it."
        )
    args = (query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, kwargs)
    call = checks.checked(module, state, *args)
    slot = _record(module, state, call)
    out = _attend(state, call, slot)
    return (state.sequence.from_heads(out) if state.sequence is not None and call.indices is None else out), None


def _compiled(module, query, key, value, attention_mask, dropout, scaling, window, softcap, kwargs) -> torch.Tensor:
    """The attention of a compiled decoder layer (``attention.compiled``): the checks of ``checks.checked`` that depend
    on what the layer passes, traced; those that depend on the pass run inside the operator. The executor runs a pass
    through compiled layers only where nothing else applies (``compiled.refusal``)."""
    name = type(module).__name__
    checks.check_dropout(name, dropout)
    sinks = kwargs.pop("s_aux", None)
    checks.check_kwargs(name, kwargs)
    if attention_mask is not None:
        checks.refuse(
            f"{name} received a ready-made attention mask inside a compiled layer; sharedprefix builds the "
            "shared-prefix attention itself and cannot combine it with the model's own mask."
        )
    amp, query, key, value = checks.autocast_cast(query, key, value)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = None if window is None else int(window)
    return compiled.traced_attention(
        module, query, key, value, float(scale), None if softcap is None else float(softcap), window, sinks, amp
    )


def _record(module, state: PassState, call: checks.AttentionCall):
    """Write the K/V of the segments this pass records to the prefix cache, once per call of the module in a forward
    (a layer recomputed by gradient checkpointing runs again and repeats the order); returns the cache slot."""
    # A module that runs its attention several times per forward (looped layers, differential attention) caches
    # one prompt K/V per call, in call order.
    calls, layout = layer_pattern(module).calls, state.layout
    idx = state.seen.get(module, 0)
    state.seen[module] = idx + 1
    slot = module if calls == 1 else (module, idx % calls)
    if idx < calls and layout.record:
        assert state.store is not None, "a pass that records segments has a cache to write to"
        for s in layout.record:
            r0, r1 = layout.row_start[s], layout.row_end[s]
            state.store.write_kv(slot, s, call.key[:, :, r0:r1], call.value[:, :, r0:r1])
    return slot


def _attend(state: PassState, call: checks.AttentionCall, slot) -> torch.Tensor:
    """(1, L, H, Dv): the row's attention over its own keys and its cached ancestors' (read from ``slot``)."""
    layout, query, key, value = state.layout, call.query, call.key, call.value
    read_kv = state.store.read_kv if state.store is not None else None
    if call.indices is not None:  # over the cached segments' keys, then the row's (as the indexer numbers them)
        if layout.cached_reads:
            assert read_kv is not None, "a pass that reads cached segments has a cache to read from"
            kv = [read_kv(slot, a) for a in layout.cached_reads]
            key = torch.cat([k for k, _ in kv] + [key], dim=2)
            value = torch.cat([v for _, v in kv] + [value], dim=2)
        return indexed.sparse_attention(query, key, value, state.visible, call.indices, call.scale, call.sinks)
    read = (lambda seg: read_kv(slot, seg)) if read_kv is not None else None
    with torch.autocast(call.amp, enabled=False) if call.amp is not None else nullcontext():  # merges stay float32
        if call.use_flex:
            assert call.softcap is not None, "FlexAttention stands in for a primitive without soft-capping only"
            return flex.flex_row_attention(
                layout, query, key, value, read, call.scale, call.softcap, call.window, call.chunk
            )
        cascade = layout.cascade(call.window, call.chunk)
        return cascade_attention(call.impl, cascade, query, key, value, read, call.scale, call.sinks, call.softcap)


def indexed_mask(*args, **kwargs):
    """transformers' mask builder under ``indexed.NAME``: the row's (1, 1, L, C + L) visibility mask, one tensor per
    pass for every layer (the indexers read it; dense layers ignore it, see ``attention.indexed``)."""
    state = current_pass()
    if state is None:
        return None  # outside a pass the attention function refuses anyway, with its own message
    if state.visible is None:
        state.visible = indexed.visible_mask(state.layout, kwargs.get("device"))
    return state.visible


AttentionInterface.register(NAME, shared_prefix_attention)
AttentionInterface.register(indexed.NAME, shared_prefix_attention)
AttentionMaskInterface.register(indexed.NAME, indexed_mask)
