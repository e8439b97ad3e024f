"""The Mamba2 chunked scan on the packed path: each segment of a level scanned from its parent's final state.

The Mamba2 mixers of transformers (Mamba2, Nemotron-H, Falcon-H1, Zamba2, Bamba, Granite-4 hybrid) call, by
module-global name, ``causal_conv1d_fn`` (wrapped as LFM2's, ``conv.packed_conv``) and
``mamba2_chunk_scan(x (1, L, H, P), dt (1, L, H), A (H,), B (1, L, G, N), C (1, L, G, N), chunk_size=, D=,
dt_bias=, dt_softplus=True, dt_limit=, initial_states=, return_final_states=)``. ``scan`` stands in for that call on a
packed row: one call of the model's own function per tree level, its segments right-padded to the longest, each
from its parent's final state (``initial_states``), through the level loop the delta rules use (``levels.by_levels``).

Padding: zero inputs are not neutral for this scan as the mixers call it, since the function turns dt into
``clamp(softplus(dt + dt_bias), *dt_limit) > 0`` at every position, which decays the state and adds B x to it.
``scan`` therefore discretises dt itself, with the function's own ops in dt's dtype (``discretize``: bit for bit the
values the function would compute), pads with dt = 0 (exp(0 * A) = 1: no decay; 0 * x: no input, so a padded
segment's final state is the state at its last token) and calls the model's function with ``dt_bias=None,
dt_softplus=False`` and a ``dt_limit`` of (-inf, inf), which leaves every value unchanged. The output at the padded
positions is dropped.

Notation: L = row length, H = SSM heads, P = head dim, G = B/C groups, N = state size, B = segments of one level
(``layout.recurrence.level_index``), T = the longest of them; a final state is (H, P, N).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sharedprefix.model.mixers.levels import by_levels
from sharedprefix.model.mixers.seams import Kind

UNCHANGED = (float("-inf"), float("inf"))  # a dt_limit whose clamp returns every value as it is


def discretize(dt: torch.Tensor, dt_bias, dt_softplus: bool, dt_limit) -> torch.Tensor:
    """The step sizes ``mamba2_chunk_scan`` computes from its arguments, by the same ops in the same dtype:
    ``clamp(softplus(dt + dt_bias), *dt_limit)`` (each part as the function applies it)."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    return torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])


def _neutral_padding(dt, dt_bias, dt_softplus, dt_limit):
    """(dt discretised here, the arguments that make the model's function take it as it is): zero-padded, it is 0."""
    return discretize(dt, dt_bias, dt_softplus, dt_limit), dict(dt_bias=None, dt_softplus=False, dt_limit=UNCHANGED)


def scan(
    own, state, slot, first, hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
    dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs,
):  # fmt: skip
    """``mamba2_chunk_scan`` over a packed row (see the module): ``(1, L, H, P)`` out, in the function's dtype."""
    layout = state.layout
    odd = {k: v for k, v in kwargs.items() if v is not None and k != "z"}  # z=None: the torch forward gates outside
    if (
        initial_states is not None
        or return_final_states
        or odd
        or kwargs.get("z") is not None
        or hidden_states.shape[:2] != (1, layout.length)
    ):
        raise RuntimeError(
            f"a Mamba2 scan got inputs {tuple(hidden_states.shape)} with an initial state, final states, a gate z or "
            f"{sorted(odd)} on a packed row of {layout.length} tokens (the model ran with a cache or a kernel's "
            "arguments); a bug."
        )
    dt, neutral = _neutral_padding(dt, dt_bias, dt_softplus, dt_limit)

    def call(ts, init):
        x, d, b, c = ts
        return own(x, d, A, b, c, chunk_size=chunk_size, D=D, initial_states=init, return_final_states=True, **neutral)

    return by_levels(state, slot, first, (hidden_states, dt, B, C), call)


KIND = Kind("scan", "mamba2_chunk_scan", scan)
