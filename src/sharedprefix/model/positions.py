"""Positions for decoders that number their tokens themselves: renumber their position-embedding module.

Most decoders take ``position_ids``, and sharedprefix gives each token of a packed row its position in its own
plain row (a completion continues its prompt). The BART family's decoders (BART, mBART, PLBART, Marian, Pegasus,
Blenderbot, BigBird-Pegasus) take none: the decoder numbers its input ``cache_length + 0..L-1`` and hands those
numbers to its position-embedding module, whose ``forward`` takes ``position_ids``. sharedprefix renumbers that
module's call only: inside ``renumbered(model, position_ids)`` a forward pre-hook replaces the ``position_ids``
the decoder passes with the packed row's; the hook is removed on exit, also on error, and the model's code and
attributes are never changed.

MusicGen's decoders hand their sinusoidal position module no numbers at all, only the input and a cache length
(``embed_positions(input, cache_length)``, which numbers its L positions ``cache_length + 0..L-1``). Such a module
(its ``forward`` takes ``cache_length`` or ``past_key_values_length``, and no ``position_ids``) is renumbered by a
forward hook instead: it calls the module's own ``forward`` once per window of L consecutive positions that the
packed row's positions need (``cache_length`` = the window's first position; a few windows, one per run of
positions not yet covered) and returns, for each token, the row of its position, taken along the output's
sequence dimension (the one ``verify`` saw grow with the row).

``verify`` (once per model, before any pass, from ``model.checks.verify_head``) finds the modules of the decoder
whose ``forward`` takes ``position_ids`` and holds the renumbering to the model's own forward on a short row:
renumbered with the row's own positions 0..n-1, the decoder's output is unchanged; renumbered with positions
s..s+n-1, each module returns what it returns for the last n tokens of a plain row of s + n tokens (so the
numbers mean what the model means by them, learned offsets and sinusoids included, and the module does not
ignore them). A decoder with no such module, or one the check does not confirm, is refused.

What the check cannot see, and the zoo and ``tests/model/test_renumbered_positions.py`` hold to plain rows
instead: a position the decoder derives elsewhere (a relative bias computed in its own attention code bypasses
transformers' attention interface, and ``attention.probe`` refuses it first).

Notation: L = packed row length, n = verification row length, s = its shift, d = hidden size.
"""

from __future__ import annotations

import bisect
import inspect
import weakref
from contextlib import contextmanager
from typing import cast

import torch

# model -> {position module verified to take the packed row's numbers:
#   None (its position_ids are replaced) or its output's sequence dimension (renumbered by cache-length windows)}
_MODULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
SHIFT = 2  # s: the verification row's positions start here
COUNT_ARGS = ("cache_length", "past_key_values_length")  # a module numbering its input from this offset itself


def takes_position_ids(dec: torch.nn.Module) -> bool:
    """True when the decoder's ``forward`` takes ``position_ids`` (the common case: nothing to renumber)."""
    return "position_ids" in _params(dec.forward)


def decoder_kwargs(dec: torch.nn.Module, position_ids: torch.Tensor) -> dict:
    """``{"position_ids": position_ids}`` for a decoder that takes them, else ``{}`` (its modules are renumbered)."""
    return {"position_ids": position_ids} if takes_position_ids(dec) else {}


def _params(fn) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def candidates(dec: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder's own modules (not the decoder) whose ``forward`` takes ``position_ids``."""
    return [m for m in dec.modules() if m is not dec and "position_ids" in _params(m.forward)]


def counting(dec: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder's own modules whose ``forward`` takes a cache length (``COUNT_ARGS``) and no ``position_ids``."""
    return [
        m
        for m in dec.modules()
        if m is not dec
        and "position_ids" not in _params(m.forward)
        and any(a in _params(m.forward) for a in COUNT_ARGS)
    ]


def _windowed(module: torch.nn.Module, dim: int, position_ids: torch.Tensor):
    """A forward hook: ``module``'s output for the (L,) ``position_ids``, from its own forward on windows of L
    consecutive positions (``cache_length`` = each window's start), gathered along ``dim``."""
    arg = next(a for a in COUNT_ARGS if a in _params(module.forward))
    pos = [int(p) for p in position_ids.tolist()]
    n, starts = len(pos), list[int]()
    for p in sorted(set(pos)):
        if not starts or p > starts[-1] + n - 1:
            starts.append(p)
    window = [bisect.bisect_right(starts, p) - 1 for p in pos]
    index = torch.tensor([w * n + p - starts[w] for p, w in zip(pos, window)], device=position_ids.device)

    def hook(mod, args, kwargs, output):
        if not isinstance(output, torch.Tensor) or output.dim() <= dim or output.shape[dim] != n:
            raise RuntimeError(
                f"{type(mod).__name__} returned {getattr(output, 'shape', type(output).__name__)} for a row of {n} "
                f"positions (its sequence dimension {dim} as verified); sharedprefix cannot renumber this call."
            )
        bound = inspect.signature(mod.forward).bind(*args, **kwargs)
        outs = []
        for start in starts:
            bound.arguments[arg] = start
            outs.append(mod.forward(*bound.args, **bound.kwargs))
        return torch.cat(outs, dim).index_select(dim, index.to(outs[0].device))

    return hook


def _with_positions(module, args, kwargs, position_ids):
    bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
    bound.arguments["position_ids"] = position_ids
    return bound.args, bound.kwargs


@contextmanager
def _hooked(modules: dict, position_ids: torch.Tensor | None):
    """Every module in ``modules`` ({module: None or its sequence dimension}) numbering its tokens with
    ``position_ids`` (L,) instead of the decoder's own numbers."""
    hooks = []
    try:
        for m, dim in modules.items() if position_ids is not None else ():
            if dim is None:
                hooks.append(
                    m.register_forward_pre_hook(
                        lambda mod, args, kwargs: _with_positions(mod, args, kwargs, position_ids), with_kwargs=True
                    )
                )
            else:
                hooks.append(
                    m.register_forward_hook(_windowed(m, dim, cast(torch.Tensor, position_ids)), with_kwargs=True)
                )
        yield
    finally:
        for h in hooks:
            h.remove()


@contextmanager
def renumbered(model, dec: torch.nn.Module, position_ids: torch.Tensor):
    """Run ``dec`` on a packed row with (1, L) ``position_ids``: yields the keyword arguments to call it with
    (``position_ids`` itself for a decoder that takes them) and, for a decoder ``verify`` renumbered, hooks its
    position modules for the duration."""
    if takes_position_ids(dec):
        yield {"position_ids": position_ids}
        return
    modules = _MODULES.get(model)
    if modules is None:
        raise RuntimeError(
            f"{type(model).__name__}'s decoder takes no position_ids and was not verified (positions.verify) before a "
            "sharedprefix pass, so its positions cannot be renumbered. This is a bug in the caller: every pass must "
            "follow modeling.verify_head."
        )
    with _hooked(modules, position_ids.reshape(-1)):
        yield {}


def _outputs(dec, modules: dict, ids, position_ids=None):
    """(decoder output, {module: [outputs of its calls]}) of ``dec`` on ``ids``, renumbered when given positions."""
    seen: dict = {m: [] for m in modules}
    with _hooked(modules, position_ids):  # recorded after the renumbering hooks: what the decoder receives
        hooks = [m.register_forward_hook(lambda mod, _a, out: seen[mod].append(out)) for m in modules]
        try:
            out = dec(input_ids=ids, use_cache=False).last_hidden_state
        finally:
            for h in hooks:
                h.remove()
    return out, seen


def refuse(name: str, why: str):
    raise ValueError(
        f"{name}'s decoder takes no position_ids: it numbers the tokens of its input 0..L-1 itself, {why}. "
        "sharedprefix packs a prompt and its completions in one row, where each completion's positions must continue "
        "its prompt's, so it refuses this model rather than give each completion the wrong positions."
    )


def _grown(own, ours, s: int) -> int | None:
    """The one dimension along which tensor ``own`` is ``s`` longer than tensor ``ours`` (None: no such)."""
    if not isinstance(own, torch.Tensor) or not isinstance(ours, torch.Tensor) or own.dim() != ours.dim():
        return None
    dims = [i for i, (a, b) in enumerate(zip(own.shape, ours.shape)) if a != b]
    if len(dims) != 1 or own.shape[dims[0]] != ours.shape[dims[0]] + s:
        return None
    return dims[0]


def _tail(own: torch.Tensor, ours: torch.Tensor, s: int) -> torch.Tensor | None:
    """``own``'s last positions along the one dimension where it is ``s`` longer than ``ours`` (None: no such)."""
    dim = _grown(own, ours, s)
    return None if dim is None else own.narrow(dim, s, ours.shape[dim])


def forget(model) -> None:
    """Drop ``verify``'s findings for ``model`` (``checks.forget``)."""
    _MODULES.pop(model, None)


def verify(model, dec: torch.nn.Module, ids: torch.Tensor, positionless: bool = False) -> None:
    """Find and check the position modules of a decoder without ``position_ids`` (see the module docstring) on
    (1, n) token ``ids``; raise ValueError when they cannot be renumbered exactly. ``positionless``: the decoder has
    no attention layer and every token mixer follows the segment tree (``mixers.attention_free``), so a decoder
    without position modules has nothing to renumber. Idempotent."""
    name = type(model).__name__
    mods = dict.fromkeys(candidates(dec))
    if not mods:
        mods = dict.fromkeys(counting(dec), 0)  # sequence dimensions found below
    if not mods and positionless:
        _MODULES[model] = {}
        return
    if not mods:
        refuse(
            name,
            "and none of its modules takes position_ids or a cache length, so sharedprefix has no call to renumber",
        )
    n, s = ids.shape[1], SHIFT
    longer = torch.cat([ids[:, :s], ids], 1)
    own_hidden, short = _outputs(dec, mods, ids)
    _, own = _outputs(dec, mods, longer)
    mods = {m: d for m, d in mods.items() if own[m]}  # modules that run in the decoder's forward
    if not mods:
        refuse(name, "and none of its modules that take position_ids or a cache length runs in its forward")
    for m, d in mods.items():
        if d is not None:  # the one dimension of its output that grew by s with the row
            dims = [_grown(a, b, s) for a, b in zip(own[m], short[m])]
            if len(set(dims)) != 1 or dims[0] is None or len(own[m]) != len(short[m]):
                refuse(
                    name,
                    f"and its position module {type(m).__name__} (which takes a cache length) returns no "
                    f"tensor with one dimension that grows with the row",
                )
            mods[m] = dims[0]
    device = ids.device
    try:
        same_hidden, _ = _outputs(dec, mods, ids, torch.arange(n, device=device))
        _, ours = _outputs(dec, mods, ids, torch.arange(s, s + n, device=device))
    except (TypeError, RuntimeError, IndexError) as e:  # the model's own code on the numbers it was given: refused
        refuse(
            name,
            f"and it fails when its position modules ({_names(mods)}) are given position_ids ({type(e).__name__}: {e})",
        )
    close = lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6 * max(1.0, float(b.abs().max())))  # noqa: E731
    if not close(same_hidden, own_hidden):
        refuse(
            name,
            f"and giving its position modules ({_names(mods)}) the row's own positions 0..{n - 1} changes "
            "its output, so they do not take the numbers sharedprefix would give them",
        )
    for m in mods:
        pairs = list(zip(own[m], ours[m]))
        tails = [
            _tail(a, b, s) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else None for a, b in pairs
        ]
        if len(own[m]) != len(ours[m]) or any(t is None or not close(b, t) for t, (_, b) in zip(tails, pairs)):
            refuse(
                name,
                f"and its position module {type(m).__name__}, given positions {s}..{s + n - 1}, does not "
                f"return what it returns for the last {n} tokens of a plain row of {s + n}",
            )
    _MODULES[model] = mods


def _names(mods) -> str:
    return ", ".join(sorted({type(m).__name__ for m in mods}))
