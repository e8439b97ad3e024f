"""The per-level loop that every recurrence of the packed path shares: one call of the model's own function per level
of the row's segment tree, each segment started from its parent's final state.

A level (``layout.recurrence.level_index``) is the set of segments at one depth of the tree; its segments run as one
right-padded batch. The family files (``delta``, ``kda``, ``ssm``) make their zero padding neutral (no decay, no
input), so that a padded segment's final state is its state after its last real token; this module only gathers,
calls, scatters and records. It imports no family file.

Notation: L = row length, B = segments of one level, T = the longest of them, H = value heads, Dk / Dv = key / value
head dims; a final state is whatever the function returns per segment ((H, Dk, Dv) for a delta rule).
"""

from __future__ import annotations

import torch

from sharedprefix.layout.once import built_once
from sharedprefix.layout.recurrence import Level, level_index


def memo(layout, key, build):
    """``layout.derived[key]``, built once per layout by ``build()`` (``layout.once.built_once``)."""
    return built_once(layout.derived, key, build)


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
            init = torch.stack([final[p] if p in final else state.store.read_state(slot, p) for p in parents])
        o, fs = call([t[lv.gather] for t in padded], init)
        outs.append(o.reshape(-1, *o.shape[2:]).index_select(0, lv.valid))
        final.update(zip(lv.segments, fs.unbind(0)))
    if first:
        for s in layout.record:
            state.store.write_state(slot, s, final[s])
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
    return memo(layout, ("levels", device), lambda: [_level_to(lv, device) for lv in level_index(layout)])


def _level_to(lv, device):
    return Level(lv.segments, lv.gather.to(device), lv.valid.to(device))
