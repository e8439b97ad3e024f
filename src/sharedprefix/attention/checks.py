"""The checks of one call of the shared-prefix attention (``attention.interface``): every argument, mask and shape
it cannot reproduce exactly is refused, naming the module and the reason, and what it computes with is returned as
an ``AttentionCall`` (autocast's dtype applied, a dynamic mask folded into the keys, the row's heads under sequence
parallelism).

Shapes as transformers passes them: query (1, H, L, D), key/value (1, Hkv, L, D), L the packed row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sharedprefix.attention import dynamic_mask, indexed, kernels
from sharedprefix.attention.layers import (
    index_to_position_temperature,
    layer_chunk,
    layer_pattern,
    layer_window,
    softcap_refusal_on,
)

if TYPE_CHECKING:
    from sharedprefix.attention.state import PassState

# Keyword arguments transformers attention modules pass that do not change the attention result.
NEUTRAL_KWARGS = {
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


def refuse(msg: str):
    raise ValueError(msg)


@dataclass
class AttentionCall:
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


def checked(
    module, state: PassState, query, key, value, attention_mask, dropout, scaling, window, softcap, kwargs
) -> AttentionCall:
    """The call's inputs as the attention computes them (autocast's dtype, a dynamic mask folded in, the row's
    heads under sequence parallelism), or a refusal of what it cannot reproduce exactly."""
    layout = state.layout
    name = type(module).__name__
    window = layer_window(module, window)
    chunk = layer_chunk(module)
    check_dropout(name, dropout)
    amp, query, key, value = autocast_cast(query, key, value)
    impl = kernels.select(state.backend, query.device, query.dtype)
    use_flex = False
    if softcap is not None:
        softcap = float(softcap)
        if not softcap > 0:
            refuse(f"{name} passed softcap={softcap}; expected a positive attention-score soft-cap or None.")
        if (why := softcap_refusal_on(name, softcap, impl, query.device)) is not None:
            refuse(why)
        use_flex = not getattr(impl, "SOFTCAP", False)
    indices = kwargs.pop("indices", None)
    sinks = kwargs.pop("s_aux", None)
    if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
        refuse(
            f"{name} passed attention sinks (s_aux) of shape {tuple(sinks.shape)}; sharedprefix merges one sink "
            f"logit per query head, shape ({query.shape[1]},), and refuses other shapes."
        )
    check_kwargs(name, kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if attention_mask is not None and dynamic_mask.has_dynamic_mask(module):
        query, key, value = dynamic_mask.fold_key_bias(module, query, key, value, attention_mask, scale)
        attention_mask = None
    if attention_mask is not None and state.visible is not None and attention_mask is not state.visible:
        refuse(indexed.overlay_refusal(name, attention_mask))
    if attention_mask is not None and state.visible is None:
        refuse(
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
        check_indexed(module, indices, state, window, chunk, softcap, pat.calls)
    if use_flex and sinks is not None:
        refuse(f"{name} combines attention sinks with soft-capping; the FlexAttention path takes no sinks.")
    return AttentionCall(query, key, value, scale, window, chunk, softcap, sinks, indices, impl, use_flex, amp)


def check_dropout(name: str, dropout) -> None:
    if dropout and dropout > 0:
        refuse(
            f"{name} runs attention dropout p={dropout} in training mode; sharedprefix refuses it because a "
            "prompt shared by G completions would share one dropout draw, unlike the plain run. "
            "Set the model's attention_dropout to 0.0 (RL fine-tuning normally does) or call model.eval()."
        )


def check_kwargs(name: str, kwargs: dict) -> None:
    odd = {k: v for k, v in kwargs.items() if k not in NEUTRAL_KWARGS and v is not None}
    if kwargs.get("is_causal") is False:
        odd["is_causal"] = False
    if odd:
        refuse(
            f"{name} passed attention arguments {sorted(odd)} that sharedprefix cannot honour exactly "
            "(e.g. position biases or a non-causal flag). This model is not supported."
        )


def autocast_cast(query, key, value) -> tuple[str | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(autocast device type or None, query, key, value) cast as autocast casts the plain run's
    ``scaled_dot_product_attention``: to its lower-precision dtype, float64 left alone."""
    amp = autocast_device(query)
    if amp is not None:
        dt = torch.get_autocast_dtype(amp)
        query, key, value = (t if t.dtype == torch.float64 else t.to(dt) for t in (query, key, value))
    return amp, query, key, value


def autocast_device(t: torch.Tensor) -> str | None:
    """The device type of ``t`` when autocast is on for it (mixed precision: TRL's and accelerate's ``bf16=True``
    over float32 weights), else None. Autocast runs the plain forward's ``scaled_dot_product_attention`` in its
    lower-precision dtype; the shared-prefix attention casts query, key and value the same way, and keeps its own
    log-sum-exp merges out of autocast (float32, as without it)."""
    kind = t.device.type
    return kind if torch.is_autocast_enabled(kind) else None


def check_indexed(module, indices, state: PassState, window, chunk, softcap, calls) -> None:
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
