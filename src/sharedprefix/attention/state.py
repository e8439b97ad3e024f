"""The state of the pass running: the packed row's layout and what the attention function reads and records for it
(``PassState``), on a process-global stack (not a thread-local: autograd may run the recomputation of a checkpointed
layer on another thread). ``attention.interface`` attends with it and ``attention.checks`` checks against it; both
import it from here, so that neither imports the other back.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from sharedprefix.attention import compiled
from sharedprefix.layout.packing import RowLayout


class PrefixStore(Protocol):
    """The prefix cache of a call (``schedule.cache.PrefixCache``), per segment: an attention module's K/V, each
    (1, Hkv, len, D); an indexer's keys (1, len, D) (``attention.indexed``); a token mixer's state outside attention,
    keyed by (mixer module, seam): a conv tail, a recurrent state (``model.mixers``)."""

    def read_kv(self, module, seg: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def write_kv(self, module, seg: int, k: torch.Tensor, v: torch.Tensor) -> None: ...
    def read_index(self, indexer, seg: int) -> torch.Tensor: ...
    def write_index(self, indexer, seg: int, k: torch.Tensor) -> None: ...
    def read_state(self, slot, seg: int) -> torch.Tensor: ...
    def write_state(self, slot, seg: int, t: torch.Tensor) -> None: ...


@dataclass
class PassState:
    """What the attention function needs for one packed row.

    Attributes:
        layout: the row being computed.
        backend: implementation of the attention primitive (``attention.kernels.select``).
        store: the prefix cache the pass reads its cached ancestors from and writes ``layout.record`` to
            (``PrefixStore``), or None.
        seen: attention modules that ran in this pass (a layer recomputed by gradient
            checkpointing runs again; it must not record twice).
        visible: (1, 1, L, C + L) bool visibility mask of the row over the cached segments' and the row's keys,
            built on the first request of a model with indexed layers (``indexed_mask``), else None.
        mixed: (token mixer module, seam) -> calls of the seam in this pass (``model.mixers``).
        sequence: under sequence parallelism, the row's split (``parallel.sequence.SequenceShard``): the attention
            receives this rank's tokens for all heads and exchanges them for the whole row of its heads.
        io: a pass through compiled decoder layers: its handle and its layers' cached keys (``attention.compiled``).
        force_eager: compiled decoder layers run eager in this pass, also when checkpointing recomputes them.

    """

    layout: RowLayout
    backend: str = "auto"
    store: PrefixStore | None = None
    seen: dict = field(default_factory=dict)
    visible: torch.Tensor | None = None
    mixed: dict = field(default_factory=dict)
    sequence: Any = None  # ``parallel.sequence.SequenceShard`` of a sequence-parallel pass, else None
    io: Any = None  # ``attention.compiled.PassIO`` of a pass through compiled layers, else None
    force_eager: bool = False  # compiled layers that this pass runs eager (``schedule.compiled``)


_STACK: list[PassState] = []


def current_pass() -> PassState | None:
    """The state of the innermost pass running (None outside sharedprefix's passes)."""
    return _STACK[-1] if _STACK else None


@contextmanager
def pass_state(state: PassState):
    """Make ``state`` the layout the attention function uses (also during backward)."""
    _STACK.append(state)
    compiled.CURRENT.io = state.io
    try:
        with torch.compiler.set_stance("force_eager") if state.force_eager else nullcontext():
            yield state
    finally:
        for i in range(len(_STACK) - 1, -1, -1):  # by identity: states compare tensors otherwise
            if _STACK[i] is state:
                del _STACK[i]
                break
        compiled.CURRENT.io = _STACK[-1].io if _STACK else None
