"""Short causal convolutions on the packed path: ``causal_conv1d_fn(x, weight, bias, activation=...)`` on (1, C, L),
each segment after the last K inputs of its own path.

LFM2's and LFM3's short convolutions, and the convolutions in front of the gated delta-nets, Kimi delta attention and
the Mamba2 mixers, call this function of their modeling module by name. Inside a pass the wrapper (``seams``) calls
``packed_conv``: the row's inputs are gathered, per segment, after the K inputs that precede it on its path (its
ancestors' last tokens, from this row or from the prefix cache, zeros before a root), the model's own function runs
once over that extended row, and the outputs of the real tokens come back in row order. A recorded segment's conv
tail (1, C, K) goes to the prefix cache like its K/V. Where a modeling module has no ``causal_conv1d_fn``, the
mixer's own ``nn.Conv1d`` is the seam (``conv_module``), with this same function behind it.

Notation: L = row length, C = conv channels, K = conv kernel - 1.
"""

from __future__ import annotations

import torch

from sharedprefix.layout.recurrence import ConvIndex, conv_index
from sharedprefix.model.mixers import conv_module
from sharedprefix.model.mixers.levels import memo
from sharedprefix.model.mixers.seams import Kind


def packed_conv(own, state, slot, first, x, *args, **kwargs):
    """``causal_conv1d_fn`` over a packed (1, C, L) row: each segment after the K inputs of its path."""
    layout = state.layout
    weight = args[0] if args else kwargs["weight"]
    K = int(weight.shape[-1]) - 1
    if x.shape[0] != 1 or x.shape[-1] != layout.length:
        raise RuntimeError(
            f"a convolution got inputs of shape {tuple(x.shape)}, expected (1, C, {layout.length}); a bug."
        )
    idx = memo(layout, ("conv", K, x.device), lambda: _to(conv_index(layout, K), x.device))
    parts = [x.new_zeros(x.shape[0], x.shape[1], 1), x] + [state.store.read_state(slot, c) for c in idx.cached]
    source = torch.cat(parts, -1) if len(parts) > 1 else parts[0]
    y = own(source.index_select(-1, idx.ext), *args, **kwargs)
    tails = {s: source.index_select(-1, ix) for s, ix in idx.record.items()}  # also when recomputed: the same ops
    if first:
        for s, t in tails.items():
            state.store.write_state(slot, s, t)
    return y.index_select(-1, idx.out)


def _to(idx, device):
    return ConvIndex(
        idx.cached, idx.ext.to(device), idx.out.to(device), {s: t.to(device) for s, t in idx.record.items()}
    )


KIND = Kind("conv", "causal_conv1d_fn", packed_conv, find=conv_module.find, hooks=conv_module.hooks)
