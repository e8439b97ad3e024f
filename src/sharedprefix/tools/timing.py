"""The benchmarks' timing, written once: a device-synchronised timed call, the best of several after a warm-up,
and the best of each of several calls run interleaved (so that a machine's drift affects them alike)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def sync_device() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cpu_clock(cuda: bool = False) -> Callable[[], float]:
    """The process's CPU time on one CPU thread (other processes on a shared machine do not inflate it), else wall
    time."""
    return time.process_time if torch.get_num_threads() == 1 and not cuda else time.perf_counter


def timed(fn: Callable[[], Any], clock: Callable[[], float] = time.perf_counter) -> tuple[float, Any]:
    """(seconds, result) of one call of ``fn``, the device synchronised before and after."""
    sync_device()
    t0 = clock()
    result = fn()
    sync_device()
    return clock() - t0, result


def best_time(fn: Callable[[], Any], repeats: int, bar=None) -> float:
    """Best of ``repeats`` timed calls of ``fn`` after one warm-up call; ``bar`` (a tqdm progress bar, or None)
    advances by one after each call, outside the timed span."""
    fn()  # warm-up
    if bar is not None:
        bar.update()
    best = float("inf")
    for _ in range(repeats):
        best = min(best, timed(fn)[0])
        if bar is not None:
            bar.update()
    return best


def best_interleaved(
    calls: list[tuple[str, Callable[[], Any]]],
    before: Callable[[], Any] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, tuple[float, Any]]:
    """{name: (best seconds, result of that call)} over ``calls`` run in the order given (a name may repeat: its best
    counts); ``before`` runs untimed ahead of each call (zeroing gradients)."""
    out: dict[str, tuple[float, Any]] = {}
    for name, fn in calls:
        if before is not None:
            before()
        dt, res = timed(fn, clock)
        if name not in out or dt < out[name][0]:
            out[name] = (dt, res)
    return out
