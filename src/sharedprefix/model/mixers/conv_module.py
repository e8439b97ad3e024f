"""The second kind of convolution seam: a mixer's own ``nn.Conv1d`` submodule, for modeling code that runs it directly.

``conv`` wraps the modeling module's ``causal_conv1d_fn``. Some transformers versions have none to wrap: LFM2
under transformers 5.10 binds ``causal_conv1d_fn`` to the causal_conv1d package's function, None without it, and
its ``Lfm2ShortConv.slow_forward`` (also what runs on CPU when the package is installed) calls ``self.conv(Bx)``, a
depthwise ``nn.Conv1d`` with zero padding K on both sides, and keeps the first L outputs. There the Conv1d is the
seam: for the duration of ``seams.active`` a forward hook on it replaces the module's (1, C, L + K) output, inside a
pass, with a tensor of the same shape whose first L columns are the packed convolution (``conv.packed_conv``: each
segment after the last K inputs of its own path, the same indices and the same cached tails, read and written as leaves,
so the budgets' keep / offload / recompute carry it) and whose last K columns are zeros (the modeling code drops them).
The module's own forward still runs first, over the whole packed row, and its output is discarded: one depthwise
convolution per layer of wasted work, an acceptable price for leaving the model's code unchanged. Outside a pass the
hook returns nothing and the module's output stands. The hook counts as a call of the seam, so the check that a
mixer's forward reached its seams (``seams._leave``) holds for this seam too. It is installed on every packed
mixer's qualifying Conv1d, whether or not the module has a ``causal_conv1d_fn``, and acts only when the Conv1d runs:
5.10's LFM2 runs it on CPU even with the package installed, and 5.24's mixers never call it.

Only a Conv1d that computes a causal depthwise convolution when its last K outputs are dropped qualifies: groups =
in = out channels, stride 1, dilation 1, zero padding of K = kernel - 1. A mixer whose convolution is none of these
(no such module, or another shape of convolution) has no seam here, and ``families.check_reachable`` refuses it.

Notation: L = row length, C = conv channels, K = kernel - 1 (the module's padding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sharedprefix.model.mixers import seams


def find(mixer: torch.nn.Module) -> torch.nn.Conv1d | None:
    """The mixer's one causal depthwise ``nn.Conv1d`` (see the module docstring), or None if it has not exactly one."""
    convs = [c for c in mixer.modules() if isinstance(c, torch.nn.Conv1d)]
    if len(convs) != 1:
        return None
    c = convs[0]
    K = c.kernel_size[0] - 1
    causal = c.stride == (1,) and c.dilation == (1,) and c.padding == (K,) and c.padding_mode == "zeros"
    return c if causal and c.groups == c.in_channels == c.out_channels else None


def hooks(mixer: torch.nn.Module, kind: seams.Kind) -> list:
    """Hook the mixer's Conv1d (if it has one) as a seam of the convolution ``kind``; the handles to remove."""
    conv = find(mixer)
    if conv is None:
        return []
    K = conv.padding[0]

    def causal(x, weight):  # the model's own convolution, made causal: (1, C, n) -> (1, C, n)
        return F.conv1d(x, weight, conv.bias, padding=K, groups=conv.groups)[..., : x.shape[-1]]

    seam = seams.seam_wrapper(kind, causal)

    def hook(module, args, output):
        state = seams.current_pass()
        if state is None or state.store is None or seams.current_mixer() is not mixer:
            return None  # outside a pass (or the Conv1d called from elsewhere): the module's own output
        (x,) = args
        if output.shape != (*x.shape[:-1], x.shape[-1] + K):
            raise RuntimeError(
                f"{type(mixer).__name__}'s Conv1d gave {tuple(output.shape)} for {tuple(x.shape)}; a bug."
            )
        y = seam(x, conv.weight)  # (1, C, L)
        return torch.cat([y, y.new_zeros(*y.shape[:-1], K)], -1)  # (1, C, L + K), as the module's output

    return [conv.register_forward_hook(hook)]
