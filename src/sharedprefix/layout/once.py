"""Tensors derived once and kept with a plan (``schedule.call_plan.CallPlan``): its packed rows, their attention calls'
index tensors (and their copies on the device), a block mask, a recurrence's level index, a frame table.

They are built at a plan's first use, which may run under ``torch.inference_mode()`` (reference log-probs), and
served to every later call, which may run with grad; a tensor made in inference mode cannot be saved for backward
("Inference tensors cannot be saved for backward"), so each is built outside it (``built_once``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch


@contextlib.contextmanager
def outside_inference_mode() -> Iterator[None]:
    """Tensors made inside are normal ones without grad, even under ``torch.inference_mode()``."""
    with torch.inference_mode(False), torch.no_grad():
        yield


def built_once(store: dict, key: Hashable, build: Callable[[], Any]) -> Any:
    """``store[key]``, built by ``build()`` (``outside_inference_mode``) the first time it is asked for."""
    if key not in store:
        with outside_inference_mode():
            store[key] = build()
    return store[key]
