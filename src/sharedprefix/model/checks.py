"""Checks made before any pass, once per model as it is: the head, randomness, position numbering and convolutions.

``verify_head`` runs the model's own forward on a three-token probe row and checks that what sharedprefix relies on
holds: the decoder followed by ``adapter.head_logits`` gives the model's own logits, the training-mode forward draws
no random numbers, the decoder numbers positions 0..L-1 (or as RoBERTa does: ``padding_numbered``), and no
convolution runs along the tokens outside the hybrid path; it then probes which attention each layer computes
(``attention.probe``). Its findings hold while the model computes what it computed then: they are kept with the
model's ``identity.model_key`` and made again, from scratch, on a call whose key differs (a module or its
``forward`` replaced, an embedding or head of another vocabulary).

Notation: L = row length.
"""

from __future__ import annotations

import inspect
import weakref

import torch
from transformers import PreTrainedModel

from sharedprefix.attention import probe
from sharedprefix.model import mixers, positions, streams
from sharedprefix.model.adapter import (
    HEADS,
    config_attention_layers,
    decoder,
    has_float32_head,
    head_logits,
    modules_after_decoder,
    text_config,
)
from sharedprefix.model.identity import model_key

# model -> (its ``model_key`` when verified, the (model.training, hybrid path) modes it was verified in under that key)
_VERIFIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# model -> padding index of its RoBERTa-style position numbering
_PADDING_NUMBERED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def verify_head(model: PreTrainedModel, forward=None, hybrid: bool = False) -> None:
    """Check before any pass what sharedprefix relies on: base + ``head_logits`` equals the model's own logits, the
    forward is not random, positions and token convolutions (see the helpers), and which attention each layer
    computes (``attention.probe``). Raises ValueError for what cannot be exact. The caller's random stream is left
    as it was. Once per model, mode (training mode adds a check) and ``model_key``: a model changed since it was
    verified (a module or its ``forward`` replaced, another vocabulary) is verified again, its findings made anew.
    ``forward``: what computes the model's own logits (default: ``model``; inside an FSDP2 root call, where the
    root's hooks already ran, its bound ``model.forward``).
    ``hybrid``: the model runs on the hybrid path (its own attention and convolutions, no probe).
    """
    key = model_key(model)
    entry = _VERIFIED.get(model)
    if entry is None or entry[0] != key:
        forget(model)
        entry = _VERIFIED[model] = (key, set())
    modes: set[tuple[bool, bool]] = entry[1]
    if (model.training, hybrid) in modes:
        return
    device = streams.head_device(model)
    with (
        torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
        torch.no_grad(),
        streams.framed(model, decoder(model)),
    ):  # a K-stream model reads these ids as frames of one code
        _verify(model, device, model if forward is None else forward, hybrid)
    modes.add((model.training, hybrid))


def forget(model: PreTrainedModel) -> None:
    """Drop what ``verify_head`` found for ``model`` (its head chain, position numbering and modules, the probed
    attention of its modules), so that nothing of an earlier version of the model outlives its verification."""
    _VERIFIED.pop(model, None)
    _PADDING_NUMBERED.pop(model, None)
    HEADS.pop(model, None)
    positions.forget(model)
    probe.forget(model)


def _verify(model: PreTrainedModel, device, forward, hybrid: bool = False) -> None:
    ids = (torch.arange(3, device=device) * 7 + 1).remainder(streams.head_vocab(model))[None]
    dec = decoder(model)
    if model.training:
        _check_deterministic(model, dec, ids)
    ref = forward(input_ids=ids, use_cache=False).logits
    k = streams.num_streams(model)  # K > 1: logits (K, 3, V), one row per stream, as head_logits gives them
    ref = (ref[0] if k == 1 else ref.reshape(-1, k, *ref.shape[1:])[0]).float()
    hidden = dec(input_ids=ids, use_cache=False).last_hidden_state[0]
    probed = _check_positions_and_convolutions(model, dec, ids, hidden, convolutions_allowed=hybrid)
    tol = 1e-4 * max(1.0, float(ref.abs().max()))
    if has_float32_head(model) and torch.is_autocast_enabled(device.type):
        # the model's own forward runs even a float32 head under autocast (TRL's cast_lm_head_to_fp32, or an
        # accelerate forward wrapper that re-enters autocast), ours runs outside it: allow that head's rounding
        tol = max(tol, 2 * torch.finfo(torch.get_autocast_dtype(device.type)).eps * float(ref.abs().max()))
    errs = []
    for chain in (None, modules_after_decoder(model)):
        if chain is not None:
            HEADS[model] = chain
        try:
            ours = head_logits(model, hidden).float()
        except (RuntimeError, TypeError) as e:  # a candidate head that does not even apply: not this one
            errs.append(f"{type(e).__name__}")
            HEADS.pop(model, None)
            continue
        if ours.shape == ref.shape and torch.allclose(ours, ref, rtol=1e-3, atol=tol):
            if not hybrid and not probed:  # the hybrid path runs the model's own attention, not sharedprefix's
                probe.probe(model, dec, config_attention_layers(model))
            return
        errs.append(
            f"{float((ours - ref).abs().max()):.3g}" if ours.shape == ref.shape else f"shape {tuple(ours.shape)}"
        )
        HEADS.pop(model, None)
    raise ValueError(
        f"{type(model).__name__}'s forward turns hidden states into logits in a way sharedprefix does not reproduce "
        f"(max |delta logit| {errs[0]} with its output embedding and known post-processing, {errs[1]} with the "
        "modules after its decoder); sharedprefix refuses it rather than return different log-probs."
    )


def _check_deterministic(model, dec, ids) -> None:
    """Refuse a model whose training-mode forward draws random numbers (router jitter, sampled expert routing,
    dropout in the model's own code): the plain run draws per row, a shared prompt would share one draw."""
    cuda = ids.device.type == "cuda"
    before = torch.random.get_rng_state(), torch.cuda.get_rng_state(ids.device) if cuda else None
    dec(input_ids=ids, use_cache=False)
    after = torch.random.get_rng_state(), torch.cuda.get_rng_state(ids.device) if cuda else None
    if not all(a is None or (b is not None and torch.equal(a, b)) for a, b in zip(before, after)):
        raise ValueError(
            f"{type(model).__name__}'s forward in training mode draws random numbers (dropout, router jitter or "
            "sampled expert routing, such as Phi-MoE's): a prompt shared by G completions would share one random "
            "draw where the plain run draws one per row. Call model.eval() or turn the noise off (dropout 0.0, "
            "router_jitter_noise 0.0)."
        )


def _check_positions_and_convolutions(model, dec, ids, hidden, convolutions_allowed: bool = False) -> bool:
    """Refuse a decoder whose own position numbering is not 0..L-1, or that runs a convolution along the tokens
    (unless ``convolutions_allowed``: the hybrid path carries convolution states). A decoder without position_ids
    is probed first (attention outside transformers' interface is the deeper reason to refuse it), then its
    position modules are renumbered (``positions.verify``). Returns True when it probed the model."""
    name = type(model).__name__
    ran, packed = [], mixers.conv_modules(model)  # the packed path carries these (``model.mixers``)
    hooks = [
        mod.register_forward_hook(lambda m, *_, n=mod_name: ran.append((n, type(m).__name__)))
        for mod_name, mod in model.named_modules()
        if isinstance(mod, torch.nn.Conv1d) and any(mod is m for m in dec.modules()) and id(mod) not in packed
    ]
    try:
        numbered = dec(
            input_ids=ids,
            **positions.decoder_kwargs(dec, torch.arange(ids.shape[1], device=ids.device)[None]),
            use_cache=False,
        ).last_hidden_state[0]
    finally:
        for h in hooks:
            h.remove()
    # 1-d convolutions that run on a text-only row mix tokens; patch/audio encoders do not run here
    if ran and not convolutions_allowed:
        raise ValueError(
            f"{name} contains a convolution over tokens ({ran[0][0]}: {ran[0][1]}); layers that mix tokens outside "
            "attention cannot share a prompt through attention, and this model type is not one whose layer states "
            f"sharedprefix carries ({', '.join(mixers.model_types(mixers.CACHE))}), so it refuses this model."
        )
    if not positions.takes_position_ids(dec):
        if convolutions_allowed:  # the hybrid path continues the model's own cache, whose length numbers completions
            return False
        probe.probe(model, dec, config_attention_layers(model))
        positions.verify(model, dec, ids, positionless=mixers.attention_free(model))
        return True
    close = lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6 * max(1.0, float(b.abs().max())))  # noqa: E731
    if close(numbered, hidden):
        return False
    pad = getattr(text_config(model), "pad_token_id", None)
    if isinstance(pad, int) and _numbers_after_padding(dec, ids, hidden, pad, close):
        _PADDING_NUMBERED[model] = pad
        return False
    again = dec(input_ids=ids, use_cache=False).last_hidden_state[0]
    if not close(again, hidden):  # not the positions: the same forward twice differs
        raise ValueError(
            f"{name}'s decoder gives other hidden states for the same row on a second forward: its forward changes "
            "the model's state (in training mode: spectral_norm's power iteration, BatchNorm's running statistics, "
            "a buffer updated in place), once per row in the plain run and fewer times where rows share a prompt, "
            "so sharedprefix cannot reproduce it. Call model.eval(), or remove what updates the state."
        )
    raise ValueError(
        f"{name}'s decoder numbers the positions of a row differently from 0..L-1 when given no position_ids, and "
        "not as RoBERTa does (padding index + 1 + the count of non-padding tokens so far), so the position ids "
        "sharedprefix gives each prompt and completion would not be the ones the plain forward uses. This model is "
        "not supported."
    )


def padding_numbered(ids: torch.Tensor, pad: int) -> torch.Tensor:
    """RoBERTa's position ids of a row of token ``ids`` (..., L): pad + 1 + the count of non-padding tokens before
    each non-padding token, ``pad`` on padding tokens (transformers' create_position_ids_from_input_ids)."""
    keep = ids.ne(pad).long()
    return keep.cumsum(-1) * keep + pad


def _numbers_after_padding(dec, ids, hidden, pad: int, close) -> bool:
    """True when the decoder numbers rows as ``padding_numbered`` does: on the probe row, and on it with a padding
    token inside (which keeps the position of the padding index and does not advance the count).

    The numbered run also gets an all-ones ``attention_mask`` where the decoder takes one: transformers (from
    5.25 for RoBERTa) reads explicit position ids that do not step by 1, as the padding index does, as the
    boundaries of packed sequences and masks across them unless a 2-d mask is given. sharedprefix's own passes
    build no transformers mask, so the check compares the numbering alone, not that masking."""
    with_pad = torch.cat([ids[:, :1], torch.full_like(ids[:, :1], pad), ids[:, 1:]], 1)
    takes_mask = "attention_mask" in inspect.signature(dec.forward).parameters
    for row, own in ((ids, hidden), (with_pad, None)):
        if own is None:
            own = dec(input_ids=row, use_cache=False).last_hidden_state[0]
        unpacked = {"attention_mask": torch.ones_like(row)} if takes_mask else {}
        ours = dec(
            input_ids=row, position_ids=padding_numbered(row, pad), **unpacked, use_cache=False
        ).last_hidden_state[0]
        if not close(ours, own):
            return False
    return True


def decoder_position_ids(model: PreTrainedModel, layout) -> torch.Tensor:
    """(1, L) int64 position ids to give the decoder for ``layout``'s packed row: its positions (each completion
    continuing its prompt), or, for a RoBERTa-style model, the numbering of each token's plain row
    (``padding_numbered`` over the token's ancestors and its own segment up to it)."""
    pad = _PADDING_NUMBERED.get(model)
    if pad is None:
        return layout.position_ids
    segs, out = layout.tree.segments, []
    for s in layout.segments:
        path = torch.cat([segs[a].tokens for a in layout.tree.ancestors(s)] + [segs[s].tokens])
        out.append(padding_numbered(path, pad)[-segs[s].length :])
    return torch.cat(out)[None]
