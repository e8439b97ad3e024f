"""Which attention implementation a model runs during a sharedprefix call: ``activated(model)`` switches every
config of the model (not its encoders': vision towers and audio encoders keep their own attention) to the
shared-prefix attention, ``attention.interface.NAME``, or to ``attention.indexed.NAME`` for a model with indexed
layers, and restores them on exit, also on error. The model's code is never edited."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import PreTrainedConfig

from sharedprefix.attention import indexed
from sharedprefix.attention.interface import NAME, current_pass


def _encoder_configs(model: torch.nn.Module) -> set[int]:
    """ids of the sub-configs of encoders (vision towers, audio encoders) next to the text model: their attention
    runs once per prompt inside a pass, with the model's own implementation, never the shared-prefix one."""
    top = getattr(model, "config", None)
    if not isinstance(top, PreTrainedConfig):
        return set()
    text = top.get_text_config()
    out = set()
    for key in getattr(top, "sub_configs", {}) or {}:
        sub = getattr(top, key, None)
        if isinstance(sub, PreTrainedConfig) and sub is not text and sub is not top:
            out.add(id(sub))
    return out


def model_configs(model: torch.nn.Module) -> list[PreTrainedConfig]:
    seen, out = _encoder_configs(model), []
    for m in model.modules():
        cfg = vars(m).get("config")  # an instance attribute (a getattr that misses raises in nn.Module.__getattr__)
        if isinstance(cfg, PreTrainedConfig) and id(cfg) not in seen:
            seen.add(id(cfg))
            out.append(cfg)
    # sub-configs (text/vision) reachable from the top config
    stack = list(out)
    while stack:
        cfg = stack.pop()
        for key in getattr(cfg, "sub_configs", {}) or {}:
            sub = getattr(cfg, key, None)
            if isinstance(sub, PreTrainedConfig) and id(sub) not in seen:
                seen.add(id(sub))
                out.append(sub)
                stack.append(sub)
    return out


def implementation(model: torch.nn.Module) -> str:
    """The attention implementation ``activated`` switches ``model`` to: ``indexed.NAME`` for a model with indexed
    layers (DeepSeek sparse attention), else ``NAME``."""
    return indexed.NAME if indexed.is_indexed(model_configs(model)) else NAME


@contextmanager
def activated(model: torch.nn.Module):
    """Switch every config of ``model`` to the sharedprefix attention (``indexed.NAME`` for a model with indexed
    layers, whose indexers also get ``indexed.key_hooks`` for the duration); restore them on exit."""
    configs = model_configs(model)
    name = implementation(model)
    saved = [cfg._attn_implementation_internal for cfg in configs]
    hooks = indexed.key_hooks(model, current_pass) if name == indexed.NAME else []
    try:
        for cfg in configs:
            cfg._attn_implementation_internal = name
        yield
    finally:
        for h in hooks:
            h.remove()
        for cfg, old in zip(configs, saved):
            cfg._attn_implementation_internal = old
