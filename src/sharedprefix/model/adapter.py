"""Adapters around a transformers causal LM: unwrap its wrappers, find its decoder, define its head.

sharedprefix runs the model's *base* (the decoder stack, ending with the final norm) on a
packed row and applies the LM head itself (``head.token_logprobs``), only where a completion
token is predicted and in chunks, so that no (tokens, vocab) matrix for the whole row exists
at once. The head's
own post-processing (Gemma2 final-logit soft-capping, Granite logit scaling, Cohere logit
scale) is reproduced, and checked once per model against the model's own forward (``checks.verify_head``).
What cannot be exact is refused in ``support``.

Notation: M = predicted tokens, d = hidden size, V = vocabulary.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel

from sharedprefix.attention import probe

# Layer types that attend (config.layer_types / layers_block_type); ``support`` classifies the others.
# (indexed_attention: DeepSeek sparse attention, attention over indexer-selected keys, ``attention.indexed``)
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "attention", "indexed_attention"}
HEADS: weakref.WeakKeyDictionary = (
    weakref.WeakKeyDictionary()
)  # model -> modules after its decoder that form its head (``checks.verify_head``)


def unwrap(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers causal LM inside DDP / PEFT / accelerate / ``torch.compile`` wrappers (a compiled wrapper's
    options are read by ``schedule.compiled``, which compiles the decoder layers with them)."""
    return wrappers(model)[-1]


def wrappers(model: torch.nn.Module) -> list:
    """``model`` and each wrapper inside it, down to the transformers causal LM (the last entry); TypeError where
    there is none."""
    chain: list[Any] = [model]  # walked through wrappers of any type
    for _ in range(8):
        m = chain[-1]
        if isinstance(m, PreTrainedModel):
            return chain
        if isinstance(m, torch.nn.Module) and "_orig_mod" in m._modules:  # torch.compile's OptimizedModule
            chain.append(m._orig_mod)
        elif hasattr(m, "get_base_model"):  # peft.PeftModel
            refuse_prompt_learning(m)
            chain.append(m.get_base_model())
        elif hasattr(m, "module"):  # DistributedDataParallel, accelerate wrappers
            chain.append(m.module)
        else:
            break
    raise TypeError(
        f"model is a {type(model).__name__}; expected a transformers causal LM (a PreTrainedModel with an LM head), "
        "optionally wrapped by PEFT or DistributedDataParallel."
    )


def adapter_state(model: torch.nn.Module) -> tuple:
    """Which PEFT adapters take part in ``model``'s forward now: for each tuner layer (a module with PEFT's
    ``disable_adapters`` and ``active_adapters``, LoRA layers and ``modules_to_save`` wrappers alike), in module
    order, whether its adapters are disabled (``PeftModel.disable_adapter()``) and which are active (transformers'
    own ``disable_adapters`` method is not such a layer). Empty for a model without adapters."""
    return tuple(
        (name, bool(m.disable_adapters), tuple(m.active_adapters))
        for name, m in unwrap(model).named_modules()
        if isinstance(getattr(type(m), "disable_adapters", None), property) and hasattr(m, "active_adapters")
    )


def refuse_prompt_learning(peft_model) -> None:
    """Refuse a PEFT model whose active adapter is a prompt-learning method (prompt tuning, prefix tuning,
    P-tuning, multitask prompt tuning): its ``PeftModel.forward`` puts virtual tokens before every row (their
    embeddings, or K/V in every layer), which sharedprefix's run of the base model would leave out, silently."""
    config = getattr(peft_model, "active_peft_config", None)
    if getattr(config, "is_prompt_learning", False):
        kind = getattr(getattr(config, "peft_type", None), "value", type(config).__name__)
        raise ValueError(
            f"the PEFT model's active adapter is {kind} (a prompt-learning method, "
            f"{getattr(config, 'num_virtual_tokens', '?')} virtual tokens before every row, added by "
            "PeftModel.forward); sharedprefix runs the base model's decoder itself and cannot add them, so its "
            "log-probs and gradients would be those of the model without them. Use an adapter on the weights (LoRA "
            "and the other tuner layers are supported) or the plain forward."
        )


def peel_compiled(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` without the ``torch.compile`` wrappers (``OptimizedModule``) around it."""
    while isinstance(model, torch.nn.Module) and "_orig_mod" in model._modules:
        model = model._orig_mod
    return model


def decoder(model: PreTrainedModel) -> torch.nn.Module:
    """The decoder stack (embeddings, layers, final norm) whose output feeds the LM head.

    The first of ``get_decoder()``, ``base_model`` and ``model.model`` that is not the causal LM itself and
    takes ``input_ids`` (``get_decoder()`` guesses by attribute name, and some heads are called ``decoder``).
    """
    cands = [
        model.get_decoder() if hasattr(model, "get_decoder") else None,
        model.base_model,
        getattr(model, "model", None),
    ]
    for dec in cands:
        if isinstance(dec, torch.nn.Module) and dec is not model and "input_ids" in _params(dec.forward):
            return dec
    raise ValueError(
        f"{type(model).__name__}: cannot find its decoder stack (get_decoder(), base_model and .model are the model "
        "itself or do not take input_ids), so sharedprefix cannot run the layers without the LM head. This model "
        "is not supported."
    )


def _params(fn) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def text_config(model: PreTrainedModel):
    return model.config.get_text_config()


def num_attention_layers(model: PreTrainedModel) -> int:
    """Attention modules that must run through the sharedprefix attention function in every pass: as probed
    (``attention.probe``; a looped model runs fewer modules than it has layers), else from the config."""
    probed = probe.attention_modules(model)
    return probed if probed is not None else config_attention_layers(model)


def config_attention_layers(model: PreTrainedModel) -> int:
    cfg = text_config(model)
    types = getattr(cfg, "layer_types", None) or getattr(cfg, "layers_block_type", None)
    if types:
        return sum(str(t) in ATTENTION_LAYER_TYPES for t in types)
    return int(getattr(cfg, "num_hidden_layers", None) or 1)  # a config without a layer count: at least one


def head_logits(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """(M, d) final hidden states -> (M, V) logits, with the model's own post-processing; (K, M, V) for a model
    with one head per token stream (``streams``: MusicGen).

    By default the output embedding followed by the post-processing transformers models apply (final-logit
    soft-capping, Granite's ``logits_scaling``, Cohere's ``logit_scale``). A model whose head is more than that
    (BERT-style transform + norm + decoder) uses the chain of modules after its decoder that ``verify_head``
    found to reproduce the model's own logits.
    """
    chain = HEADS.get(model)
    if chain is not None:
        for mod in chain:
            hidden = mod(hidden)
        return hidden
    out = model.get_output_embeddings()
    if isinstance(out, torch.nn.ModuleList):  # one head per stream; a single stream is an ordinary head
        logits = torch.stack([h(hidden) for h in out]) if len(out) > 1 else out[0](hidden)
    elif getattr(out, _FLOAT32_HEAD, False):  # float32 outside autocast, as TRL's cast_lm_head_to_fp32 runs it
        with torch.autocast(hidden.device.type, enabled=False):
            return _post_process(model, in_own_call(out, _float32_linear, hidden))
    else:
        logits = out(hidden)
    return _post_process(model, logits)


_FLOAT32_HEAD = "_sharedprefix_float32_head"


def _float32_linear(out: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    bias = None if out.bias is None else out.bias.float()
    return torch.nn.functional.linear(hidden.float(), out.weight.float(), bias)


def in_own_call(mod: torch.nn.Module, fn: Callable, x: torch.Tensor) -> torch.Tensor:
    """``fn(mod, x)`` run as ``mod``'s forward, inside ``mod``'s own call: the hooks an engine registers on the module
    run around it as around the module's forward (DeepSpeed ZeRO-3 gathers the module's parameters there, and again
    for its backward; outside them the parameters are empty). ``mod.forward`` is as it was afterwards (an instance
    attribute, such as TRL's float32 head forward, included)."""
    own = mod.__dict__.get("forward", _NONE)
    mod.forward = lambda h: fn(mod, h)  # an instance attribute: shadows the class's forward for this call only
    try:
        return mod(x)
    finally:
        if own is _NONE:
            del mod.forward
        else:
            mod.forward = own


_NONE = object()


def has_float32_head(model: PreTrainedModel) -> bool:
    """True when ``mark_float32_head`` marked the model's head (it then runs in float32 outside autocast)."""
    return bool(getattr(model.get_output_embeddings(), _FLOAT32_HEAD, False))


def mark_float32_head(model: PreTrainedModel) -> None:
    """Run ``model``'s linear LM head (and the logits' post-processing) in float32 outside autocast, as TRL's
    ``cast_lm_head_to_fp32=True`` does: ``head_logits`` then casts the hidden states and the weight to float32."""
    out = model.get_output_embeddings()
    if not isinstance(out, torch.nn.Linear):
        raise ValueError(
            f"{type(model).__name__}'s output head is a {type(out).__name__}; a float32 head (cast_lm_head_to_fp32) "
            "is supported for a linear head only. Set cast_lm_head_to_fp32=False."
        )
    setattr(out, _FLOAT32_HEAD, True)


def _post_process(model: PreTrainedModel, logits: torch.Tensor) -> torch.Tensor:
    cfg = text_config(model)
    cap = getattr(cfg, "final_logit_softcapping", None)
    scaling = getattr(cfg, "logits_scaling", None)
    scale = getattr(model, "logit_scale", None)
    if scaling is not None:
        logits = logits / scaling
    if scale is not None and not isinstance(scale, torch.nn.Module):
        logits = logits * scale
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def modules_after_decoder(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The causal LM's own children with parameters, other than (a parent of) the decoder, in order."""
    dec = decoder(model)
    return [
        child
        for _, child in model.named_children()
        if not any(m is dec for m in child.modules()) and next(child.parameters(), None) is not None
    ]
