"""Tiny random-weight configs of every causal-LM architecture transformers registers.

``tiny_config`` starts from the architecture's own config class and sets, wherever the class has them,
the sizes in ``SIZES``: width 32, 4 heads over 2 K/V heads, vocabulary 97, few small experts, latent
attention with a value head dim (6) unlike the query/key one (12), and windows and chunks of 4 tokens, so
that every feature bites on rows of a dozen tokens. Layer-type patterns keep every distinct type of the
default config, in the fewest layers (``_per_layer``). ``ARCH`` holds the few settings the generic sizes
cannot infer, ``VARIANTS`` extra entries that exercise a feature the default hides. Nothing here knows
sharedprefix; ``zoo.checks`` does.
"""

from __future__ import annotations

import dataclasses
import re

import torch

VOCAB = 97
NUM_LAYERS_MAX = 8  # layers kept so that every distinct layer type of the default config appears
WINDOW = 4  # sliding window / attention chunk (tokens): bites on the rows of LAYOUT

# (prompt length, completion lengths) per group: positions reach 15, beyond WINDOW.
LAYOUT = ((9, (5, 3, 6)), (4, (4,)))

# Size fields set wherever the architecture's config class has them.
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
    n_embd=32,
    n_layer=2,
    n_head=4,
    n_positions=128,
    n_inner=48,
    n_ctx=128,
    d_model=32,
    decoder_layers=2,
    decoder_attention_heads=4,
    decoder_ffn_dim=48,
    encoder_layers=2,
    encoder_attention_heads=4,
    encoder_ffn_dim=48,
    num_layers=2,
    num_heads=4,
    n_layers=2,
    n_heads=4,
    ffn_dim=48,
    num_kv_heads=2,
    embedding_size=32,
    # MoE: few small experts, two per token, a dense first layer where the config has one
    moe_intermediate_size=16,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    moe_k=2,
    moe_topk=2,
    n_shared_experts=1,
    shared_expert_intermediate_size=16,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    # multi-head latent attention: value head dim (6) != query/key head dim (8 + 4)
    kv_lora_rank=8,
    q_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=8,
    v_head_dim=6,
    # windows and chunks that bite on short rows
    sliding_window=WINDOW,
    attention_chunk_size=WINDOW,
    window_size=WINDOW,
    rotary_dim=4,
    # decoder use of encoder architectures (BERT-like): causal self-attention
    is_decoder=True,
    # other tables and widths that default to production sizes
    vocab_size_per_layer_input=VOCAB,
    hidden_size_per_layer_input=8,
    emb_dim=32,
    expert_ffn_hidden_size=16,
    shape_vocab_size=VOCAB,
    pronunciation_vocab_size=VOCAB,
    shape_embed_dim=8,
    pronunciation_embed_dim=8,
    encoder_hash_byte_group_vocab=VOCAB,
    linear_head_dim=8,
    linear_num_heads=4,
    hidden_size_global=32,
)


class NotBuildable(Exception):
    """The tiny config or the model cannot be built; the message says why."""


def architectures() -> dict[str, str]:
    """model_type -> causal-LM class name, as transformers registers them."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()


_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")
_TOKEN_ID = re.compile(r"(^|_)(pad|bos|eos|sep|cls|mask|unk|decoder_start|forced_eos)_token_id$")


def _per_layer(default, names: set[str]) -> dict:
    """Fewest layers (2..NUM_LAYERS_MAX) that keep every distinct layer type of the default config.

    Lists with one entry per layer are cut to that many layers; lists of layer indices are filtered.
    """
    count = next((k for k in _LAYER_COUNTS if k in names and isinstance(getattr(default, k, None), int)), None)
    if count is None:
        return {}
    total = getattr(default, count)
    lists = {k: v for k, v in vars(default).items() if k in names and isinstance(v, list) and v}
    per_layer = {k: v for k, v in lists.items() if len(v) == total}
    typed = [v for v in per_layer.values() if all(isinstance(x, str) for x in v)]
    n = 2
    while n < min(NUM_LAYERS_MAX, total) and any(set(v[:n]) != set(v) for v in typed):
        n += 1
    n = min(n, total) if total >= 2 else total
    out = {count: n}
    for k, v in per_layer.items():
        out[k] = [SIZES[k]] * n if k in SIZES else v[:n]
    for k, v in lists.items():
        if k in per_layer or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            continue
        if all(0 <= x < total for x in v) and v == sorted(set(v)):  # layer indices
            out[k] = [x for x in v if x < n]
    return out


def config_value(cfg, k):
    try:
        return getattr(cfg, k, None)
    except Exception:  # noqa: BLE001  (per-layer configs refuse global reads of per-layer attributes)
        return None


def _tiny(cls, extra: dict | None = None):
    """A tiny instance of config class ``cls`` (and of its sub-configs); ``extra`` wins, a dict value for a
    sub-config key is merged into that sub-config."""
    extra = dict(extra or {})
    names = _fields(cls)
    try:
        default = cls()
    except Exception:  # noqa: BLE001  (defaults that fail validation: try with the per-architecture settings)
        try:
            default = cls(**extra)
        except Exception as e:  # noqa: BLE001
            raise NotBuildable(f"{cls.__name__}() fails: {type(e).__name__}: {first_line(e)}") from e
    kw = {k: v for k, v in SIZES.items() if k in names}
    if "kv_lora_rank" in names:  # latent attention: K/V heads expand from the latent, one per query head,
        kw["num_key_value_heads"] = kw.get("num_attention_heads", 4)  # and RoPE covers qk_rope_head_dim
        if "head_dim" in kw:
            kw["head_dim"] = SIZES["qk_rope_head_dim"]
    for k in names:
        if _TOKEN_ID.search(k) and config_value(default, k) is not None:
            kw[k] = 0 if k.startswith("pad") else 1 if k.startswith("bos") else 2
    kw.update(_per_layer(default, names))
    for key in getattr(cls, "sub_configs", None) or {}:
        sub = config_value(default, key)
        if key in names and hasattr(sub, "to_dict") and hasattr(sub, "model_type"):
            kw[key] = _tiny(type(sub), extra.pop(key, None))
    kw.update(extra)
    try:
        return cls(**kw)
    except Exception as e:  # noqa: BLE001
        raise NotBuildable(f"{cls.__name__}(tiny sizes) fails: {type(e).__name__}: {first_line(e)}") from e


def first_line(e: BaseException, limit: int = 200) -> str:
    s = str(e).strip().splitlines()
    s = " ".join(x.strip() for x in s[:3]) if s else type(e).__name__
    return s if len(s) <= limit else s[: limit - 3] + "..."


_DELTA_NET = dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)
# DeepSeek sparse attention: the indexer keeps 4 keys per query, fewer than most tokens of LAYOUT's rows see, so the
# selection bites; 16 index heads, so that a key whose every head score the ReLU clips to 0 (a tie) is rare
_DSA = dict(index_topk=4, index_n_heads=16, index_head_dim=16)
_MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8, mamba_n_groups=1)

# Per-architecture settings the generic sizes cannot infer (a dict value configures that sub-config).
ARCH: dict[str, dict] = {
    # hybrids with one attention layer and one Mamba layer (their defaults would be cut to Mamba layers only)
    "bamba": dict(_MAMBA, attn_layer_indices=[1]),
    "granitemoehybrid": dict(_MAMBA, layer_types=["linear_attention", "full_attention"]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "mamba2": dict(num_heads=4, head_dim=16, n_groups=1, state_size=8, chunk_size=8),
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "lfm2": dict(layer_types=["conv", "full_attention"]),  # its default pattern would be cut to attention only
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    # hybrids: Mamba2 and gated delta-net layers as small as the rest (their defaults take minutes in float64)
    "falcon_h1": dict(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=4),
    "zamba2": dict(mamba_d_state=8, chunk_size=4),
    "minimax": dict(block_size=4),  # lightning attention's blocks bite on short rows
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),  # its default would be cut to recurrent only
    "qwen3_next": _DELTA_NET,
    "qwen3_5_text": _DELTA_NET,
    "qwen3_5_moe_text": _DELTA_NET,
    "qwen3_5": dict(text_config=_DELTA_NET),
    "qwen3_5_moe": dict(text_config=_DELTA_NET),
    "gemma3n_text": dict(num_kv_shared_layers=0),
    "gemma4_assistant": dict(text_config=dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)),
    "dots3_note": dict(
        vision_config=dict(adapter_in_dim=32, adapter_out_dim=32),
        audio_config=dict(adapter_input_size=32, adapter_out_dim=32, downsample_hidden_size=16),
        text_config=_DSA,
    ),
    "dots3_note_text": _DSA,
    "deepseek_v32": _DSA,
    "glm_moe_dsa": _DSA,
    "axk2": _DSA,
    "hy_v4": _DSA,
    # Kolibri 1.1: NVFP4 rounding of K/V needs head_dim % 16 == 0, index heads at most the query heads of key head
    # 0 (4 // 2); its indexer's pools, top-k, sink and local keys small enough to bite on LAYOUT's rows
    "kolibri1_1": dict(
        head_dim=16,
        index_num_heads=2,
        index_topk=2,
        index_pool_size=8,
        index_compression=2,
        index_num_local_tokens=2,
        index_num_sink_tokens=1,
    ),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    "zaya": dict(num_experts_per_tok=1),
    "zamba": dict(
        num_hidden_layers=4,
        layers_block_type=["linear_attention", "hybrid"] * 2,
        attn_layer_period=2,
        attn_layer_offset=1,
    ),
    "qwen4_exp_text": dict(
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4, indexer_compress_ratio=2
    ),
    "qwen4_exp": dict(
        text_config=dict(
            indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4, indexer_compress_ratio=2
        )
    ),
    "reformer": dict(
        axial_pos_shape=[8, 16],
        axial_pos_embds_dim=[16, 16],
        attention_head_size=8,
        local_attn_chunk_length=4,
        lsh_attn_chunk_length=4,
    ),
    "xlstm": dict(embedding_dim=32, num_heads=4),
    "dbrx": dict(attn_config=dict(rope_theta=10000.0, clip_qkv=8.0)),  # DbrxAttention reads both, unconditionally
    # attention-score soft-capping that bites on tiny random weights, whose scores are ~1e-3 (the default 50 does not)
    "gemma2": dict(attn_logit_softcapping=0.002),
    # Llama 4's query temperature (NoPE layers) grows every floor_scale positions: every 4 so that it bites
    "llama4_text": dict(floor_scale=4),
    "llama4": dict(text_config=dict(floor_scale=4)),
    "vaultgemma": dict(attn_logit_softcapping=0.002),
}

# Variants: an architecture with settings that exercise a feature its tiny default config does not, or that a
# refusal hides. name -> (model type, settings).
VARIANTS: dict[str, tuple[str, dict]] = {
    # Llama 4 without query temperature tuning: chunked attention within one chunk and across chunks
    "llama4_text+chunk_32": ("llama4_text", dict(attn_temperature_tuning=False, attention_chunk_size=32)),
    "llama4_text+chunk_4": ("llama4_text", dict(attn_temperature_tuning=False)),
    # MoE load-balancing loss (output_router_logits=True): Mixtral-style, with a shared expert, with sinks and windows
    "mixtral+router_aux_loss": ("mixtral", dict(output_router_logits=True)),
    "qwen2_moe+router_aux_loss": ("qwen2_moe", dict(output_router_logits=True)),
    "gpt_oss+router_aux_loss": ("gpt_oss", dict(output_router_logits=True)),
    # Gemma 2 without attention-score soft-capping: its sliding layers and final-logit soft-capping
    "gemma2+no_attn_softcap": ("gemma2", dict(attn_logit_softcapping=None)),
}


def entries() -> dict[str, str]:
    """Every zoo entry: each registered model type, then the variants -> causal-LM class name."""
    archs = architectures()
    return {**archs, **{name: archs[mt] for name, (mt, _) in VARIANTS.items() if mt in archs}}


def tiny_config(entry: str, **overrides):
    """The tiny config of a zoo entry, ``overrides`` set last (raises ``NotBuildable``)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type, settings = VARIANTS.get(entry, (entry, {}))
    return _tiny(CONFIG_MAPPING[model_type], {**ARCH.get(model_type, {}), **settings, **overrides})


def build(entry: str, seed: int = 0):
    """(model, attention implementation of its plain forward): float64, eval mode.

    The plain forward uses transformers' SDPA where the model supports it (exact in float64) and its
    eager attention otherwise. A config class that holds the model's config as a sub-config (MusicGen's
    ``decoder``) gives that sub-config, as ``AutoModelForCausalLM`` does for ``text_config``.
    """
    import transformers

    cfg = tiny_config(entry)
    cls = getattr(transformers, entries()[entry])
    want = getattr(cls, "config_class", None)
    if want is not None and not isinstance(cfg, want):
        cfg = next((c for c in all_configs(cfg) if isinstance(c, want)), cfg)
    impl = "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"
    try:
        torch.manual_seed(seed)
        model = cls._from_config(cfg, attn_implementation=impl)
        model.config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
        model = model.to(torch.float64).eval()
        if hasattr(model, "set_default_language"):  # X-MOD: one adapter per language
            model.set_default_language(model.config.languages[0])
    except Exception as e:  # noqa: BLE001
        raise NotBuildable(f"{cls.__name__}(tiny config) fails: {type(e).__name__}: {first_line(e)}") from e
    return model, impl


def float64_norms(model) -> list:
    """``testing.dtype_faithful_norms`` on each norm it can reproduce (transformers' RMSNorms compute in float32
    even in a float64 model); a norm it cannot is left as it is, and its float32 shows in the zoo's note.
    Returns the patched modules (``del mod.forward`` restores one)."""
    from sharedprefix.tools.reference import dtype_faithful_norms

    done = []
    for mod in model.modules():
        # a weight that is no parameter is a placeholder (Falcon-Mamba's weightless norms, of another width)
        if type(mod).__name__.endswith("Norm") and isinstance(getattr(mod, "weight", None), torch.nn.Parameter):
            try:
                dtype_faithful_norms(mod)
            except ValueError:
                continue
            if "forward" in vars(mod):
                done.append(mod)
    return done


def token_ids(model, seed: int = 0):
    """``ids(n)``: n random token ids that are not special tokens of the model's config, from a generator seeded
    with ``seed``; (K, n) codes for a model with K token streams per position."""
    from sharedprefix.model import streams

    special = set()
    for cfg in all_configs(model.config):
        for k, v in vars(cfg).items():
            if k.endswith(("token_id", "token_index", "token_ids")):
                special.update(x for x in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(x, int))
    allowed = torch.tensor([t for t in range(VOCAB) if t not in special and t > 2])
    g = torch.Generator().manual_seed(seed)
    k = streams.num_streams(model)
    shape = (lambda n: (k, n)) if k > 1 else (lambda n: (n,))
    return lambda n: allowed[torch.randint(0, len(allowed), shape(n), generator=g)]


def groups(model, seed: int = 0):
    """The zoo's groups: token ids that are not special tokens of the model's config (frames for a model with
    several token streams per position)."""
    import sharedprefix as sp
    from sharedprefix.model import streams

    ids = token_ids(model, seed)
    k = streams.num_streams(model)
    if k > 1:  # frames (MusicGen's codebooks): a BOS frame first, and the delay pattern's pads closing a completion
        return _frame_groups(model, k, ids)
    return [sp.Group(ids(p), [ids(t) for t in ts]) for p, ts in LAYOUT]


def _frame_groups(model, k: int, codes):
    """The zoo's groups for a model with ``k`` token streams: (k, length) frames in the ``LAYOUT`` shapes; each
    prompt opens with a frame of the BOS code, and the first completion ends as MusicGen's delay pattern does
    (stream i padded over its last i frames), so the pads' exclusion is exercised too."""
    import sharedprefix as sp

    cfg = model.config.get_text_config()
    out = []
    for gi, (p, ts) in enumerate(LAYOUT):
        prompt = codes(p)
        prompt[:, 0] = cfg.bos_token_id
        completions = [codes(t) for t in ts]
        if gi == 0:
            for i in range(1, k):
                completions[0][i, -i:] = cfg.pad_token_id
        out.append(sp.Group(prompt, completions))
    return out


def all_configs(cfg) -> list:
    out, stack = [], [cfg]
    while stack:
        c = stack.pop()
        out.append(c)
        stack += [v for v in vars(c).values() if hasattr(v, "to_dict") and hasattr(v, "model_type")]
    return out
