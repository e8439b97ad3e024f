"""Saved-tensor hooks that move a pass's saved activations off the device until its backward
(``prefix_activations="offload"``): ``OffloadHooks``."""

from __future__ import annotations

import weakref

import torch

from sharedprefix.parallel.tensor import is_dtensor


class _Offloaded:
    """One saved tensor moved off the device: its host copy, and, once fetched, its device copy and the events that
    order the copies (None on the CPU, where there is nothing to overlap)."""

    __slots__ = ("device", "host", "nbytes", "stored", "dev", "ready", "__weakref__")

    def __init__(self, device, host, stored):
        self.device, self.host, self.stored = device, host, stored
        self.nbytes = host.numel() * host.element_size()
        self.dev = self.ready = None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


class OffloadHooks:
    """Saved-tensor hooks that move a pass's saved activations to ``device`` until backward.

    Parameters (and tensors sharing their storage) are left in place; a moved tensor keeps its strides, so that the
    backward runs the same kernels on the same layouts as with the activations kept. ``bytes_moved`` counts
    what was offloaded, so that tests can check the hooks really ran.

    On CUDA the copies run on a stream of their own, ordered by events: each device-to-host copy into pinned memory
    waits for the compute stream to have produced the tensor and overlaps the passes that follow (the tensor's memory
    is not reused before the copy ends: ``record_stream``); ``prefetch`` (before a prefix backward) and every unpack
    bring back the most recently packed tensors not yet fetched, newest first (the backward's order), until
    ``ahead_bytes`` are on their way or waiting, and an unpack makes the compute stream wait only for its own copy.
    On the CPU the same bookkeeping runs without streams (``fetch_order`` records it for the tests).
    """

    def __init__(self, model: torch.nn.Module, device: str | torch.device = "cpu", ahead_bytes: int = 2**29):
        self.device = torch.device(device)
        with torch.no_grad():  # a tensor-parallel parameter (DTensor) is identified by its local shard's storage
            self.param_storages = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
        self.bytes_moved = 0
        self.ahead_bytes = ahead_bytes
        self.handles: list = []  # weak references to the _Offloaded handles, in packing order
        self.cursor = -1  # the newest handle not yet considered for prefetching
        self.fetched: dict[int, int] = {}  # handle index -> bytes, fetched and not yet unpacked (nor freed)
        self.fetch_order: list[int] = []  # handle indices in the order they were fetched
        self._streams: dict = {}

    def _stream(self, device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def pack(self, t: torch.Tensor):
        if is_dtensor(t) or t.untyped_storage().data_ptr() in self.param_storages or (t.is_leaf and t.requires_grad):
            return t  # a DTensor (a tensor-parallel parameter or activation) stays in place: exact, not offloaded
        self.bytes_moved += t.numel() * t.element_size()
        side = t.is_cuda and self.device.type == "cpu"
        if side:
            s = self._stream(t.device)
            s.wait_stream(torch.cuda.current_stream(t.device))  # the tensor is written before it is copied
            with torch.cuda.stream(s):
                moved = torch.empty_like(t, device=self.device, pin_memory=True)
                moved.copy_(t, non_blocking=True)
            t.record_stream(s)  # its memory is not reused before the copy ends
        else:
            moved = torch.empty_like(t, device=self.device)
            moved.copy_(t)
        h = _Offloaded(t.device, moved, len(self.handles))
        i = h.stored
        self.handles.append(weakref.ref(h, lambda _: self.fetched.pop(i, None)))  # a graph released unconsumed
        self.cursor = len(self.handles) - 1
        return h

    def _fetch(self, h: _Offloaded) -> None:
        if h.dev is not None:
            return
        self.fetch_order.append(h.stored)
        self.fetched[h.stored] = h.nbytes
        if h.device.type == "cuda" and not h.host.is_cuda:
            s = self._stream(h.device)
            with torch.cuda.stream(s):
                h.dev = h.host.to(h.device, non_blocking=True)
            h.ready = torch.cuda.Event()
            h.ready.record(s)
        else:
            h.dev = h.host.to(h.device)

    def prefetch(self) -> None:
        """Start bringing back the newest packed tensors, up to ``ahead_bytes`` (call before a prefix backward)."""
        while sum(self.fetched.values()) < self.ahead_bytes and self.cursor >= 0:
            h = self.handles[self.cursor]()
            self.cursor -= 1
            if h is not None:
                self._fetch(h)

    def unpack(self, x):
        if not isinstance(x, _Offloaded):
            return x
        self._fetch(x)
        t, x.dev = x.dev, None
        self.fetched.pop(x.stored, None)
        if x.ready is not None:
            cur = torch.cuda.current_stream(x.device)
            cur.wait_event(x.ready)
            assert t is not None  # the copy this event orders
            t.record_stream(cur)
            x.ready = None
        self.prefetch()
        return t

    def __call__(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
