"""The registry of hybrid families: one table, model type -> which path it runs on and what its token mixers are,
and the model-level calls built on it (``active``, ``check_reachable``).

``FAMILIES[model_type]`` is a ``Family``. On the packed path (``PACKED``), ``mixers`` maps a mixer module's class-name
suffix (``...ShortConv``, ``...GatedDeltaNet``, ``...DeltaAttention``, the Mamba2 mixers) to the kinds of seams its
forward calls; each kind (``KINDS``: ``conv``, ``delta``, ``kda``, ``scan``) names the modeling module's function to
wrap and its packed form, which carries the per-level scan and its padding rule (the family files). On the cache
path (``CACHE``: ``schedule.cache_path``), ``inline`` names the module whose token mixing is computed inline, with no
function to wrap, and what it computes; every refusal of that path says so. A model type absent from the table has
no mixers sharedprefix carries: ``model.support`` refuses it if its layers mix tokens outside attention.

Adding a family whose mixers call known seams is one row here (``tests/model/test_registry.py`` does it); a new kind
of seam is a family file with a ``KIND`` added to ``KINDS``. This module imports the family files; they import
``levels`` and ``seams``, never this module.

Notation: a mixer's kinds are the names of its seams ("conv", "delta", "kda", "scan").
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from sharedprefix.model.mixers import conv, delta, kda, seams, ssm

PACKED, CACHE = "packed", "cache"
PACKED_LAYER_TYPES = {"conv", "linear_attention", "hybrid"}  # "hybrid": a Mamba2 mixer beside attention
KINDS: dict[str, seams.Kind] = {k.name: k for k in (conv.KIND, delta.KIND, ssm.KIND, kda.KIND)}


@dataclass(frozen=True)
class Family:
    """One family. ``path``: ``PACKED`` or ``CACHE``; ``mixers`` (packed): class-name suffix -> kinds of seams
    (keys of ``KINDS``); ``inline`` (cache): (the module that computes the token mixing inline, what it computes)."""

    path: str
    mixers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    inline: tuple[str, str] | None = None


GATED_DELTA = Family(PACKED, {"GatedDeltaNet": ("conv", "delta")})  # a gated delta rule after its convolutions
SHORT_CONV = Family(PACKED, {"ShortConv": ("conv",)})
KIMI_DELTA = Family(PACKED, {"DeltaAttention": ("conv", "kda")})  # Kimi delta attention (``kda``)


def mamba2(suffix: str) -> Family:
    """A Mamba2 family: its mixer's convolution and ``mamba2_chunk_scan`` (``ssm``)."""
    return Family(PACKED, {suffix: ("conv", "scan")})


FAMILIES: dict[str, Family] = {
    "qwen3_next": GATED_DELTA,
    "qwen3_5_text": GATED_DELTA,
    "qwen3_5_moe_text": GATED_DELTA,
    "olmo_hybrid": GATED_DELTA,
    "lara_mini": GATED_DELTA,
    "lfm2": SHORT_CONV,
    "lfm2_moe": SHORT_CONV,
    "lfm3": SHORT_CONV,
    "mamba2": mamba2("Mamba2Mixer"),
    "nemotron_h": mamba2("Mamba2Mixer"),  # NemotronHMamba2Mixer
    "falcon_h1": mamba2("FalconH1Mixer"),
    "zamba2": mamba2("MambaMixer"),  # Zamba2MambaMixer
    "bamba": mamba2("BambaMixer"),
    "granitemoehybrid": mamba2("HybridMambaLayer"),  # GraniteMoeHybridMambaLayer
    "kimi_linear": KIMI_DELTA,
    "bailing_hybrid": KIMI_DELTA,
    "minimax": Family(
        CACHE, inline=("MiniMaxLightningAttention", "lightning attention (a block-wise linear attention with decay)")
    ),
    "zaya": Family(
        CACHE,
        inline=(
            "ZayaCCAProjection",
            "token mixing (causal convolutions of queries and keys after an inline padding, values delayed by one "
            "token)",
        ),
    ),
}


def on_path(model_type, path: str) -> bool:
    """Whether ``model_type`` is a registered family of ``path`` (``PACKED`` or ``CACHE``)."""
    fam = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    return fam is not None and fam.path == path


def model_types(path: str) -> list[str]:
    """The registered model types of ``path``, sorted."""
    return sorted(t for t, fam in FAMILIES.items() if fam.path == path)


def on_packed_path(model) -> bool:
    """Whether ``model``'s language model (a vision-language model's too) is a family whose mixers run packed."""
    return on_path(getattr(model.config.get_text_config(), "model_type", None), PACKED)


def on_cache_path(model) -> bool:
    """Whether ``model`` runs on the cache path (``schedule.cache_path``). A multimodal wrapper around such a text
    model does not (``model.support`` refuses it)."""
    return on_path(getattr(model.config, "model_type", None), CACHE)


def mixer_suffixes() -> dict[str, tuple[str, ...]]:
    """Class-name suffix -> kinds, over every packed family (in table order): a mixer module is found by any of them."""
    out: dict[str, tuple[str, ...]] = {}
    for fam in FAMILIES.values():
        if fam.path == PACKED:
            out.update((s, k) for s, k in fam.mixers.items() if s not in out)
    return out


def check_active(model) -> None:
    """Raise unless ``model``'s mixers are driven from the layout (a packed pass outside ``active`` would mix tokens
    across the row's segments)."""
    if on_packed_path(model) and not seams.is_active(model):
        raise RuntimeError(
            f"a packed pass of {type(model).__name__} ran outside model.mixers.active(model): its convolutions and "
            "recurrences would read across the row's segments. This is a bug in the caller."
        )


def attention_free(model) -> bool:
    """Whether every layer of a packed model is one of its mixers (no attention layer: Mamba2, or all-conv LFM2)."""
    types = _layer_types(model)
    return on_packed_path(model) and bool(types) and all(str(t) in PACKED_LAYER_TYPES - {"hybrid"} for t in types)


def _layer_types(model) -> list:
    cfg = model.config.get_text_config()
    return list(getattr(cfg, "layer_types", None) or getattr(cfg, "layers_block_type", None) or ())


def mixer_modules(model) -> list[tuple[torch.nn.Module, tuple[str, ...]]]:
    """The language model's mixers and their seams. Only the language model's (``get_decoder()``): a vision tower's
    own mixers (LFM3-VL's 2-D ShortConv over each image's patch grid) see one image at a time, once per prompt as in
    the plain run, and are none of the row's."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else model
    suffixes = mixer_suffixes()
    out = []
    for m in (dec if isinstance(dec, torch.nn.Module) else model).modules():
        for suffix, kinds in suffixes.items():
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
            f"modules named *{' or *'.join(mixer_suffixes())}: it cannot reach the token mixing of every layer, so it "
            "refuses the model (this transformers version's modeling code differs from the one sharedprefix knows)."
        )
    for m, names in mods:
        src = sys.modules[type(m).__module__]
        kinds = [KINDS[k] for k in names]
        # a Conv1d to hook (``conv_module``)
        module_seam = [k.find is not None and k.find(m) is not None for k in kinds]
        missing = [
            k.attribute
            for k, sub in zip(kinds, module_seam)
            if not callable(getattr(src, k.attribute, None)) and not sub
        ]
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
                if (
                    k.attribute.endswith(attr)
                    and callable(v)
                    and v is not own
                    and v is not getattr(src, k.attribute, None)
                ):
                    raise ValueError(
                        f"{name}: {type(m).__name__} holds {attr!r} = {getattr(v, '__module__', '?')}."
                        f"{getattr(v, '__qualname__', type(v).__name__)}, bound when the model was built, not its "
                        f"modeling module's {k.attribute} (which sharedprefix wraps to carry each segment's state, "
                        "also where the instance holds it): its forward would mix tokens across the packed row, so "
                        "sharedprefix refuses the model. Run without the kernel package that function comes from "
                        "(transformers then binds its own torch function)."
                    )


def conv_modules(model) -> set[int]:
    """ids of the Conv1d modules inside the packed mixers (their convolution runs through the wrapped seam)."""
    if not on_packed_path(model):
        return set()
    return {id(c) for m, _ in mixer_modules(model) for c in m.modules() if isinstance(c, torch.nn.Conv1d)}


@contextmanager
def active(model):
    """Wrap the mixers' seams and hook their modules for the duration of one call (``seams.active``)."""
    mods = mixer_modules(model) if on_packed_path(model) else []
    with seams.active(model, [(m, tuple(KINDS[k] for k in names)) for m, names in mods]):
        yield
