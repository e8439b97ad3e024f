"""Adapters around a transformers causal LM: unwrap, refuse what cannot be exact, run the head.

sharedprefix runs the model's *base* (the decoder stack, ending with the final norm) on a
packed row and applies the LM head itself, only where a completion token is predicted and
in chunks, so that no (tokens, vocab) matrix for the whole row exists at once. The head's
own post-processing (Gemma2 final-logit soft-capping, Granite logit scaling, Cohere logit
scale) is reproduced, and checked once per model against the model's own forward.

Notation: M = predicted tokens, d = hidden size, V = vocabulary.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

_ALLOWED_LAYER_TYPES = {"full_attention", "sliding_attention", "attention"}
_VERIFIED = weakref.WeakKeyDictionary()


def unwrap(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers causal LM inside DDP / PEFT / accelerate wrappers."""
    m = model
    for _ in range(8):
        if isinstance(m, PreTrainedModel):
            return m
        if hasattr(m, "get_base_model"):  # peft.PeftModel
            m = m.get_base_model()
        elif hasattr(m, "module"):  # DistributedDataParallel, accelerate wrappers
            m = m.module
        else:
            break
    raise TypeError(
        f"model is a {type(model).__name__}; expected a transformers causal LM (a PreTrainedModel with an LM head), "
        "optionally wrapped by PEFT or DistributedDataParallel."
    )


def decoder(model: PreTrainedModel) -> torch.nn.Module:
    """The decoder stack (embeddings, layers, final norm) whose output feeds the LM head."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else None
    if dec is None or dec is model:
        dec = model.base_model
    if dec is model:
        raise ValueError(
            f"{type(model).__name__}: cannot find its decoder stack (get_decoder() and base_model return the model "
            "itself), so sharedprefix cannot run the layers without the LM head. This model is not supported."
        )
    return dec


def text_config(model: PreTrainedModel):
    return model.config.get_text_config()


def num_attention_layers(model: PreTrainedModel) -> int:
    return int(text_config(model).num_hidden_layers)


def check_supported(model: PreTrainedModel) -> None:
    """Raise ValueError for every model feature sharedprefix cannot compute exactly."""
    cfg = text_config(model)
    name = type(model).__name__
    types = getattr(cfg, "layer_types", None) or getattr(cfg, "layers_block_type", None)
    if types:
        odd = sorted({str(t) for t in types} - _ALLOWED_LAYER_TYPES)
        if odd:
            raise ValueError(
                f"{name} has layers of type {odd}, which mix tokens outside attention (state-space, linear "
                "attention or convolution). sharedprefix only shares prompts through attention and refuses these "
                "models rather than give inexact results."
            )
    for mod_name, mod in model.named_modules():
        if isinstance(mod, torch.nn.modules.conv._ConvNd):
            raise ValueError(
                f"{name} contains a convolution over tokens ({mod_name}: {type(mod).__name__}); layers that mix tokens "
                "outside attention cannot share a prompt exactly, so sharedprefix refuses this model."
            )
        if model.training and isinstance(mod, torch.nn.Dropout) and mod.p > 0:
            raise ValueError(
                f"{name} is in training mode with dropout p={mod.p} at {mod_name}; a prompt shared by G completions "
                "would share one dropout draw, unlike the plain run. Disable dropout (config *_dropout=0.0, as RL "
                "fine-tuning normally does) or call model.eval()."
            )
    if model.training and float(getattr(cfg, "attention_dropout", 0.0) or 0.0) > 0:
        raise ValueError(
            f"{name} is in training mode with attention_dropout={cfg.attention_dropout}; sharedprefix refuses attention "
            "dropout because the shared prompt would share one dropout draw. Set config.attention_dropout=0.0."
        )
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        raise ValueError(
            f"{name} uses attention-score soft-capping (attn_logit_softcapping={cfg.attn_logit_softcapping}), which "
            "sharedprefix does not implement exactly, so it refuses the model."
        )
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if rope_type in ("dynamic", "longrope"):
        raise ValueError(
            f"{name} uses {rope_type!r} RoPE scaling, whose frequencies depend on the longest position in the batch; "
            "a packed row's longest position differs from each plain row's, so the result could change. This "
            "rope_type is not supported (plain, linear, yarn and llama3 scaling depend on positions only)."
        )
    if getattr(cfg, "attn_temperature_tuning", False):
        raise ValueError(
            f"{name} scales attention queries by the token's index in the row (attn_temperature_tuning), not by its "
            "position id, so a packed row would change the result. Set config.attn_temperature_tuning=False only if "
            "the model was trained without it; otherwise this model is not supported."
        )
    if getattr(cfg, "output_router_logits", False):
        raise ValueError(
            f"{name} has output_router_logits=True: its MoE load-balancing loss counts every token of every row, so "
            "a prompt shared by G completions would be counted once instead of G times. Set "
            "config.output_router_logits=False (routing itself is per token and stays exact)."
        )
    if model.get_output_embeddings() is None:
        raise ValueError(f"{name} has no LM head (get_output_embeddings() is None); expected a causal LM.")


def uses_checkpointing(model: PreTrainedModel) -> bool:
    """True when gradient checkpointing is active (training mode), reentrant or not."""
    return model.training and any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def uses_reentrant_checkpointing(model: PreTrainedModel) -> bool:
    """True when gradient checkpointing with ``use_reentrant=True`` is active in training mode."""
    if not model.training:
        return False
    for mod in model.modules():
        if getattr(mod, "gradient_checkpointing", False):
            fn = getattr(mod, "_gradient_checkpointing_func", None)
            # torch.utils.checkpoint defaults to use_reentrant=True when it is not given
            if getattr(fn, "keywords", {}).get("use_reentrant", True):
                return True
    return False


def head_logits(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """(M, d) final hidden states -> (M, V) logits, with the model's own post-processing."""
    logits = model.get_output_embeddings()(hidden)
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


def verify_head(model: PreTrainedModel) -> None:
    """Check once per model that base + ``head_logits`` equals the model's own logits."""
    if _VERIFIED.get(model):
        return
    vocab = model.get_output_embeddings().weight.shape[0]
    device = model.get_output_embeddings().weight.device
    ids = (torch.arange(3, device=device) * 7 + 1).remainder(vocab)[None]
    # inside an FSDP2 root call the model's forward is replaced; its own forward is kept aside
    forward = getattr(model, "_sharedprefix_own_forward", model)
    with torch.no_grad():
        ref = forward(input_ids=ids, use_cache=False).logits[0].float()
        hidden = decoder(model)(input_ids=ids, use_cache=False).last_hidden_state[0]
        ours = head_logits(model, hidden).float()
    tol = 1e-4 * max(1.0, float(ref.abs().max()))
    if not torch.allclose(ours, ref, rtol=1e-3, atol=tol):
        raise ValueError(
            f"{type(model).__name__}'s forward turns hidden states into logits in a way sharedprefix does not "
            f"reproduce (max |delta logit| = {float((ours - ref).abs().max()):.3g}); sharedprefix refuses it rather "
            "than return different log-probs."
        )
    _VERIFIED[model] = True


class _TokenLogprob(torch.autograd.Function):
    """(M, V) logits -> (M,) log p(target) and (M,) entropy, with a one-pass exact backward.

    Saves the logits and the (M,) log-sum-exp only; the backward forms
    d/dz [g_tok * log p_t + g_ent * H] = g_tok * (onehot_t - p) - g_ent * p * (log p + H)
    directly instead of going through log_softmax and a scattered zero matrix.
    """

    @staticmethod
    def forward(ctx, z, targets, want_entropy):
        lse = torch.logsumexp(z, dim=-1)
        tok = z.gather(-1, targets[:, None])[:, 0] - lse
        if want_entropy:
            p = torch.exp(z - lse[:, None])
            ent = lse - (p * z).sum(-1)
        else:
            ent = z.new_zeros(0)
        ctx.save_for_backward(z, targets, lse, ent)
        ctx.want_entropy = want_entropy
        return tok, ent

    @staticmethod
    def backward(ctx, g_tok, g_ent):
        z, targets, lse, ent = ctx.saved_tensors
        p = (z - lse[:, None]).exp_()  # softmax; at most two (M, V) temporaries live below
        if ctx.want_entropy and g_ent is not None:
            e = (z - lse[:, None]).add_(ent[:, None]).mul_(p).mul_(g_ent[:, None])  # g_ent * p * (log p + H)
            grad = p.mul_(-g_tok[:, None]).sub_(e)
        else:
            grad = p.mul_(-g_tok[:, None])
        grad.scatter_add_(-1, targets[:, None], g_tok[:, None])
        return grad, None, None


def _logprob_chunk(model, hidden, targets, temperature: float, want_entropy: bool, out_dtype):
    logits = head_logits(model, hidden).to(out_dtype)
    if temperature != 1.0:
        logits = logits / temperature
    return _TokenLogprob.apply(logits, targets, want_entropy)


def token_logprobs(
    model: PreTrainedModel,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    entropy: bool = False,
    chunk_tokens: int | None = None,
):
    """Log-probs (and entropy) of ``targets`` under the head applied to ``hidden``.

    Args:
        hidden: (M, d) final hidden states of the predicting positions.
        targets: (M,) int64 token ids.
        temperature: logits are divided by it before the softmax (as TRL does).
        chunk_tokens: rows of the head computed at once (default: about 4M logits per chunk); under
            grad each chunk is recomputed in backward, so only a few (chunk_tokens, V) matrices are
            ever held.

    Returns:
        (M,) natural-log probabilities and (M,) entropies in nats (or None), float32, or
        float64 for a float64 model.
    """
    out_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    if chunk_tokens is None:
        vocab = model.get_output_embeddings().weight.shape[0]
        chunk_tokens = max(16, 2**22 // vocab)
    toks, ents = [], []
    head_params = model.get_output_embeddings().parameters()
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head_params))
    for s in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[s : s + chunk_tokens], targets[s : s + chunk_tokens]
        args = (model, h, t, temperature, entropy, out_dtype)
        if grad:
            tok, ent = checkpoint(_logprob_chunk, *args, use_reentrant=False)
        else:
            tok, ent = _logprob_chunk(*args)
        toks.append(tok)
        ents.append(ent)
    tok = torch.cat(toks) if toks else hidden.new_zeros(0, dtype=out_dtype)
    ent = torch.cat(ents) if entropy and ents else None
    return tok, ent
