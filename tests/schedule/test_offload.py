"""OffloadHooks' bookkeeping (on CUDA it orders the copies of a side stream; on the CPU the same logic runs without
streams): tensors come back newest first, the backward's order, with at most ``ahead_bytes`` fetched ahead, and
with their strides."""

import torch

import sharedprefix as sp
from helpers import grads_of, random_groups, tiny_model
from sharedprefix.schedule.offload import OffloadHooks
from support.schedule import microbatch_weights


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


def test_offloaded_tensors_keep_their_strides():
    """A saved tensor comes back with its strides (a transposed weight cast, a permuted activation), so that the
    backward runs the same kernels on the same layouts as under ``keep``: under bf16 autocast a step's gradients are
    then bitwise those of ``keep`` (with contiguous copies they differed by bf16 roundings: 0.031 on Gemma 3)."""
    hooks = OffloadHooks(torch.nn.Linear(2, 2), "cpu")
    t = torch.randn(4, 6).t()
    back = hooks.unpack(hooks.pack(t))
    assert back.stride() == t.stride() and torch.equal(back, t)

    model = tiny_model("gemma3_text", dtype=torch.float32)
    g = random_groups(3, 2, [20, 9], [[3, 4, 1, 5], [2, 5, 3]])
    mbs = [
        [sp.Group(g[0].prompt, list(g[0].completions[:2])), g[1]],
        [sp.Group(g[0].prompt, list(g[0].completions[2:]))],
    ]
    ws = microbatch_weights(mbs)

    def step(mode):
        def run():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                s = sp.plan_step(model, mbs, prefix_activations=mode)
                for k, w in enumerate(ws):
                    sp.backward(model, s.microbatch(k), lambda b, w=w: (b.logprobs * w[b.index].float() * b.mask).sum())

        return grads_of(model, run)

    keep, offload = step("keep"), step("offload")
    assert keep.keys() == offload.keys()
    assert all(torch.equal(keep[n], offload[n]) for n in keep), [
        n for n in keep if not torch.equal(keep[n], offload[n])
    ]
