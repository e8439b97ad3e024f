"""The shared-prefix attention function, hooked into transformers' attention interface.

sharedprefix registers one attention function, ``"sharedprefix"``, with
``transformers.AttentionInterface`` and switches a model to it only inside
``activated(model)``; the model's own setting is restored on exit, also on error, and the
model's code is never edited. The function reads the layout of the current pass from a
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

from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedConfig
from transformers.masking_utils import AttentionMaskInterface

from sharedprefix.attention import compiled, dynamic_mask, indexed, kernels
from sharedprefix.attention.cascade import cascade_attention
from sharedprefix.attention.kernels import flex
from sharedprefix.attention.layers import (
    index_to_position_temperature,
    layer_chunk,
    layer_pattern,
    layer_window,
    softcap_refusal,
)
from sharedprefix.layout.packing import RowLayout

NAME = "sharedprefix"

# Keyword arguments transformers attention modules pass that do not change the attention result.
_NEUTRAL_KWARGS = {
    "position_ids",
    "cache_position",
    "use_cache",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "layer_idx",
    "is_causal",
    "sliding_window",
    "dropout",
    "scaling",
    "softcap",
}


@dataclass
class PassState:
    """What the attention function needs for one packed row.

    Attributes:
        layout: the row being computed.
        backend: implementation of the attention primitive (``attention.kernels.select``).
        read_kv: (module, segment id) -> (k, v), each (1, Hkv, len, D), for cached ancestors.
        write_kv: (module, segment id, k, v) -> None, called once per layer for ``layout.record``.
        seen: attention modules that ran in this pass (a layer recomputed by gradient
            checkpointing runs again; it must not record twice).
        visible: (1, 1, L, C + L) bool visibility mask of the row over the cached segments' and the row's keys,
            built on the first request of a model with indexed layers (``indexed_mask``), else None.
        read_index / write_index: like read_kv / write_kv, for an indexer's keys (1, len, D) (``indexed``).
        read_state / write_state: like read_kv / write_kv, for a token mixer's state outside attention (a conv tail,
            a recurrent state; ``model.mixers``), keyed by (mixer module, seam); ``mixed``: (module, seam) -> calls.
        sequence: under sequence parallelism, the row's split (``parallel.sequence.SequenceShard``): the attention
            receives this rank's tokens for all heads and exchanges them for the whole row of its heads.
        io: a pass through compiled decoder layers: its handle and its layers' cached keys (``attention.compiled``).
        force_eager: compiled decoder layers run eager in this pass, also when checkpointing recomputes them.

    """

    layout: RowLayout
    backend: str = "auto"
    read_kv: Callable | None = None
    write_kv: Callable | None = None
    seen: dict = field(default_factory=dict)
    visible: torch.Tensor | None = None
    read_index: Callable | None = None
    write_index: Callable | None = None
    read_state: Callable | None = None
    write_state: Callable | None = None
    mixed: dict = field(default_factory=dict)
    sequence: Any = None  # ``parallel.sequence.SequenceShard`` of a sequence-parallel pass, else None
    io: Any = None  # ``attention.compiled.PassIO`` of a pass through compiled layers, else None
    force_eager: bool = False  # compiled layers that this pass runs eager (``schedule.compiled``)


_STACK: list[PassState] = []


def current_pass() -> PassState | None:
    """The state of the innermost pass running (None outside sharedprefix's passes)."""
    return _STACK[-1] if _STACK else None


@contextmanager
def pass_state(state: PassState):
    """Make ``state`` the layout the attention function uses (also during backward)."""
    _STACK.append(state)
    compiled.CURRENT.io = state.io
    try:
        with torch.compiler.set_stance("force_eager") if state.force_eager else nullcontext():
            yield state
    finally:
        for i in range(len(_STACK) - 1, -1, -1):  # by identity: states compare tensors otherwise
            if _STACK[i] is state:
                del _STACK[i]
                break
        compiled.CURRENT.io = _STACK[-1].io if _STACK else None


def _refuse(msg: str):
    raise ValueError(msg)


@dataclass
class _Call:
    """One attention call as the shared-prefix attention computes it, after its checks: query (1, H, L, D) and
    key / value (1, Hkv, L, D) over the whole packed row (this rank's heads under sequence parallelism)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    scale: float
    window: int | None
    chunk: int | None
    softcap: float | None
    sinks: torch.Tensor | None
    indices: torch.Tensor | None
    impl: Any  # the attention primitive (``attention.kernels``)
    use_flex: bool  # soft-capping on a primitive without it: FlexAttention (``kernels.flex``)
    amp: str | None  # the autocast device type, or None


def shared_prefix_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, softcap=None, **kwargs
):
    """transformers' attention function under ``NAME``: refuse what it cannot reproduce (``_checked``), record the
    row's K/V of the segments later passes read (``_record``), attend over the cascade (``_attend``). Inside a
    compiled layer: the same checks on what the layer passes, then one operator (``attention.compiled``)."""
    if torch.compiler.is_compiling():
        return _compiled(
            module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, kwargs
        ), None
    if not _STACK:
        raise RuntimeError(
            "the 'sharedprefix' attention ran outside a sharedprefix call; it needs a packed-row layout. "
            "Call sharedprefix.logprobs / sharedprefix.backward instead of the model directly; with gradient "
            "checkpointing, leave sharedprefix.logprobs(defer=None) so that the recomputation runs inside it."
        )
    state = _STACK[-1]
    call = _checked(module, state, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, kwargs)
    slot = _record(module, state, call)
    out = _attend(state, call, slot)
    return (state.sequence.from_heads(out) if state.sequence is not None and call.indices is None else out), None


def _checked(
    module, state: PassState, query, key, value, attention_mask, dropout, scaling, window, softcap, kwargs
) -> _Call:
    """The call's inputs as the attention computes them (autocast's dtype, a dynamic mask folded in, the row's
    heads under sequence parallelism), or a refusal of what it cannot reproduce exactly."""
    layout = state.layout
    name = type(module).__name__
    window = layer_window(module, window)
    chunk = layer_chunk(module)
    _check_dropout(name, dropout)
    amp = autocast_device(query)
    if amp is not None:  # as autocast casts the plain run's scaled_dot_product_attention: float64 it leaves alone
        dt = torch.get_autocast_dtype(amp)
        query, key, value = (t if t.dtype == torch.float64 else t.to(dt) for t in (query, key, value))
    impl = kernels.select(state.backend, query.device, query.dtype)
    use_flex = False
    if softcap is not None:
        softcap = float(softcap)
        if not softcap > 0:
            _refuse(f"{name} passed softcap={softcap}; expected a positive attention-score soft-cap or None.")
        if not getattr(impl, "SOFTCAP", False):
            if (why := flex.unavailable(query)) is not None:
                _refuse(softcap_refusal(name, softcap, impl.name) + f" (FlexAttention is no way out here: {why}.)")
            use_flex = True
    indices = kwargs.pop("indices", None)
    sinks = kwargs.pop("s_aux", None)
    if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
        _refuse(
            f"{name} passed attention sinks (s_aux) of shape {tuple(sinks.shape)}; sharedprefix merges one sink "
            f"logit per query head, shape ({query.shape[1]},), and refuses other shapes."
        )
    _check_kwargs(name, kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if attention_mask is not None and dynamic_mask.has_dynamic_mask(module):
        query, key, value = dynamic_mask.fold_key_bias(module, query, key, value, attention_mask, scale)
        attention_mask = None
    if attention_mask is not None and state.visible is not None and attention_mask is not state.visible:
        _refuse(indexed.overlay_refusal(name, attention_mask))
    if attention_mask is not None and state.visible is None:
        _refuse(
            f"{name} received a ready-made attention mask of shape {tuple(attention_mask.shape)}; sharedprefix "
            "builds the shared-prefix mask itself and cannot combine it with the model's own mask. "
            "Do not pass attention_mask, and use a model whose masks go through transformers' masking utilities."
        )
    if state.sequence is not None:  # this rank's tokens for all heads -> the whole row for this rank's heads
        query, key, value, sinks = state.sequence.to_heads(name, query, key, value, sinks)
    if query.shape[0] != 1 or query.shape[2] != layout.length:
        raise RuntimeError(
            f"{name} got queries of shape {tuple(query.shape)}, expected (1, H, {layout.length}, D) for the packed "
            "row; the model reshaped the sequence, which sharedprefix does not support."
        )
    if query.shape[1] % key.shape[1]:
        raise RuntimeError(f"{name}: {query.shape[1]} query heads are not a multiple of {key.shape[1]} KV heads.")
    if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
        query = index_to_position_temperature(module, query, layout.position_ids)
    pat = layer_pattern(module)
    if indices is not None or pat.indexed:
        _check_indexed(module, indices, state, window, chunk, softcap, pat.calls)
    if use_flex and sinks is not None:
        _refuse(f"{name} combines attention sinks with soft-capping; the FlexAttention path takes no sinks.")
    return _Call(query, key, value, scale, window, chunk, softcap, sinks, indices, impl, use_flex, amp)


def _check_dropout(name: str, dropout) -> None:
    if dropout and dropout > 0:
        _refuse(
            f"{name} runs attention dropout p={dropout} in training mode; sharedprefix refuses it because a "
            "prompt shared by G completions would share one dropout draw, unlike the plain run. "
            "Set the model's attention_dropout to 0.0 (RL fine-tuning normally does) or call model.eval()."
        )


def _check_kwargs(name: str, kwargs: dict) -> None:
    odd = {k: v for k, v in kwargs.items() if k not in _NEUTRAL_KWARGS and v is not None}
    if kwargs.get("is_causal") is False:
        odd["is_causal"] = False
    if odd:
        _refuse(
            f"{name} passed attention arguments {sorted(odd)} that sharedprefix cannot honour exactly "
            "(e.g. position biases or a non-causal flag). This model is not supported."
        )


def _compiled(module, query, key, value, attention_mask, dropout, scaling, window, softcap, kwargs) -> torch.Tensor:
    """The attention of a compiled decoder layer (``attention.compiled``): the checks of ``_checked`` that depend on
    what the layer passes, traced; those that depend on the pass run inside the operator. The executor runs a pass
    through compiled layers only where nothing else applies (``compiled.refusal``)."""
    name = type(module).__name__
    _check_dropout(name, dropout)
    sinks = kwargs.pop("s_aux", None)
    _check_kwargs(name, kwargs)
    if attention_mask is not None:
        _refuse(
            f"{name} received a ready-made attention mask inside a compiled layer; sharedprefix builds the "
            "shared-prefix attention itself and cannot combine it with the model's own mask."
        )
    amp = autocast_device(query)
    if amp is not None:
        dt = torch.get_autocast_dtype(amp)
        query, key, value = (t if t.dtype == torch.float64 else t.to(dt) for t in (query, key, value))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = None if window is None else int(window)
    return compiled.traced_attention(
        module, query, key, value, float(scale), None if softcap is None else float(softcap), window, sinks, amp
    )


def _record(module, state: PassState, call: _Call):
    """Write the K/V of the segments this pass records to the prefix cache, once per call of the module in a forward
    (a layer recomputed by gradient checkpointing runs again and repeats the order); returns the cache slot."""
    # A module that runs its attention several times per forward (looped layers, differential attention) caches
    # one prompt K/V per call, in call order.
    calls, layout = layer_pattern(module).calls, state.layout
    idx = state.seen.get(module, 0)
    state.seen[module] = idx + 1
    slot = module if calls == 1 else (module, idx % calls)
    if idx < calls and layout.record:
        assert state.write_kv is not None, "a pass that records segments has a cache to write to"
        for s in layout.record:
            r0, r1 = layout.row_start[s], layout.row_end[s]
            state.write_kv(slot, s, call.key[:, :, r0:r1], call.value[:, :, r0:r1])
    return slot


def _attend(state: PassState, call: _Call, slot) -> torch.Tensor:
    """(1, L, H, Dv): the row's attention over its own keys and its cached ancestors' (read from ``slot``)."""
    layout, query, key, value = state.layout, call.query, call.key, call.value
    read_kv = state.read_kv
    if (
        call.indices is not None
    ):  # over the cached segments' keys, then the row's (the indexer's indices number them so)
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


def autocast_device(t: torch.Tensor) -> str | None:
    """The device type of ``t`` when autocast is on for it (mixed precision: TRL's and accelerate's ``bf16=True``
    over float32 weights), else None. Autocast runs the plain forward's ``scaled_dot_product_attention`` in its
    lower-precision dtype; the shared-prefix attention casts query, key and value the same way, and keeps its own
    log-sum-exp merges out of autocast (float32, as without it)."""
    kind = t.device.type
    return kind if torch.is_autocast_enabled(kind) else None


def _check_indexed(module, indices, state: PassState, window, chunk, softcap, calls) -> None:
    """Refuse what ``indexed.sparse_attention`` does not reproduce; the probe and this call must agree that the layer
    attends over indexer-selected keys."""
    name = type(module).__name__
    if indices is None or not layer_pattern(module).indexed:
        raise ValueError(
            f"{name} passed indexer indices to attention {'only now' if indices is not None else 'in the probe only'}; "
            "sharedprefix reads which layers attend over indexer-selected keys from the probe and refuses a layer "
            "that changes its mind. This model is not supported."
        )
    if state.visible is None:
        raise ValueError(
            f"{name} attends over indexer-selected keys (DeepSeek sparse attention) but its indexer got no visibility "
            "mask from sharedprefix (its mask does not come from transformers' masking utilities), so the "
            "selection cannot match the plain run. This model is not supported."
        )
    odd = [
        x
        for x, on in (
            ("a sliding window", window is not None),
            ("attention chunks", chunk is not None),
            ("attention-score soft-capping", softcap is not None),
            (f"{calls} attention calls per forward", calls > 1),
        )
        if on
    ]
    if odd:
        raise ValueError(
            f"{name} attends over indexer-selected keys (DeepSeek sparse attention) with {', '.join(odd)}; "
            "sharedprefix's sparse attention implements plain causal selection only and refuses the model."
        )


def indexed_mask(*args, **kwargs):
    """transformers' mask builder under ``indexed.NAME``: the row's (1, 1, L, C + L) visibility mask, one tensor per
    pass for every layer (the indexers read it; dense layers ignore it, see ``attention.indexed``)."""
    if not _STACK:
        return None  # outside a pass the attention function refuses anyway, with its own message
    state = _STACK[-1]
    if state.visible is None:
        state.visible = indexed.visible_mask(state.layout, kwargs.get("device"))
    return state.visible


AttentionInterface.register(NAME, shared_prefix_attention)
AttentionInterface.register(indexed.NAME, shared_prefix_attention)
AttentionMaskInterface.register(indexed.NAME, indexed_mask)


def _encoder_configs(model: torch.nn.Module) -> set[int]:
    """ids of the sub-configs of encoders (vision towers, audio encoders) next to the text model: their attention
    runs once per prompt inside a pass, with the model's own implementation, never the shared-prefix one."""
    top = getattr(model, "config", None)
    if not isinstance(top, PreTrainedConfig):
        return set()
    text = top.get_text_config()
    out = set()
    for key in getattr(top, "sub_configs", {}) or {}:
        sub = getattr(top, key, None)
        if isinstance(sub, PreTrainedConfig) and sub is not text and sub is not top:
            out.add(id(sub))
    return out


def model_configs(model: torch.nn.Module) -> list[PreTrainedConfig]:
    seen, out = _encoder_configs(model), []
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if isinstance(cfg, PreTrainedConfig) and id(cfg) not in seen:
            seen.add(id(cfg))
            out.append(cfg)
    # sub-configs (text/vision) reachable from the top config
    stack = list(out)
    while stack:
        cfg = stack.pop()
        for key in getattr(cfg, "sub_configs", {}) or {}:
            sub = getattr(cfg, key, None)
            if isinstance(sub, PreTrainedConfig) and id(sub) not in seen:
                seen.add(id(sub))
                out.append(sub)
                stack.append(sub)
    return out


def implementation(model: torch.nn.Module) -> str:
    """The attention implementation ``activated`` switches ``model`` to: ``indexed.NAME`` for a model with indexed
    layers (DeepSeek sparse attention), else ``NAME``."""
    return indexed.NAME if indexed.is_indexed(model_configs(model)) else NAME


@contextmanager
def activated(model: torch.nn.Module):
    """Switch every config of ``model`` to the sharedprefix attention (``indexed.NAME`` for a model with indexed
    layers, whose indexers also get ``indexed.key_hooks`` for the duration); restore them on exit."""
    configs = model_configs(model)
    name = implementation(model)
    saved = [cfg._attn_implementation_internal for cfg in configs]
    hooks = indexed.key_hooks(model, current_pass) if name == indexed.NAME else []
    try:
        for cfg in configs:
            cfg._attn_implementation_internal = name
        yield
    finally:
        for h in hooks:
            h.remove()
        for cfg, old in zip(configs, saved):
            cfg._attn_implementation_internal = old
