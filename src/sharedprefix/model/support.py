"""What sharedprefix can compute exactly, by model type and configuration: the refusals made before any pass.

``check_supported`` raises ValueError, naming the value, the reason and the fix, for every model feature that a
packed row cannot reproduce (dropout and layerdrop in training mode, RoPE scaling that depends on the batch, layers
that mix tokens outside attention unless the packed path or the cache path carries them). Which hybrid families run
on which path is the registry's answer (``model.mixers.FAMILIES``: ``on_packed_path``, ``on_cache_path``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from sharedprefix.model import mixers, streams, versions
from sharedprefix.model.adapter import ATTENTION_LAYER_TYPES, decoder, text_config

# Layer types (config.layer_types / layers_block_type) by what sharedprefix does with them (the attending ones:
# ``adapter.ATTENTION_LAYER_TYPES``).
NON_MIXING_LAYER_TYPES = {"mlp", "moe", "dense", "sparse"}  # per-token layers without any token mixing
COMPRESSED_ATTENTION_LAYER_TYPES = {  # DeepSeek-V4: attention over keys pooled from blocks of the row
    "compressed_sparse_attention": "attention over compressed keys (and indexer-selected ones among them)",
    "heavily_compressed_attention": "attention over compressed keys",
}
# Hybrid families (layers that mix tokens outside attention) are rows of ``mixers.FAMILIES``: on the packed path
# (their mixers driven from the segment tree) or on the cache path (``schedule.cache_path``: their own cache-aware
# forward continues a prompt's layer state, checked exact in tests/model/test_hybrid.py and the zoo); other hybrids are
# refused (``_check_layer_types``, ``_check_positions_and_convolutions``).


def inline_mixer_reason(model_type) -> str:
    """A sentence for the cache path's refusals of a family whose mixing is inline (``Family.inline``, with a
    leading space), else ""."""
    fam = mixers.FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if fam is None or fam.inline is None:
        return ""
    module, what = fam.inline
    return (
        f" It stays on that path because {module}'s {what} is computed inline in its forward, with no function "
        "sharedprefix can wrap, so the packed path (trees, gradient checkpointing, FSDP2, prompt_inputs) cannot reach "
        "it."
    )


# Hybrid model types that stay refused because their own forward cannot continue a prompt's layer state: why.
_MAMBA1 = (
    "its Mamba (v1) selective scan starts every multi-token forward from a zero state (transformers' torch scan and "
    "the mamba_ssm kernel take no initial state), so a completion batch cannot continue its prompt's recurrent state "
    "through the model's own forward; only the single-token decode reads that state, and it overwrites it in place, "
    "which autograd cannot differentiate through"
)
HYBRID_REFUSED = {
    "mamba": _MAMBA1,
    "falcon_mamba": _MAMBA1,
    "jamba": _MAMBA1,
    "zamba": _MAMBA1,
    "recurrent_gemma": (
        "it keeps its convolution and recurrent states on its own modules, not in the cache, and its multi-token "
        "forward restarts the convolution from zero inputs (only the single-token decode reads the previous ones), so "
        "a completion batch cannot continue its prompt's state through the model's own forward"
    ),
}
# Model types whose layers mix tokens by a recurrence, without layer_types to say so (refused in check_supported).
RECURRENT_MODEL_TYPES = {
    "rwkv": "RWKV's time mixing (a linear recurrence of exponentially decayed keys and values)",
    "xlstm": "xLSTM's mLSTM cells (a gated matrix-memory recurrence)",
}


def check_supported(model: PreTrainedModel, hybrid: bool = False) -> None:
    """Raise ValueError for every model feature sharedprefix cannot compute exactly. ``hybrid``: the model runs on
    the hybrid path (``schedule.cache_path``), which carries layer states that mix tokens outside attention."""
    cfg = text_config(model)
    name = type(model).__name__
    if not hybrid and mixers.on_path(
        getattr(cfg, "model_type", None), mixers.CACHE
    ):  # a wrapper around a cache-path text model
        raise ValueError(
            f"{name} (model type {getattr(model.config, 'model_type', None)!r}) is a multimodal wrapper around a "
            f"hybrid text model (model type {cfg.model_type!r}, whose layers mix tokens outside attention): "
            "sharedprefix runs hybrid models on its hybrid path, which takes the text model alone, without images. "
            f"Load the text model ({cfg.model_type!r}, e.g. AutoModelForCausalLM with the text config) to train on "
            "text."
        )
    if not hybrid:
        _check_layer_types(name, cfg)
        if mixers.on_packed_path(model):
            mixers.check_reachable(model)
    decoder(model)  # a decoder without position_ids is renumbered or refused in verify_head (positions.verify)
    drops = [getattr(cfg, k, None) for k in ("layerdrop", "decoder_layerdrop")]  # and the modules' own copies
    for mod_name, mod in model.named_modules():
        drops.append(vars(mod).get("layerdrop"))  # an instance attribute where a layer keeps one (a getattr that
        # misses raises inside nn.Module.__getattr__: the slow part of this walk)
        if model.training and isinstance(mod, torch.nn.Dropout) and mod.p > 0:
            raise ValueError(
                f"{name} is in training mode with dropout p={mod.p} at {mod_name}; a prompt shared by G completions "
                "would share one dropout draw, unlike the plain run. Disable dropout (config *_dropout=0.0, as RL "
                "fine-tuning normally does) or call model.eval()."
            )
    if model.training and float(getattr(cfg, "attention_dropout", 0.0) or 0.0) > 0:
        raise ValueError(
            f"{name} is in training mode with attention_dropout={cfg.attention_dropout}; sharedprefix refuses "
            "attention dropout because the shared prompt would share one dropout draw. Set "
            "config.attention_dropout=0.0."
        )
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
        odd = [
            type(m).__name__ for m in tuned if not all(hasattr(m, a) for a in ("floor_scale", "attn_scale", "use_rope"))
        ]
        if not tuned or odd:
            raise ValueError(
                f"{name} scales attention queries by the token's index in the row (attn_temperature_tuning), and "
                f"sharedprefix finds no Llama 4 attention module with floor_scale, attn_scale and use_rope "
                f"({odd or 'none'}) to rescale them to position ids, so a packed row would change the result. This "
                "model is not supported; set config.attn_temperature_tuning=False only if it was trained without it."
            )
    if model.get_output_embeddings() is None:
        raise ValueError(
            f"{name} has no LM head (get_output_embeddings() is None): sharedprefix computes log-probs of tokens, so "
            "it expects a causal LM. Load the class of this checkpoint that has a language-modeling head (e.g. through "
            "AutoModelForCausalLM, or AutoModelForImageTextToText for a vision-language model), not its base model."
        )
    streams.num_streams(model)  # several token streams per position: one embedding and one linear head each
    if getattr(model.config, "model_type", None) in POOLING_MODEL_TYPES:
        raise ValueError(f"{name}: {POOLING_MODEL_TYPES[model.config.model_type]}; sharedprefix refuses the model.")
    versions.check_version(model)  # last: a feature refused on every release is named first


# Models whose decoder pools tokens into larger units before attention runs over those units.
POOLING_MODEL_TYPES = {
    "blt": "the Byte Latent Transformer pools bytes into patches whose boundaries depend on the bytes (an entropy "
    "model), and its local layers cross-attend between bytes and patches: its layers mix tokens outside "
    "attention (pooling), which sharedprefix's packed rows cannot reproduce",
}


def _check_layer_types(name: str, cfg) -> None:
    recurrence = RECURRENT_MODEL_TYPES.get(getattr(cfg, "model_type", None) or "")
    if recurrence is not None:
        raise ValueError(
            f"{name}'s layers mix tokens outside attention: {recurrence}, carried from token to token, where "
            "sharedprefix shares a prompt through attention only; it refuses the model rather than give inexact "
            "results."
        )
    types = getattr(cfg, "layer_types", None) or getattr(cfg, "layers_block_type", None)
    kinds = {str(t) for t in types or ()}
    if mixers.on_path(getattr(cfg, "model_type", None), mixers.PACKED):
        kinds -= mixers.PACKED_LAYER_TYPES  # their mixers run on the packed path (checked in ``check_supported``)
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
            f"completions ({', '.join(mixers.model_types(mixers.CACHE))}), nor one whose token mixers it drives on the "
            f"packed path ({', '.join(mixers.model_types(mixers.PACKED))}){why}. It refuses the model rather than give "
            "inexact results."
        )
