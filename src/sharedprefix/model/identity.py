"""What the checks made once per model read, as a key computed in microseconds: ``model_key``.

The head check (``checks.verify_head``, with the position, convolution and attention probes it runs) and the router
check (``router.verify``) each run a forward of the model, too slow for every call, so their findings are kept per
model. They stay true only while the model computes what it computed when they ran: the same modules in the same
places, each with the same ``forward`` (its class's, or one patched onto the instance, such as an accelerate wrapper
or a logit scale added after the first call), the same input and output vocabularies, the same float32 head mark.
``model_key`` collects these; a call whose key differs from the one the findings were made under checks again.

The key holds weak references to the modules and to forwards patched onto instances (such a forward is often bound
to its module, and a strong reference would keep the model alive in the caches keyed by it); a module or forward
that was replaced compares unequal even where the new object reuses the old one's address.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from sharedprefix.model import streams
from sharedprefix.model.adapter import has_float32_head


def model_key(model: torch.nn.Module) -> tuple:
    """(E, V, float32 head, (module, its class, the class's forward, its own ``forward`` attribute) for every module
    of ``model`` in a fixed walk order), equal between two calls exactly when none of these changed in between
    (E: input embedding entries, V: output vocabulary; the modules and instance forwards by weak reference).
    Weights and their values are not part of it: no check depends on them."""
    parts: list[Any] = []
    seen: set[int] = set()
    stack: list[Any] = [model]
    while stack:
        m = stack.pop()
        if m is None or id(m) in seen:  # an unset child; a module shared by two parents (tied, reused): once
            continue
        seen.add(id(m))
        cls = type(m)
        own = m.__dict__.get("forward")
        parts += (_ref(m), cls, cls.forward, None if own is None else _ref(own))
        children = m._modules
        if children:
            stack += reversed(children.values())
    return streams.embedding_size(model), streams.head_vocab(model), has_float32_head(model), tuple(parts)


def _ref(obj: object) -> object:
    """A weak reference to ``obj`` (the same object on every call while one is alive, so keys compare by identity
    first), or, for an object that takes none, its address and type."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return id(obj), type(obj)
