"""The seams of the packed path: the modeling module's functions (and modules) that a mixer calls to mix tokens,
wrapped for the duration of one sharedprefix call, and the hooks that say which mixer is calling.

A mixer's forward calls functions of its modeling module by name: ``causal_conv1d_fn`` (``conv``),
``torch_chunk_gated_delta_rule`` (``delta``), ``chunk_kimi_delta_attention`` (``kda``), ``mamba2_chunk_scan``
(``ssm``). Each is one ``Kind`` of seam: the attribute to wrap and the packed function that stands in for it inside a
pass. Inside ``active(model, mixers)`` (one sharedprefix call; also during its backward, so that gradient
checkpointing recomputes the same way) those module attributes are wrapped, and forward hooks on the mixer modules
say which layer calls them; on exit all are restored. Where a mixer holds the module's function in its own
``__dict__`` (transformers 5.10's gated delta-nets bind ``self.chunk_gated_delta_rule = ... or
torch_chunk_gated_delta_rule`` when built, and call that), the instance attribute is set to the same wrapper for
the same duration and put back on exit (also on error), so a checkpointed recompute inside the call's backward
reaches it too. Nothing else is set on the model, the mixers' forwards run unchanged, and outside a pass the
wrappers call the model's own functions. A kind may also name a submodule seam (``find``, ``hooks``): the
convolution's ``nn.Conv1d`` where a modeling module has no ``causal_conv1d_fn`` (``conv_module``).

Inside a pass (``attention.interface.pass_state``) a wrapper calls its kind's packed function, which computes what
the plain row computes for every segment (``layout.recurrence``). A mixer whose forward ran without reaching its
seams is refused. This module imports no family file: the families (``families``) hand it their kinds.

Notation: L = row length; a seam's slot is (mixer module, kind name), the key of its calls and cached states.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Kind:
    """One kind of seam. ``name``: the key of its calls and cached states ("conv", "delta", "kda", "scan");
    ``attribute``: the modeling module's function the mixers call by name; ``packed(own, state, slot, first, *args,
    **kwargs)``: what stands in for that call inside a pass (``own`` the model's function, ``slot`` (mixer, name),
    ``first`` False when a checkpointed layer is recomputed in backward); ``find(mixer)`` / ``hooks(mixer, kind)``:
    a submodule seam where the modeling module has no such function (the module, and the hooks' handles)."""

    name: str
    attribute: str
    packed: Callable
    find: Callable[[torch.nn.Module], torch.nn.Module | None] | None = None
    hooks: Callable[[torch.nn.Module, Kind], list] | None = None


_CURRENT: list[tuple] = []  # (mixer module, its seams' call counts at entry) of the forwards running, innermost last
_INSTALLED: dict = {}  # (modeling module, attribute) -> [the model's own function, nesting count, the wrapper]
_ACTIVE: dict[int, int] = {}  # id(model) -> nesting count of ``active`` on it


def is_active(model) -> bool:
    """Whether a call of ``active`` on ``model`` is running."""
    return bool(_ACTIVE.get(id(model)))


def own_function(src, kind: Kind):
    """The modeling module ``src``'s own function for ``kind`` (the one a wrapper installed there stands for)."""
    key = (src, kind.attribute)
    return _INSTALLED[key][0] if key in _INSTALLED else getattr(src, kind.attribute, None)


@contextmanager
def active(model, mods: list[tuple[torch.nn.Module, tuple[Kind, ...]]]):
    """Wrap the seams of ``mods`` (the model's mixers and their kinds) and hook the mixers for the duration."""
    keys, hooks, bound, depth = [], [], [], len(_CURRENT)
    _ACTIVE[id(model)] = _ACTIVE.get(id(model), 0) + 1
    try:
        for m, kinds in mods:
            src = sys.modules[type(m).__module__]
            for kind in kinds:
                key = (src, kind.attribute)
                if not callable(getattr(src, kind.attribute, None)):  # no function: the submodule's hook
                    continue
                if key not in keys:
                    if key not in _INSTALLED:
                        own = getattr(src, kind.attribute)
                        _INSTALLED[key] = [own, 0, seam_wrapper(kind, own)]
                        setattr(src, kind.attribute, _INSTALLED[key][2])
                    _INSTALLED[key][1] += 1
                    keys.append(key)
                own, _, seam = _INSTALLED[key]
                for attr in [a for a, v in vars(m).items() if v is own]:  # bound on the instance when built (5.10)
                    bound.append((m, attr, own))
                    vars(m)[attr] = seam
            hooks.append(m.register_forward_pre_hook(_enter(kinds)))
            hooks.append(m.register_forward_hook(_leave(kinds)))
            for kind in kinds:  # the submodule seams (``conv_module``)
                hooks += kind.hooks(m, kind) if kind.hooks is not None else []
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


def current_pass():
    """The pass running (``attention.interface.current_pass``), None outside one."""
    from sharedprefix.attention import interface

    return interface.current_pass()


def current_mixer():
    """The mixer module whose forward is running innermost (None outside one)."""
    return _CURRENT[-1][0] if _CURRENT else None


def _enter(kinds: tuple[Kind, ...]):
    def hook(module, args):
        state = current_pass()  # the seams' calls so far, to check that this forward reaches them
        _CURRENT.append(
            (module, None if state is None else {k.name: state.mixed.get((module, k.name), 0) for k in kinds})
        )

    return hook


def _leave(kinds: tuple[Kind, ...]):
    def hook(module, args, output):
        _, before = _CURRENT.pop()
        state = current_pass()
        if state is None or before is None:
            return
        missed = [k.attribute for k in kinds if state.mixed.get((module, k.name), 0) == before[k.name]]
        if missed:
            raise ValueError(
                f"{type(module).__name__} ran its forward without calling {missed} (a kernel or code path sharedprefix "
                "does not wrap), so its tokens would mix across the packed row's segments; sharedprefix refuses it."
            )

    return hook


def seam_wrapper(kind: Kind, own):
    """The function installed for ``own`` (the model's function of ``kind``): ``kind.packed`` inside a pass and a
    mixer's forward, ``own`` elsewhere."""
    packed = kind.packed

    def seam(*args, **kwargs):
        state = current_pass()
        if state is None or not _CURRENT or state.store is None:  # outside a pass: the model's own function
            return own(*args, **kwargs)
        module = _CURRENT[-1][0]
        slot = (module, kind.name)
        first = slot not in state.mixed  # a checkpointed layer recomputed in backward does not record again
        state.mixed[slot] = state.mixed.get(slot, 0) + 1
        return packed(own, state, slot, first, *args, **kwargs)

    seam.__wrapped__ = own  # type: ignore[attr-defined]
    return seam
