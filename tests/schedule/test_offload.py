"""OffloadHooks' bookkeeping (on CUDA it orders the copies of a side stream; on the CPU the same logic runs without
streams): tensors come back newest first, the backward's order, with at most ``ahead_bytes`` fetched ahead."""

import torch

from sharedprefix.schedule.offload import OffloadHooks


def _graph(x):
    y = x * 1.5
    for _ in range(5):  # each op saves its input: six saved tensors of the same size
        y = torch.sin(y) * y
    return y.sum()


def test_offloaded_tensors_come_back_newest_first_within_the_window():
    model = torch.nn.Linear(2, 2)
    x = torch.randn(64, dtype=torch.float64, requires_grad=True)
    (want,) = torch.autograd.grad(_graph(x), x)
    one = 64 * 8
    hooks = OffloadHooks(model, "cpu", ahead_bytes=2 * one)
    seen = []
    fetch = hooks._fetch

    def spy(h):
        fetch(h)
        seen.append(sum(hooks.fetched.values()))

    hooks._fetch = spy
    with hooks():
        loss = _graph(x)
    n = len(hooks.handles)
    assert n >= 6 and hooks.bytes_moved >= n * one and hooks.fetched == {}
    hooks.prefetch()
    assert hooks.fetch_order == [n - 1, n - 2]  # two tensors' worth, the newest
    (got,) = torch.autograd.grad(loss, x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert hooks.fetch_order == sorted(hooks.fetch_order, reverse=True) and len(hooks.fetch_order) == len(
        set(hooks.fetch_order)
    )
    assert max(seen) <= 2 * one + one  # never more than the window ahead (plus the one being unpacked)
    assert hooks.fetched == {}


def test_a_graph_released_unconsumed_frees_its_place_in_the_window():
    model = torch.nn.Linear(2, 2)
    x = torch.randn(64, dtype=torch.float64, requires_grad=True)
    hooks = OffloadHooks(model, "cpu", ahead_bytes=64 * 8)
    with hooks():
        loss = _graph(x)
    hooks.prefetch()
    assert len(hooks.fetched) == 1
    del loss  # the graph and its saved tensors go: the fetched one no longer counts against the window
    assert hooks.fetched == {}
