"""Walks of a model's modules made once per call of ours (``once_per_call``): ``detect`` runs several times in one
call (its setup, its plan's fingerprint, the path choice, a step's checks), and each time it walked every module
twice (the tensor-parallel check, FSDP2's modules): 28 walks of a 4-microbatch step. Inside one call the model's
modules and their parameters cannot change (nothing runs but our passes), so their answers are kept for the call and
dropped at its end; outside a call (``memo`` with no call open) nothing is kept."""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_MEMO: contextvars.ContextVar[dict | None] = contextvars.ContextVar("sharedprefix_walks", default=None)


def once_per_call(fn: F) -> F:
    """``fn`` (an entry point of the API) with a memo of walks open for its duration (nested calls share the outer
    one's)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if _MEMO.get() is not None:
            return fn(*args, **kwargs)
        token = _MEMO.set({})
        try:
            return fn(*args, **kwargs)
        finally:
            _MEMO.reset(token)

    return wrapped  # type: ignore[return-value]


def memo(key: tuple, compute: Callable[[], Any]) -> Any:
    """``compute()``, kept under ``key`` (objects' ids: they outlive the call) while a call is open; an exception is
    not kept."""
    kept = _MEMO.get()
    if kept is None:
        return compute()
    if key not in kept:
        kept[key] = compute()
    return kept[key]
