"""Adapters around a transformers causal LM: unwrap, refuse what cannot be exact, define the head.

sharedprefix runs the model's *base* (the decoder stack, ending with the final norm) on a
packed row and applies the LM head itself (``head.token_logprobs``), only where a completion
token is predicted and in chunks, so that no (tokens, vocab) matrix for the whole row exists
at once. The head's
own post-processing (Gemma2 final-logit soft-capping, Granite logit scaling, Cohere logit
scale) is reproduced, and checked once per model against the model's own forward.

Notation: M = predicted tokens, d = hidden size, V = vocabulary.
"""

from __future__ import annotations

import inspect
import weakref

import torch
from transformers import PreTrainedModel

from sharedprefix import positions, streams
from sharedprefix.attention import probe

# Layer types (config.layer_types / layers_block_type) by what sharedprefix does with them.
# (indexed_attention: DeepSeek sparse attention, attention over indexer-selected keys, ``attention.indexed``)
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "attention", "indexed_attention"}
NON_MIXING_LAYER_TYPES = {"mlp", "moe", "dense", "sparse"}  # per-token layers without any token mixing
COMPRESSED_ATTENTION_LAYER_TYPES = {  # DeepSeek-V4: attention over keys pooled from blocks of the row
    "compressed_sparse_attention": "attention over compressed keys (and indexer-selected ones among them)",
    "heavily_compressed_attention": "attention over compressed keys",
}
# Hybrid model types (layers that mix tokens outside attention) whose own cache-aware forward continues a prompt's
# layer state exactly (tests/models/test_hybrid.py and the zoo): they run on ``schedule.hybrid``; other hybrids are
# refused (``_check_layer_types``, ``_check_positions_and_convolutions``).
HYBRID_MODEL_TYPES = {"lfm2", "lfm2_moe", "falcon_h1", "qwen3_next", "qwen3_5_text", "zamba2", "olmo_hybrid",
                      "kimi_linear", "bailing_hybrid", "nemotron_h", "mamba2", "bamba", "granitemoehybrid", "lfm3",
                      "minimax", "qwen3_5_moe_text", "zaya", "lara_mini"}
# Hybrid model types that stay refused because their own forward cannot continue a prompt's layer state: why.
_MAMBA1 = (
    "its Mamba (v1) selective scan starts every multi-token forward from a zero state (transformers' torch scan and "
    "the mamba_ssm kernel take no initial state), so a completion batch cannot continue its prompt's recurrent state "
    "through the model's own forward; only the single-token decode reads that state, and it overwrites it in place, "
    "which autograd cannot differentiate through"
)
HYBRID_REFUSED = {
    "mamba": _MAMBA1, "falcon_mamba": _MAMBA1, "jamba": _MAMBA1, "zamba": _MAMBA1,
    "recurrent_gemma": (
        "it keeps its convolution and recurrent states on its own modules, not in the cache, and its multi-token "
        "forward restarts the convolution from zero inputs (only the single-token decode reads the previous ones), so a "
        "completion batch cannot continue its prompt's state through the model's own forward"
    ),
}
# Model types whose layers mix tokens by a recurrence, without layer_types to say so (refused in check_supported).
RECURRENT_MODEL_TYPES = {
    "rwkv": "RWKV's time mixing (a linear recurrence of exponentially decayed keys and values)",
    "xlstm": "xLSTM's mLSTM cells (a gated matrix-memory recurrence)",
}
_VERIFIED = weakref.WeakKeyDictionary()  # model -> the (model.training, hybrid path) modes it was verified in
_HEADS = weakref.WeakKeyDictionary()  # model -> modules after its decoder that form its head
_PADDING_NUMBERED = weakref.WeakKeyDictionary()  # model -> padding index of its RoBERTa-style position numbering


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
    if hasattr(m, "_orig_mod"):  # torch.compile's OptimizedModule
        raise TypeError(
            f"model is a torch.compile wrapper ({type(m).__name__}); sharedprefix runs the model's decoder and head "
            "itself, so a compiled forward would not be used. Pass the uncompiled model (model._orig_mod)."
        )
    raise TypeError(
        f"model is a {type(model).__name__}; expected a transformers causal LM (a PreTrainedModel with an LM head), "
        "optionally wrapped by PEFT or DistributedDataParallel."
    )


def is_hybrid(model: PreTrainedModel) -> bool:
    """True for a model type that runs on the hybrid path (``HYBRID_MODEL_TYPES``)."""
    return getattr(model.config, "model_type", None) in HYBRID_MODEL_TYPES  # a multimodal wrapper is not listed


def decoder(model: PreTrainedModel) -> torch.nn.Module:
    """The decoder stack (embeddings, layers, final norm) whose output feeds the LM head.

    The first of ``get_decoder()``, ``base_model`` and ``model.model`` that is not the causal LM itself and
    takes ``input_ids`` (``get_decoder()`` guesses by attribute name, and some heads are called ``decoder``).
    """
    cands = [model.get_decoder() if hasattr(model, "get_decoder") else None, model.base_model,
             getattr(model, "model", None)]
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


def check_supported(model: PreTrainedModel, hybrid: bool = False) -> None:
    """Raise ValueError for every model feature sharedprefix cannot compute exactly. ``hybrid``: the model runs on
    the hybrid path (``schedule.hybrid``), which carries layer states that mix tokens outside attention."""
    cfg = text_config(model)
    name = type(model).__name__
    if not hybrid:
        _check_layer_types(name, cfg)
    decoder(model)  # a decoder without position_ids is renumbered or refused in verify_head (positions.verify)
    for mod_name, mod in model.named_modules():
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
    drops = [getattr(cfg, k, None) for k in ("layerdrop", "decoder_layerdrop")]  # and the modules' own copies
    drops += [getattr(m, "layerdrop", None) for m in model.modules()]
    drop = max((float(d) for d in drops if isinstance(d, (int, float)) and not isinstance(d, bool)), default=0.0)
    if model.training and drop > 0:
        raise ValueError(
            f"{name} is in training mode with layerdrop={drop}: its forward skips each layer at random (Python's "
            "random.uniform, per forward), so a prompt shared by G completions would share one draw where the plain "
            "run draws one per row. Set config.layerdrop=0.0 (and decoder_layerdrop) or call model.eval()."
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
        tuned = [m for m in model.modules() if getattr(m, "attn_temperature_tuning", False)]
        odd = [type(m).__name__ for m in tuned if not all(hasattr(m, a) for a in ("floor_scale", "attn_scale", "use_rope"))]
        if not tuned or odd:
            raise ValueError(
                f"{name} scales attention queries by the token's index in the row (attn_temperature_tuning), and "
                f"sharedprefix finds no Llama 4 attention module with floor_scale, attn_scale and use_rope "
                f"({odd or 'none'}) to rescale them to position ids, so a packed row would change the result. This "
                "model is not supported; set config.attn_temperature_tuning=False only if it was trained without it."
            )
    if model.get_output_embeddings() is None:
        raise ValueError(f"{name} has no LM head (get_output_embeddings() is None); expected a causal LM.")
    streams.num_streams(model)  # several token streams per position: one embedding and one linear head each
    if getattr(model.config, "model_type", None) in POOLING_MODEL_TYPES:
        raise ValueError(f"{name}: {POOLING_MODEL_TYPES[model.config.model_type]}; sharedprefix refuses the model.")


# Models whose decoder pools tokens into larger units before attention runs over those units.
POOLING_MODEL_TYPES = {
    "blt": "the Byte Latent Transformer pools bytes into patches whose boundaries depend on the bytes (an entropy "
           "model), and its local layers cross-attend between bytes and patches: its layers mix tokens outside "
           "attention (pooling), which sharedprefix's packed rows cannot reproduce",
}


def _check_layer_types(name: str, cfg) -> None:
    recurrence = RECURRENT_MODEL_TYPES.get(getattr(cfg, "model_type", None))
    if recurrence is not None:
        raise ValueError(
            f"{name}'s layers mix tokens outside attention: {recurrence}, carried from token to token, where "
            "sharedprefix shares a prompt through attention only; it refuses the model rather than give inexact "
            "results."
        )
    types = getattr(cfg, "layer_types", None) or getattr(cfg, "layers_block_type", None)
    kinds = {str(t) for t in types or ()}
    compressed = sorted(kinds & set(COMPRESSED_ATTENTION_LAYER_TYPES))
    odd = sorted(kinds - ATTENTION_LAYER_TYPES - NON_MIXING_LAYER_TYPES - set(compressed))
    if compressed and not odd:
        raise ValueError(
            f"{name} has layers of type {compressed}: {COMPRESSED_ATTENTION_LAYER_TYPES[compressed[0]]}, whose "
            "compressor pools every block of compress_rate consecutive tokens of the row into one key (a gated "
            "weighted sum, blocks aligned to row indices): these layers mix tokens outside attention, and on a packed "
            "row a block would pool tokens of different prompts and completions. sharedprefix refuses the model."
        )
    if odd:
        model_type = getattr(cfg, "model_type", None)
        why = f": {HYBRID_REFUSED[model_type]}" if model_type in HYBRID_REFUSED else ""
        raise ValueError(
            f"{name} has layers of type {odd}, which mix tokens outside attention (state-space, linear attention, "
            f"recurrence or convolution), and its model type {model_type!r} is not one whose "
            "cache-aware forward sharedprefix has checked exact for carrying a prompt's layer state to its "
            f"completions ({', '.join(sorted(HYBRID_MODEL_TYPES))}){why}. It refuses the model rather than give "
            "inexact results."
        )


def num_attention_layers(model: PreTrainedModel) -> int:
    """Attention modules that must run through the sharedprefix attention function in every pass: as probed
    (``attention.probe``; a looped model runs fewer modules than it has layers), else from the config."""
    probed = probe.attention_modules(model)
    return probed if probed is not None else _config_attention_layers(model)


def _config_attention_layers(model: PreTrainedModel) -> int:
    cfg = text_config(model)
    types = getattr(cfg, "layer_types", None) or getattr(cfg, "layers_block_type", None)
    if types:
        return sum(str(t) in ATTENTION_LAYER_TYPES for t in types)
    return int(getattr(cfg, "num_hidden_layers", None) or 1)  # a config without a layer count: at least one


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
    """(M, d) final hidden states -> (M, V) logits, with the model's own post-processing; (K, M, V) for a model
    with one head per token stream (``streams``: MusicGen).

    By default the output embedding followed by the post-processing transformers models apply (final-logit
    soft-capping, Granite's ``logits_scaling``, Cohere's ``logit_scale``). A model whose head is more than that
    (BERT-style transform + norm + decoder) uses the chain of modules after its decoder that ``verify_head``
    found to reproduce the model's own logits.
    """
    chain = _HEADS.get(model)
    if chain is not None:
        for mod in chain:
            hidden = mod(hidden)
        return hidden
    out = model.get_output_embeddings()
    if isinstance(out, torch.nn.ModuleList):  # one head per stream; a single stream is an ordinary head
        logits = torch.stack([h(hidden) for h in out]) if len(out) > 1 else out[0](hidden)
    else:
        logits = out(hidden)
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


def _modules_after_decoder(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The causal LM's own children with parameters, other than (a parent of) the decoder, in order."""
    dec = decoder(model)
    return [
        child for _, child in model.named_children()
        if not any(m is dec for m in child.modules()) and next(child.parameters(), None) is not None
    ]


def verify_head(model: PreTrainedModel, forward=None, hybrid: bool = False) -> None:
    """Check once per model, before any pass, what sharedprefix relies on: base + ``head_logits`` equals the
    model's own logits, the forward is not random, positions and token convolutions (see the helpers), and
    which attention each layer computes (``attention.probe``). Raises ValueError for what cannot be exact.
    The caller's random stream is left as it was. Once per model and mode (training mode adds a check).
    ``forward``: what computes the model's own logits (default: ``model``; inside an FSDP2 root call, where the
    root's hooks already ran, its bound ``model.forward``).
    ``hybrid``: the model runs on the hybrid path (its own attention and convolutions, no probe).
    """
    modes = _VERIFIED.setdefault(model, set())
    if (model.training, hybrid) in modes:
        return
    device = streams.head_device(model)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad(), \
            streams.framed(model, decoder(model)):  # a K-stream model reads these ids as frames of one code
        _verify(model, device, model if forward is None else forward, hybrid)
    modes.add((model.training, hybrid))


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
    errs = []
    for chain in (None, _modules_after_decoder(model)):
        if chain is not None:
            _HEADS[model] = chain
        try:
            ours = head_logits(model, hidden).float()
        except (RuntimeError, TypeError) as e:  # a candidate head that does not even apply: not this one
            errs.append(f"{type(e).__name__}")
            _HEADS.pop(model, None)
            continue
        if ours.shape == ref.shape and torch.allclose(ours, ref, rtol=1e-3, atol=tol):
            if not hybrid and not probed:  # the hybrid path runs the model's own attention, not sharedprefix's
                probe.probe(model, dec, _config_attention_layers(model))
            return
        errs.append(f"{float((ours - ref).abs().max()):.3g}" if ours.shape == ref.shape else f"shape {tuple(ours.shape)}")
        _HEADS.pop(model, None)
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
    if not all(a is None or torch.equal(a, b) for a, b in zip(before, after)):
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
    ran = []
    hooks = [
        mod.register_forward_hook(lambda m, *_, n=mod_name: ran.append((n, type(m).__name__)))
        for mod_name, mod in model.named_modules()
        if isinstance(mod, torch.nn.Conv1d) and any(mod is m for m in dec.modules())
    ]
    try:
        numbered = dec(input_ids=ids, **positions.decoder_kwargs(dec, torch.arange(ids.shape[1], device=ids.device)[None]),
                       use_cache=False).last_hidden_state[0]
    finally:
        for h in hooks:
            h.remove()
    if ran and not convolutions_allowed:  # 1-d convolutions that run on a text-only row mix tokens; patch/audio encoders do not run here
        raise ValueError(
            f"{name} contains a convolution over tokens ({ran[0][0]}: {ran[0][1]}); layers that mix tokens outside "
            "attention cannot share a prompt through attention, and this model type is not one whose layer states "
            f"sharedprefix carries ({', '.join(sorted(HYBRID_MODEL_TYPES))}), so it refuses this model."
        )
    if not positions.takes_position_ids(dec):
        if convolutions_allowed:  # the hybrid path continues the model's own cache, whose length numbers completions
            return False
        probe.probe(model, dec, _config_attention_layers(model))
        positions.verify(model, dec, ids)
        return True
    close = lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6 * max(1.0, float(b.abs().max())))  # noqa: E731
    if close(numbered, hidden):
        return False
    pad = getattr(text_config(model), "pad_token_id", None)
    if isinstance(pad, int) and _numbers_after_padding(dec, ids, hidden, pad, close):
        _PADDING_NUMBERED[model] = pad
        return False
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
    token inside (which keeps the position of the padding index and does not advance the count)."""
    with_pad = torch.cat([ids[:, :1], torch.full_like(ids[:, :1], pad), ids[:, 1:]], 1)
    for row, own in ((ids, hidden), (with_pad, None)):
        if own is None:
            own = dec(input_ids=row, use_cache=False).last_hidden_state[0]
        ours = dec(input_ids=row, position_ids=padding_numbered(row, pad), use_cache=False).last_hidden_state[0]
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
        out.append(padding_numbered(path, pad)[-segs[s].length:])
    return torch.cat(out)[None]
