"""Which attention each layer of the plain forward computes, read from the masks transformers builds for it.

A layer's sliding window or attention chunk is decided by the model's own code: per-layer ``layer_types``,
a window the layer passes, a window kept on the module, or a model-level mask built from
``config.sliding_window`` (Phi-MoE). Rather than guess from these, ``probe`` runs the decoder once per model
on a short row with a recording attention function whose masks are built by transformers' own SDPA mask
builder, and reads each layer's mask: causal, causal with a band (sliding window), causal within blocks
(chunked attention), or anything else (refused). So that the window is visible on a short row, every
window/chunk setting of the model's configs is set to a small distinct value during the probe (and restored);
the width of the band identifies the setting, and the layer's size at run time is that setting's real value
plus the probe's offset (a band one wider than the setting, say).

The probe also records which modules called the attention interface (a layer that bypasses it is refused
before any sharedprefix computation) and, as the attention output, returns zeros: only masks are read.

Notation: n = probe row length (3 times the largest small value, plus one), S = a probed setting's small
value (3, 6, 9, ...).
"""

from __future__ import annotations

import inspect
import re
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import cast

import torch
from transformers import AttentionInterface, PreTrainedConfig
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from sharedprefix.attention.dynamic_mask import has_dynamic_mask
from sharedprefix.model import streams

NAME = "sharedprefix_probe"
# not max_window_layers, nor Doge's keep_window_size (a top-k count of its dynamic mask, not a window)
_SETTING = re.compile(r"(?<!keep_)(window|window_size|window_len|window_length)$|^attention_chunk_size$")


@dataclass(frozen=True)
class LayerPattern:
    """The attention of one layer in the plain forward.

    Attributes:
        kind: "full" (causal), "sliding" (a query sees itself and the ``size - 1`` keys before it) or
            "chunked" (a query sees the keys of its own block of ``size`` positions, causally).
        size: tokens of the window or chunk, None for "full".
        setting: the config attribute that sets ``size`` ("" for "full").
        calls: how many times one forward runs this module (more than 1 in looped, recurrent-depth models).
        indexed: the module passes indexer-selected keys (``indices``, DeepSeek sparse attention) to attention.
    """

    kind: str
    size: int | None = None
    setting: str = ""
    calls: int = 1
    indexed: bool = False


# What the model's own attention code does, for the refusal of models whose attention bypasses the interface.
OWN_ATTENTION: dict[str | None, str] = {
    "bloom": "its own attention code adds ALiBi biases (a per-head slope times the key's position) to the scores",
    "mpt": "its own attention code adds ALiBi biases (a per-head slope times the key's position) to the scores",
    "xlnet": "its own two-stream relative-position attention (content and query streams), over the whole row in both "
    "directions unless config.attn_type='uni'",
}
_PATTERNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # attention module -> LayerPattern
_BY_MODEL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> attention modules probed
_LOG: list[dict] = []


def pattern(module) -> LayerPattern | None:
    """The probed pattern of an attention module, or None when its model was not probed."""
    return _PATTERNS.get(module)


def _record(module, query, key, value, attention_mask, **kwargs):
    if _LOG:
        if module in _LOG[-1]:
            _LOG[-1][module][2] += 1
        else:
            # transformers' SDPA runs a layer without a mask causally unless is_causal (argument, else the
            # module's attribute) is False
            causal = kwargs.get("is_causal")
            causal = getattr(module, "is_causal", True) if causal is None else causal
            _LOG[-1][module] = [
                attention_mask if causal or attention_mask is not None else "bidirectional",
                key.shape[-2],
                1,
                kwargs.get("indices") is not None,
            ]
    out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])
    return out, None


def _mask(*args, **kwargs):
    kwargs["allow_is_causal_skip"] = False  # always a tensor, also where the mask is plainly causal
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(NAME, _record)
AttentionMaskInterface.register(NAME, _mask)


def model_configs(model) -> list[PreTrainedConfig]:
    seen, out, stack = (
        set(),
        [],
        [m.config for m in model.modules() if isinstance(getattr(m, "config", None), PreTrainedConfig)],
    )
    while stack:
        cfg = stack.pop()
        if id(cfg) in seen:
            continue
        seen.add(id(cfg))
        out.append(cfg)
        for v in vars(cfg).values():  # sub-configs, and per-layer configs (Gemma 4)
            stack += [x for x in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(x, PreTrainedConfig)]
    return out


@contextmanager
def _probing(configs, settings):
    saved_attn = [cfg._attn_implementation_internal for cfg in configs]
    saved = [(cfg, k, getattr(cfg, k)) for cfg, k, _ in settings]
    try:
        for cfg in configs:
            cfg._attn_implementation_internal = NAME
        for cfg, k, small in settings:
            setattr(cfg, k, small)
        yield
    finally:
        for cfg, old in zip(configs, saved_attn):
            cfg._attn_implementation_internal = old
        for cfg, k, old in saved:
            setattr(cfg, k, old)


def _classify(mask: torch.Tensor | None, n: int, biased: bool = False) -> tuple[str, int | None]:
    """("full" | "sliding" | "chunked" | "other", visible keys or chunk size) of an (.., n, n) boolean mask, or of an
    additive float mask: 0 where allowed, or any finite bias where ``biased`` (Doge's dynamic mask)."""
    if mask is None:
        return "full", None  # no mask: the plain SDPA forward runs is_causal
    if isinstance(mask, str):
        return "other", None
    if mask.dtype != torch.bool:  # an additive float mask: 0 (or a bias) where allowed, min or -inf elsewhere
        mask = mask > torch.finfo(mask.dtype).min / 2 if biased else mask == 0
    if mask.dim() != 4 or mask.shape[-2:] != (n, n) or not (mask == mask[:1, :1]).all():
        return "other", None
    m = mask[0, 0].cpu()
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    causal = j <= i
    if torch.equal(m, causal):
        return "full", None
    for w in range(1, n):
        if torch.equal(m, causal & (i - j < w)):
            return "sliding", w
    for c in range(1, n):
        if torch.equal(m, causal & (i // c == j // c)):
            return "chunked", c
    return "other", None


def probe(model, decoder, expected_layers: int) -> dict:
    """Probe ``model`` (its ``decoder`` module) once; raise ValueError for a layer sharedprefix cannot reproduce.

    Returns {attention module: LayerPattern}, also kept for ``pattern``.
    """
    name = type(model).__name__
    configs = model_configs(model)
    settings: list[tuple] = []
    for cfg in configs:
        for k, v in sorted(vars(cfg).items()):  # the instance's own values (per-layer configs refuse getattr)
            if _SETTING.search(k) and isinstance(v, int) and not isinstance(v, bool) and v > 0:
                settings.append((cfg, k, 3 + 3 * len(settings)))  # 3 apart: a band one off names one setting
    smalls = {small: (cfg, k) for cfg, k, small in settings}
    n = 3 * (3 * len(settings) + 3) + 1
    device = next(model.parameters()).device
    # one embedding per token stream for MusicGen (the ids run as frames of one code)
    ids = (torch.arange(n, device=device) * 7 + 3).remainder(streams.embedding_size(model))[None]
    _LOG.append({})
    try:
        with _probing(configs, settings), torch.no_grad():
            numbered = "position_ids" in inspect.signature(decoder.forward).parameters  # else it numbers 0..n-1 itself
            decoder(
                input_ids=ids,
                use_cache=False,
                **({"position_ids": torch.arange(n, device=device)[None]} if numbered else {}),
            )
        log = _LOG[-1]
    except Exception as e:  # noqa: BLE001  (the model's own code: refused, with its error, never passed over)
        if not _LOG[-1] and not _uses_interface(model):
            raise ValueError(
                f"{name}'s attention bypasses transformers' attention interface (its modeling code never looks up "
                "ALL_ATTENTION_FUNCTIONS: its own attention, e.g. LSH or local attention), so prompt sharing cannot be "
                f"applied exactly; its decoder also fails on a probe row ({type(e).__name__}: {e}). This model is not "
                "supported."
            ) from e
        raise ValueError(
            f"{name}'s decoder fails on a probe row of {n} tokens with position_ids 0..{n - 1}, run the way "
            f"sharedprefix runs it ({type(e).__name__}: {e}); sharedprefix refuses the model."
        ) from e
    finally:
        _LOG.pop()
    if sum(c for _, _, c, _ in log.values()) < expected_layers:
        own = sorted(
            {
                type(m).__name__
                for m in decoder.modules()
                if "Attention" in type(m).__name__ and m not in log and not any(m in c.modules() for c in log)
            }
        )
        what = OWN_ATTENTION.get(getattr(model.config.get_text_config(), "model_type", None))
        detail = (" (" + ", ".join(own) + ")" if own else "") + (": " + what if what else "")
        raise ValueError(
            f"{name}: on a probe row the attention interface ran in {len(log)} of {expected_layers} layers; the "
            f"model's attention bypasses transformers' attention interface{detail}, so prompt sharing cannot be "
            "applied exactly. This model is not supported."
        )
    out = {}
    for module, (mask, kv_len, calls, indexed) in log.items():
        mod = type(module).__name__
        if kv_len != n:
            raise ValueError(
                f"{mod} attends over {kv_len} keys for a row of {n} tokens (e.g. memory or compressed keys); "
                "sharedprefix attends over the row's own keys only and refuses this model."
            )
        kind, seen = _classify(mask, n, biased=has_dynamic_mask(module))
        if kind == "other":
            raise ValueError(
                f"{mod} (in {name}) gets a mask from the plain forward that is neither causal nor a causal sliding "
                "window nor causal chunks (for example bidirectional, prefix-LM or token-dependent masks); "
                "sharedprefix only implements those three patterns and refuses the model."
            )
        size, setting = None, ""
        if kind != "full":
            # the setting whose small value explains the band/chunk (a band may be one wider or narrower)
            seen_n = cast(int, seen)  # a band or chunk has a size
            hit = next(((d, smalls[seen_n - d]) for d in (0, 1, -1) if seen_n - d in smalls), None)
            if hit is None:
                raise ValueError(
                    f"{mod} (in {name}) applies a {kind} attention of {seen} tokens in the plain forward that no "
                    "window or chunk setting of its config explains, so sharedprefix cannot tell its size on longer "
                    "rows and refuses the model."
                )
            d, (cfg, setting) = hit
            size = int(getattr(cfg, setting)) + d
        if indexed and kind != "full":
            raise ValueError(
                f"{mod} (in {name}) attends over indexer-selected keys (DeepSeek sparse attention) with a {kind} mask "
                "in the plain forward; sharedprefix hands the indexer the row's causal visibility only, so the "
                "selection would differ, and it refuses the model."
            )
        out[module] = LayerPattern(kind, size, setting, calls, indexed)
    _PATTERNS.update(out)
    _BY_MODEL[model] = len(out)
    return out


def _uses_interface(model) -> bool:
    """Whether the modeling code of ``model``'s class (or of a module inside it) looks up transformers' attention
    interface at all."""
    import sys

    for cls in {type(m) for m in model.modules()}:
        src = sys.modules.get(cls.__module__)
        if src is not None and "ALL_ATTENTION_FUNCTIONS" in vars(src):
            return True
    return False


def forget(model) -> None:
    """Drop what the probe found for ``model`` and its modules (``model.checks.forget``): a module whose forward was
    patched may no longer call attention at all."""
    _BY_MODEL.pop(model, None)
    for m in model.modules():
        _PATTERNS.pop(m, None)


def attention_modules(model) -> int | None:
    """How many distinct modules of ``model`` ran the attention interface in its probe (None: not probed)."""
    return _BY_MODEL.get(model)
