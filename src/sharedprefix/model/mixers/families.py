"""Which model types run their token mixers on the packed path, which mixer modules those are, and which seams each
calls: the lists of families, and the model-level calls built on them (``active``, ``check_reachable``).

A mixer module is found by its class-name suffix (``MIXERS``: ``...GatedDeltaNet``, ``...ShortConv``,
``...DeltaAttention``, the Mamba2 mixers) inside the language model only, and its seams are kinds from the family
files (``conv``, ``delta``, ``kda``, ``ssm``). This module imports the family files; they import ``levels`` and
``seams``, never this module.

Notation: a mixer's kinds are the names of its seams ("conv", "delta", "kda", "scan").
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch

from sharedprefix.model.mixers import conv, delta, kda, seams, ssm

# model types whose mixers run here (their old cache-driven path, ``schedule.cache_path``, no longer takes them)
SSM_MODEL_TYPES = {"mamba2", "nemotron_h", "falcon_h1", "zamba2", "bamba", "granitemoehybrid"}
PACKED_MODEL_TYPES = {"lfm2", "lfm2_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid"} | SSM_MODEL_TYPES
PACKED_MODEL_TYPES |= {"lfm3", "lara_mini", "kimi_linear", "bailing_hybrid"}
PACKED_LAYER_TYPES = {"conv", "linear_attention", "hybrid"}  # "hybrid": a Mamba2 mixer beside attention
KINDS: dict[str, seams.Kind] = {k.name: k for k in (conv.KIND, delta.KIND, ssm.KIND, kda.KIND)}
# class-name suffix -> its seams. The Mamba2 mixers: Mamba2Mixer (also NemotronHMamba2Mixer), FalconH1Mixer,
# MambaMixer (Zamba2MambaMixer), BambaMixer, HybridMambaLayer (GraniteMoeHybridMambaLayer)
MIXERS = {"GatedDeltaNet": ("conv", "delta"), "ShortConv": ("conv",)}
MIXERS |= {s: ("conv", "scan") for s in ("Mamba2Mixer", "FalconH1Mixer", "MambaMixer", "BambaMixer", "HybridMambaLayer")}
MIXERS["DeltaAttention"] = ("conv", "kda")  # Kimi delta attention (``kda``)


def is_packed(model) -> bool:
    """Whether ``model``'s language model (a vision-language model's too) is of a type whose mixers run here."""
    return getattr(model.config.get_text_config(), "model_type", None) in PACKED_MODEL_TYPES


def check_active(model) -> None:
    """Raise unless ``model``'s mixers are driven from the layout (a packed pass outside ``active`` would mix tokens
    across the row's segments)."""
    if is_packed(model) and not seams.is_active(model):
        raise RuntimeError(
            f"a packed pass of {type(model).__name__} ran outside model.mixers.active(model): its convolutions and "
            "recurrences would read across the row's segments. This is a bug in the caller."
        )


def attention_free(model) -> bool:
    """Whether every layer of a packed model is one of its mixers (no attention layer: Mamba2, or all-conv LFM2)."""
    types = _layer_types(model)
    return is_packed(model) and bool(types) and all(str(t) in PACKED_LAYER_TYPES - {"hybrid"} for t in types)


def _layer_types(model) -> list:
    cfg = model.config.get_text_config()
    return list(getattr(cfg, "layer_types", None) or getattr(cfg, "layers_block_type", None) or ())


def mixer_modules(model) -> list[tuple[torch.nn.Module, tuple[str, ...]]]:
    """The language model's mixers and their seams. Only the language model's (``get_decoder()``): a vision tower's
    own mixers (LFM3-VL's 2-D ShortConv over each image's patch grid) see one image at a time, once per prompt as in
    the plain run, and are none of the row's."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else model
    out = []
    for m in (dec if isinstance(dec, torch.nn.Module) else model).modules():
        for suffix, kinds in MIXERS.items():
            if type(m).__name__.endswith(suffix):
                out.append((m, kinds))
    return out


def check_reachable(model) -> None:
    """Refuse a packed-hybrid model whose mixers or seams cannot be found (a transformers version that renamed them)."""
    name = type(model).__name__
    mods = mixer_modules(model)
    types = _layer_types(model)
    want = sum(str(t) in PACKED_LAYER_TYPES for t in types)
    if len(mods) != want:
        raise ValueError(
            f"{name} has {want} layers of types {sorted(PACKED_LAYER_TYPES)} but sharedprefix finds {len(mods)} mixer "
            f"modules named *{' or *'.join(MIXERS)}: it cannot reach the token mixing of every layer, so it refuses "
            "the model (this transformers version's modeling code differs from the one sharedprefix knows)."
        )
    for m, names in mods:
        src = sys.modules[type(m).__module__]
        kinds = [KINDS[k] for k in names]
        module_seam = [k.find is not None and k.find(m) is not None for k in kinds]  # a Conv1d to hook (``conv_module``)
        missing = [k.attribute for k, sub in zip(kinds, module_seam) if not callable(getattr(src, k.attribute, None)) and not sub]
        if missing:
            raise ValueError(
                f"{name}: {type(m).__name__}'s modeling module {src.__name__} has no {missing}, the functions "
                "sharedprefix wraps to carry each segment's convolution inputs and recurrent state (nor, for a "
                "convolution, one causal depthwise nn.Conv1d submodule to hook), so it refuses the model rather than "
                "mix tokens across the packed row."
            )
        for k in kinds:  # a function bound on the instance when built (5.10) must be the module's, which is wrapped
            own = seams.own_function(src, k)
            for attr, v in vars(m).items():
                if k.attribute.endswith(attr) and callable(v) and v is not own and v is not getattr(src, k.attribute, None):
                    raise ValueError(
                        f"{name}: {type(m).__name__} holds {attr!r} = {getattr(v, '__module__', '?')}."
                        f"{getattr(v, '__qualname__', type(v).__name__)}, bound when the model was built, not its "
                        f"modeling module's {k.attribute} (which sharedprefix wraps to carry each segment's state, also "
                        "where the instance holds it): its forward would mix tokens across the packed row, so "
                        "sharedprefix refuses the model. Run without the kernel package that function comes from "
                        "(transformers then binds its own torch function)."
                    )


def conv_modules(model) -> set[int]:
    """ids of the Conv1d modules inside the packed mixers (their convolution runs through the wrapped seam)."""
    if not is_packed(model):
        return set()
    return {id(c) for m, _ in mixer_modules(model) for c in m.modules() if isinstance(c, torch.nn.Conv1d)}


@contextmanager
def active(model):
    """Wrap the mixers' seams and hook their modules for the duration of one call (``seams.active``)."""
    mods = mixer_modules(model) if is_packed(model) else []
    with seams.active(model, [(m, tuple(KINDS[k] for k in names)) for m, names in mods]):
        yield
