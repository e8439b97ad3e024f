"""Token mixers outside attention on the packed path: short convolutions and gated delta rules, driven from the row's
segment tree at the seams transformers calls for them.

The gated delta-nets (Qwen3-Next, Qwen3.5, OLMo-hybrid, Lara-mini) and LFM2's and LFM3's short convolutions call
two functions of their modeling module by name: ``causal_conv1d_fn(x, weight, bias, activation=...)`` on (1, C, L)
inputs and ``torch_chunk_gated_delta_rule(q, k, v, g=..., beta=..., initial_state=..., ...)`` on (1, L, H, D) ones;
Kimi delta attention (Kimi Linear, Bailing-hybrid) calls ``chunk_kimi_delta_attention`` (``model.kda``). Inside
``active(model)`` (one sharedprefix call; also during its backward, so that gradient checkpointing recomputes the
same way) those module attributes are wrapped, and forward hooks on the mixer modules say which layer calls
them; on exit all are restored. Where a mixer holds the module's function in its own ``__dict__`` (transformers 5.10's
gated delta-nets bind ``self.chunk_gated_delta_rule = ... or torch_chunk_gated_delta_rule`` when built, and call
that), the instance attribute is set to the same wrapper for the same duration and put back on exit (also on error),
so a checkpointed recompute inside the call's backward reaches it too; a mixer holding another function there (a
kernel package's) is refused. Nothing else is set on the model, the mixers' forwards run unchanged, and outside a pass
the wrappers call the model's own functions. Where there is no ``causal_conv1d_fn`` (LFM2 under transformers 5.10 runs
its ``nn.Conv1d``), a hook on that Conv1d is the convolution's seam (``model.mixers_conv``).

Inside a pass (``attention.interface.pass_state``) a wrapper computes what the plain row computes for every segment
(``layout.recurrence``): the convolution reads the last K inputs of the segment's path, the delta rule starts each
segment from its parent's final state, one call per tree level (segments right-padded with zero keys, values, beta
and decay, which leave a delta-rule state unchanged, as the model's own chunk padding does). A recorded segment's
conv tail (1, C, K) and final recurrent state (H, Dk, Dv) go to the prefix cache like its K/V (``write_state``),
and later passes read them back (``read_state``). A mixer whose forward ran without reaching its seams is refused.
The Mamba2 mixers (Mamba2, Nemotron-H, Falcon-H1, Zamba2, Bamba, Granite-4 hybrid) reach the same convolution and
``mamba2_chunk_scan``, whose packed form (zero-step padding) is ``model.ssm.scan``; its final state is (H, P, N).

Notation: L = row length, C = conv channels, K = conv kernel - 1, H = value heads, Dk / Dv = key / value head dims.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import contextmanager

import torch

from sharedprefix.layout.recurrence import conv_index, level_index
from sharedprefix.model import mixers_conv, ssm
from sharedprefix.model.kda import packed_kda

# model types whose mixers run here (their old cache-driven path, ``schedule.hybrid``, no longer takes them)
PACKED_MODEL_TYPES = {"lfm2", "lfm2_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid"} | ssm.MODEL_TYPES
PACKED_MODEL_TYPES |= {"lfm3", "lara_mini", "kimi_linear", "bailing_hybrid"}
PACKED_LAYER_TYPES = {"conv", "linear_attention", "hybrid"}  # "hybrid": a Mamba2 mixer beside attention
SEAMS = {"conv": "causal_conv1d_fn", "delta": "torch_chunk_gated_delta_rule", "scan": ssm.SEAM, "kda": "chunk_kimi_delta_attention"}
MIXERS = {"GatedDeltaNet": ("conv", "delta"), "ShortConv": ("conv",), **ssm.MIXERS}  # class-name suffix -> its seams
MIXERS["DeltaAttention"] = ("conv", "kda")  # Kimi delta attention (``model.kda``)

_CURRENT: list[tuple] = []  # (mixer module, its seams' call counts at entry) of the forwards running, innermost last
_INSTALLED: dict = {}  # (modeling module, attribute) -> [the model's own function, nesting count]
_ACTIVE: dict[int, int] = {}  # id(model) -> nesting count of ``active`` on it


def check_active(model) -> None:
    """Raise unless ``model``'s mixers are driven from the layout (a packed pass outside ``active`` would mix tokens
    across the row's segments)."""
    if is_packed(model) and not _ACTIVE.get(id(model)):
        raise RuntimeError(
            f"a packed pass of {type(model).__name__} ran outside model.mixers.active(model): its convolutions and "
            "recurrences would read across the row's segments. This is a bug in the caller."
        )


def is_packed(model) -> bool:
    """Whether ``model``'s language model (a vision-language model's too) is of a type whose mixers run here."""
    return getattr(model.config.get_text_config(), "model_type", None) in PACKED_MODEL_TYPES


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
    for m, kinds in mods:
        src = sys.modules[type(m).__module__]
        missing = [
            SEAMS[k] for k in kinds if not callable(getattr(src, SEAMS[k], None)) and not (k == "conv" and mixers_conv.find(m) is not None)
        ]
        if missing:
            raise ValueError(
                f"{name}: {type(m).__name__}'s modeling module {src.__name__} has no {missing}, the functions "
                "sharedprefix wraps to carry each segment's convolution inputs and recurrent state (nor, for a "
                "convolution, one causal depthwise nn.Conv1d submodule to hook), so it refuses the model rather than "
                "mix tokens across the packed row."
            )
        for k in kinds:  # a function bound on the instance when built (5.10) must be the module's, which is wrapped
            own = _INSTALLED[(src, SEAMS[k])][0] if (src, SEAMS[k]) in _INSTALLED else getattr(src, SEAMS[k], None)
            for attr, v in vars(m).items():
                if SEAMS[k].endswith(attr) and callable(v) and v is not own and v is not getattr(src, SEAMS[k], None):
                    raise ValueError(
                        f"{name}: {type(m).__name__} holds {attr!r} = {getattr(v, '__module__', '?')}."
                        f"{getattr(v, '__qualname__', type(v).__name__)}, bound when the model was built, not its "
                        f"modeling module's {SEAMS[k]} (which sharedprefix wraps to carry each segment's state, also "
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
    """Wrap the mixers' seams and hook their modules for the duration (see the module docstring)."""
    mods = mixer_modules(model) if is_packed(model) else []
    keys, hooks, bound, depth = [], [], [], len(_CURRENT)
    _ACTIVE[id(model)] = _ACTIVE.get(id(model), 0) + 1
    try:
        for m, kinds in mods:
            src = sys.modules[type(m).__module__]
            for kind in kinds:
                key = (src, SEAMS[kind])
                if not callable(getattr(src, SEAMS[kind], None)):  # no function: the Conv1d's hook
                    continue
                if key not in keys:
                    if key not in _INSTALLED:
                        own = getattr(src, SEAMS[kind])
                        _INSTALLED[key] = [own, 0, seam_wrapper(kind, own)]
                        setattr(src, SEAMS[kind], _INSTALLED[key][2])
                    _INSTALLED[key][1] += 1
                    keys.append(key)
                own, _, seam = _INSTALLED[key]
                for attr in [a for a, v in vars(m).items() if v is own]:  # bound on the instance when built (5.10)
                    bound.append((m, attr, own))
                    vars(m)[attr] = seam
            hooks.append(m.register_forward_pre_hook(_enter))
            hooks.append(m.register_forward_hook(_leave(kinds)))
            hooks += mixers_conv.hooks(m, kinds)  # the module seam (``model.mixers_conv``)
        yield
    finally:
        _ACTIVE[id(model)] -= 1
        if not _ACTIVE[id(model)]:
            del _ACTIVE[id(model)]
        del _CURRENT[depth:]  # a forward that raised left its entry
        for h in hooks:
            h.remove()
        for m, attr, own in reversed(bound):
            vars(m)[attr] = own
        for key in keys:
            entry = _INSTALLED[key]
            entry[1] -= 1
            if entry[1] == 0:
                setattr(key[0], key[1], entry[0])
                del _INSTALLED[key]


def _state():
    from sharedprefix.attention import interface

    return interface.current_pass()


def current_mixer():
    """The mixer module whose forward is running innermost (None outside one)."""
    return _CURRENT[-1][0] if _CURRENT else None


def _enter(module, args):
    state = _state()  # the seams' calls so far, to check that this forward reaches them
    _CURRENT.append((module, None if state is None else {k: state.mixed.get((module, k), 0) for k in SEAMS}))


def _leave(kinds):
    def hook(module, args, output):
        _, before = _CURRENT.pop()
        state = _state()
        if state is None or before is None:
            return
        missed = [SEAMS[k] for k in kinds if state.mixed.get((module, k), 0) == before[k]]
        if missed:
            raise ValueError(
                f"{type(module).__name__} ran its forward without calling {missed} (a kernel or code path sharedprefix "
                "does not wrap), so its tokens would mix across the packed row's segments; sharedprefix refuses it."
            )

    return hook


def seam_wrapper(kind: str, own):
    by_kind: dict[str, Callable] = {"conv": _conv, "delta": _delta, "scan": ssm.scan, "kda": packed_kda}
    packed = by_kind[kind]

    def seam(*args, **kwargs):
        state = _state()
        if state is None or not _CURRENT or state.write_state is None:  # outside a pass: the model's own function
            return own(*args, **kwargs)
        module = _CURRENT[-1][0]
        first = (module, kind) not in state.mixed  # a checkpointed layer recomputed in backward does not record again
        state.mixed[(module, kind)] = state.mixed.get((module, kind), 0) + 1
        return packed(own, state, (module, kind), first, *args, **kwargs)

    seam.__wrapped__ = own  # type: ignore[attr-defined]
    return seam


def _memo(layout, key, build):
    if key not in layout.derived:
        layout.derived[key] = build()
    return layout.derived[key]


def _conv(own, state, slot, first, x, *args, **kwargs):
    """``causal_conv1d_fn`` over a packed (1, C, L) row: each segment after the K inputs of its path."""
    layout = state.layout
    weight = args[0] if args else kwargs["weight"]
    K = int(weight.shape[-1]) - 1
    if x.shape[0] != 1 or x.shape[-1] != layout.length:
        raise RuntimeError(f"a convolution got inputs of shape {tuple(x.shape)}, expected (1, C, {layout.length}); a bug.")
    idx = _memo(layout, ("conv", K, x.device), lambda: _to(conv_index(layout, K), x.device))
    parts = [x.new_zeros(x.shape[0], x.shape[1], 1), x] + [state.read_state(slot, c) for c in idx.cached]
    source = torch.cat(parts, -1) if len(parts) > 1 else parts[0]
    y = own(source.index_select(-1, idx.ext), *args, **kwargs)
    tails = {s: source.index_select(-1, ix) for s, ix in idx.record.items()}  # also when recomputed: the same ops
    if first:
        for s, t in tails.items():
            state.write_state(slot, s, t)
    return y.index_select(-1, idx.out)


def _to(idx, device):
    from sharedprefix.layout.recurrence import ConvIndex

    return ConvIndex(idx.cached, idx.ext.to(device), idx.out.to(device), {s: t.to(device) for s, t in idx.record.items()})


def _delta(own, state, slot, first, query, key, value, g=None, beta=None, initial_state=None, output_final_state=False, **kwargs):
    """``torch_chunk_gated_delta_rule`` over a packed row: one call per level, each segment from its parent's state."""
    layout = state.layout
    if initial_state is not None or kwargs.get("cu_seqlens") is not None or query.shape[:2] != (1, layout.length):
        raise RuntimeError(
            f"a gated delta rule got queries {tuple(query.shape)} with an initial state or cu_seqlens on a packed row "
            f"of {layout.length} tokens (the model ran with a cache); a bug."
        )
    return delta_by_levels(own, state, slot, first, (query, key, value, g, beta), **kwargs)


def by_levels(state, slot, first, tensors, call):
    """A recurrence over a packed row of (1, L, ...) ``tensors``: one ``call(batch, init) -> (out, final states)``
    per tree level, ``batch`` the tensors' (B, T, ...) rows of the level's segments right-padded with zeros (the
    callers make zeros neutral: no decay, no input), ``init`` their parents' stacked final states (this row's
    previous level, or the prefix cache; None for the roots); records the recorded segments' final states when
    ``first``. Returns the (1, L, ...) outputs in row order."""
    layout = state.layout
    segs = layout.tree.segments
    padded = [torch.cat([t[0], t.new_zeros((1,) + t.shape[2:])]) for t in tensors]  # (L + 1, ...): row L is the pad
    final: dict = {}
    outs: list = []
    for lv in levels_of(layout, tensors[0].device):
        parents = [segs[s].parent for s in lv.segments]
        init = None
        if parents[0] is not None:  # a level below the roots: every segment has a parent, here or in the cache
            init = torch.stack([final[p] if p in final else state.read_state(slot, p) for p in parents])
        o, fs = call([t[lv.gather] for t in padded], init)
        outs.append(o.reshape(-1, *o.shape[2:]).index_select(0, lv.valid))
        final.update(zip(lv.segments, fs.unbind(0)))
    if first:
        for s in layout.record:
            state.write_state(slot, s, final[s])
    return torch.cat(outs)[None]


def delta_by_levels(own, state, slot, first, tensors, **kwargs):
    """A delta rule ``own(q, k, v, g=, beta=, initial_state=, output_final_state=True, **kwargs)`` over the packed
    (q, k, v, g, beta) ``tensors`` (``by_levels``; zero pads are neutral for it: no decay, no write). Returns
    ((1, L, H, Dv) outputs, None), as the function returns without final states."""

    def call(ts, init):
        q, k, v, g, beta = ts
        return own(q, k, v, g=g, beta=beta, initial_state=init, output_final_state=True, **kwargs)

    return by_levels(state, slot, first, tensors, call), None


def levels_of(layout, device) -> list:
    """The row's levels (``layout.recurrence.level_index``) on ``device``, built once per layout."""
    return _memo(layout, ("levels", device), lambda: [_level_to(lv, device) for lv in level_index(layout)])


def _level_to(lv, device):
    from sharedprefix.layout.recurrence import Level

    return Level(lv.segments, lv.gather.to(device), lv.valid.to(device))
