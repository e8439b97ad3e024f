"""The shared-prefix attention inside compiled decoder layers: one registered operator, no graph break.

When a decoder layer runs under ``torch.compile`` (``layer.compile()``, ``torch.compile(layer)``), the attention
function transformers calls is traced by dynamo. Everything that depends on the pass or on the layer (the row's
layout, its index tensors, the cached segments, the kernels chosen) stays out of the trace, so that every layer of
every pass runs one compiled graph: the whole cascade (every kernel call of ``layout.calls``, the log-sum-exp
merge, sinks, soft-capping, the cached-K/V read and its gradient) is one opaque operator, ``sharedprefix::cascade``,
with a fake implementation and a registered backward (``sharedprefix::cascade_backward``). Its inputs are tensors
and plain numbers only:

    q: (L, H, D), k: (L, Hkv, D), v: (L, Hkv, Dv): the row's (views of transformers' (1, H, L, D) tensors);
    sinks: (H,) or None; handle: () int64 on the CPU, the running pass (``register``); anchor: the attention
        module's first parameter, which tells the operator which layer it runs (a layer index would be a constant
        of the trace: one compiled graph per layer, past dynamo's recompile limit); scale, softcap, window: as the
        layer passes them.
    -> out (L, H, Dv) in q's dtype, lse (L, H) float32 (float64 for float64 inputs), natural log.

The operator's implementation runs eagerly at run time (the compiler never looks inside): it reads the pass from its
handle and runs exactly the eager cascade (``attention.cascade``). The index tensors are built once per pass on the
layout (``RowLayout.cascade``) and reused by every layer and by the backward. The prefix cache is reached from the
implementation, not through the trace:

- a recording pass stores a copy of its segments' K/V rows (the compiled graph may reuse its buffers); their
  gradient, accumulated on the cache's leaves by the later passes, is added to dK, dV of those rows when the
  recording pass's deferred backward reaches the operator (the eager path's surrogate term sum(dK * K) instead);
- a pass that reads cached K/V takes them from the cache and keeps their gradient per (layer, segment);
  ``bridge`` hands it to autograd at the row's embedding output, whose backward runs after every layer's.

Notation: L = row length, H / Hkv = query / key-value heads, D / Dv = head dims.
"""

from __future__ import annotations

import itertools
import weakref
from contextlib import nullcontext
from types import SimpleNamespace

import torch

from sharedprefix.attention import kernels
from sharedprefix.attention.cascade import call_keys, merged_backward, merged_forward
from sharedprefix.attention.kernels.dense import dense_for
from sharedprefix.attention.layers import layer_chunk, layer_pattern, layer_window, softcap_refusal

_PASSES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # handle -> PassState
_IDS = itertools.count(1)


class PassIO:
    """A pass through compiled layers: its ``handle`` (the one tensor the trace reads), its attention modules by
    their anchor's data pointer, the kernels' aux of each layer's forward, and the cached keys' gradients."""

    def __init__(self, handle: torch.Tensor, layers: dict):
        self.handle, self.layers = handle, layers
        self.aux: dict = {}  # module -> the kernels' aux of its forward (handed back to its backward)
        self.dcached: dict = {}  # (module, seg) -> [dk, dv] (1, Hkv, len, D | Dv), summed over the backward


class _Current:
    """The one object the traced code reads (its identity never changes): the running pass's ``PassIO``."""

    io: PassIO | None = None


CURRENT = _Current()


def _anchor(module: torch.nn.Module) -> torch.Tensor:
    return next(module.parameters())


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention modules the probe found; raises ValueError where the compiled path cannot tell them apart by
    their first parameter (a module without parameters, or two sharing one)."""
    from sharedprefix.attention import probe

    out, seen = [], set()
    for m in model.modules():
        if probe.pattern(m) is None:
            continue
        p = next(m.parameters(), None)
        if p is None or p.data_ptr() in seen:
            raise ValueError(f"{type(m).__name__} has no parameter of its own to tell it apart from the other layers")
        seen.add(p.data_ptr())
        out.append(m)
    return out


def register(state, modules: list[torch.nn.Module]) -> PassIO:
    """Give ``state`` (a ``PassState``) the handle its compiled layers read."""
    n = next(_IDS)
    _PASSES[n] = state
    io = PassIO(torch.tensor(n, dtype=torch.int64), {_anchor(m).data_ptr(): m for m in modules})
    state.io = io
    return io


class _Bridge(torch.autograd.Function):
    """Identity on the row's embeddings x (1, L, d). It holds the pass (``state``) as long as the pass's graph lives,
    so that the operators' backward finds it from its handle after the call returned (a grad-enabled
    ``sp.logprobs``); its backward, which runs after every layer's, gives the cached K/V the gradients the layers'
    operators kept for them."""

    @staticmethod
    def forward(ctx, x, state, keys, *cached):
        ctx.state, ctx.keys = state, keys
        return x.clone()

    @staticmethod
    def backward(ctx, dx):
        grads: list = []
        for key in ctx.keys:
            g = ctx.state.io.dcached.pop(key, None)
            grads += [None, None] if g is None else g
        return (dx, None, None, *grads)


def bridge(state, modules: list[torch.nn.Module], read_kv):
    """A forward hook for the row's embedding module that keeps the pass alive with its graph and routes the cached
    K/V's gradients (``_Bridge``), or None for a pass without grad."""
    if not torch.is_grad_enabled():
        return None
    keys, cached = [], []
    for m in modules:
        for seg in state.layout.cached_reads:
            keys.append((m, seg))
            cached += list(read_kv(m, seg))
    return lambda mod, args, out: _Bridge.apply(out, state, keys, *cached)


def traced_attention(module, query, key, value, scale: float, softcap, window, sinks, amp) -> torch.Tensor:
    """(1, L, H, Dv): the attention of a compiled layer; what dynamo traces of it is the same for every layer and
    every pass."""
    io = CURRENT.io
    if io is None:
        raise RuntimeError(
            "the 'sharedprefix' attention ran in a compiled layer outside a sharedprefix call (or in a call that "
            "runs the layers eager); call sharedprefix.logprobs / sharedprefix.backward instead of the model directly."
        )
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (L, H, D) views
    with torch.autocast(amp, enabled=False) if amp is not None else nullcontext():
        out, _ = torch.ops.sharedprefix.cascade(q, k, v, sinks, io.handle, _anchor(module), scale, softcap, window)
    return out[None]


def _pass(handle: torch.Tensor):
    state = _PASSES.get(int(handle))
    if state is None:
        raise RuntimeError(
            "the compiled shared-prefix attention ran after its pass ended (a graph kept past its call)."
        )
    return state


def _setup(handle, anchor, q, k, scale, softcap, window):
    """The pass, the layer's module, and its cascade and kernels, after the refusals of what they cannot compute."""
    state = _pass(handle)
    module = state.io.layers[anchor.data_ptr()]
    name = type(module).__name__
    window = layer_window(module, window)
    chunk = layer_chunk(module)
    if layer_pattern(module).calls != 1:
        raise ValueError(f"{name} runs attention several times per forward; compiled layers take one call per layer.")
    impl = kernels.select(state.backend, q.device, q.dtype)
    if softcap is not None and not getattr(impl, "SOFTCAP", False):
        raise ValueError(softcap_refusal(name, softcap, impl.name))
    dense = None if softcap is not None else dense_for(impl, q.device, q.dtype, max(q.shape[-1], k.shape[-1]))
    casc = state.layout.cascade(window, chunk)
    ctx = SimpleNamespace(impl=impl, dense=dense, calls=casc.calls, device=q.device, scale=scale, softcap=softcap)
    return state, module, ctx


def _call_keys(state, module, ctx, k, v) -> list[torch.Tensor]:
    read = (lambda seg: state.store.read_kv(module, seg)) if state.store is not None else None
    kv: list[torch.Tensor] = []
    for c in ctx.calls:
        kv += call_keys(c, k, v, read)
    return kv


@torch.library.custom_op("sharedprefix::cascade", mutates_args=())
def cascade(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None,
    handle: torch.Tensor,
    anchor: torch.Tensor,
    scale: float,
    softcap: float | None,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    state, module, ctx = _setup(handle, anchor, q, k, scale, softcap, window)
    first = module not in state.seen
    state.seen[module] = state.seen.get(module, 0) + 1
    layout = state.layout
    if first and layout.record:  # not again when checkpointing recomputes the layer
        for s in layout.record:
            r0, r1 = layout.row_start[s], layout.row_end[s]
            state.store.write_kv(module, s, *(t[r0:r1].transpose(0, 1)[None].clone() for t in (k, v)))
    kv = _call_keys(state, module, ctx, k, v)
    out, lse, auxes = merged_forward(ctx.impl, ctx.dense, ctx.calls, ctx.device, scale, softcap, sinks, q, kv)
    state.io.aux[module] = auxes
    return out.contiguous(), lse.contiguous()


@cascade.register_fake
def _(q, k, v, sinks, handle, anchor, scale, softcap, window):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1]), q.new_empty(q.shape[0], q.shape[1], dtype=acc)


@torch.library.custom_op("sharedprefix::cascade_backward", mutates_args=())
def cascade_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    handle: torch.Tensor,
    anchor: torch.Tensor,
    scale: float,
    softcap: float | None,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    state, module, ctx = _setup(handle, anchor, q, k, scale, softcap, window)
    ctx.auxes = state.io.aux.get(module, [None] * len(ctx.calls))
    kv = _call_keys(state, module, ctx, k, v)
    dq, grads, dsinks = merged_backward(ctx, dout, q, out, lse, sinks, kv, sinks is not None)
    dk, dv = (torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (k, v))
    for c, gk, gv in zip(ctx.calls, grads[0::2], grads[1::2]):
        for which, g, drow in ((0, gk, dk), (1, gv, dv)):
            _route(state, module, c, g, drow, which)
    layout = state.layout
    for s in layout.record:  # the recorded rows' gradient from the later passes, accumulated on the cache's leaves
        r0, r1 = layout.row_start[s], layout.row_end[s]
        for t, drow in zip(state.store.read_kv(module, s), (dk, dv)):
            if t.is_leaf and t.grad is not None:
                drow[r0:r1] += t.grad[0].transpose(0, 1)
    return dq.contiguous(), dk, dv, (dsinks if dsinks is not None else q.new_zeros(0))


@cascade_backward.register_fake
def _(dout, q, k, v, sinks, out, lse, handle, anchor, scale, softcap, window):
    like = lambda t: torch.empty_like(t, memory_format=torch.contiguous_format)  # noqa: E731
    return like(q), like(k), like(v), (like(sinks) if sinks is not None else q.new_empty(0))


def _route(state, module, call, g: torch.Tensor, drow: torch.Tensor, which: int) -> None:
    """Add a call's key (which=0) or value (1) gradient (K, Hkv, D) to the row's, or keep it for the cached segment
    it came from (``PassIO.dcached``, (1, Hkv, len, D)), undoing ``call_keys``: the gather by ``k_index``, then the
    concatenation of the key sources."""
    _, _, index = call.on(g.device)
    segs = state.layout.tree.segments
    lens = [segs[s.seg].length if s.cached else s.end - s.start for s in call.keys]
    if index is not None:
        g = g.new_zeros(sum(lens), *g.shape[1:]).index_add_(0, index, g)
    o = 0
    for src, n in zip(call.keys, lens):
        part = g[o : o + n]
        o += n
        if not src.cached:
            drow[src.start : src.end] += part
            continue
        slot = state.io.dcached.setdefault((module, src.seg), [None, None])
        part = part.transpose(0, 1)[None]
        slot[which] = part.clone() if slot[which] is None else slot[which] + part


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, handle, anchor, scale, softcap, window = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, sinks, out, lse, handle, anchor)
    ctx.args = (scale, softcap, window)
    ctx.has_sinks = sinks is not None


def _backward(ctx, dout, dlse):
    q, k, v, sinks, out, lse, handle, anchor = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.sharedprefix.cascade_backward(
        dout, q, k, v, sinks, out, lse, handle, anchor, *ctx.args
    )
    return dq, dk, dv, (dsinks if ctx.has_sinks else None), None, None, None, None, None


cascade.register_autograd(_backward, setup_context=_setup_context)
