"""The prefix cache: per-layer prompt K/V, last hidden state and token values, shared across passes.

A recording pass writes, for each cached segment and attention module, the K/V tensors the
module produced (post-rotary, before GQA expansion: (1, Hkv, len, D)), the segment's last
final hidden state (d,), the log-probs (and entropies) of its computed tokens (k,), which
the output rows through it read in later passes, and, for each token mixer outside attention
(``model.mixers``), its state at the segment's end (a convolution's last inputs (1, C, K), a recurrent
state (H, Dk, Dv)), and, for a step's shared segments under the MoE load-balancing loss (``routed``), its tokens'
router logits (one (len, E) per MoE layer: ``schedule.step_aux``). ``seal`` then turns them into what later passes read:

- ``leaves=True`` (``sp.backward``): detached leaf tensors that require grad, so the
  later passes accumulate dK, dV, dh, the mixer states' and the values' gradients into ``.grad``; ``backward(seg)``
  later pushes those gradients through the prompt's own graph (kept, offloaded, or recomputed);
- ``leaves=False`` (``sp.logprobs``): the tensors themselves, so a grad-enabled forward
  stays one connected graph and a no-grad forward keeps no graph at all.
"""

from __future__ import annotations

import torch


class PrefixCache:
    def __init__(self, leaves: bool):
        self.leaves = leaves
        self.graph_kv: dict[int, dict] = {}  # seg -> module (or (module, call) for several calls) -> (k, v) as produced
        self.graph_h: dict[int, torch.Tensor] = {}
        self.read_kv_: dict[int, dict] = {}  # seg -> module -> (k, v) that later passes read
        self.read_h: dict[int, torch.Tensor] = {}
        self.graph_vals: dict[int, tuple] = {}  # seg -> (log-probs (k,), entropies (k,) | None)
        self.read_vals: dict[int, tuple] = {}
        self.graph_mix: dict[int, dict] = {}  # seg -> (mixer module, seam) -> its state at the segment's end
        self.read_mix: dict[int, dict] = {}
        self.states: dict[int, object] = {}  # seg -> PassState of the recording pass
        # seg -> indexer module -> its keys (1, len, D) (DeepSeek sparse attention, ``attention.indexed``): detached,
        # the indexer runs without autograd (in the plain run too), so they need no gradient and no sealing
        self.index_keys: dict[int, dict] = {}
        self.terms: dict[int, torch.Tensor] = {}  # seg -> a scalar of its recorded graph its backward adds (MoE aux)
        self.routed: frozenset[int] = frozenset()  # the segments whose router logits are cached (a step's shared)
        self.graph_router: dict[int, tuple] = {}  # seg -> per MoE layer its tokens' (len, E) router logits
        self.read_router: dict[int, tuple] = {}

    def __contains__(self, seg: int) -> bool:
        return seg in self.read_kv_

    def segments(self) -> set[int]:
        return set(self.read_kv_)

    def write_kv(self, module, seg: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.graph_kv.setdefault(seg, {})[module] = (k, v)

    def write_state(self, slot, seg: int, t: torch.Tensor) -> None:
        self.graph_mix.setdefault(seg, {})[slot] = t

    def read_state(self, slot, seg: int) -> torch.Tensor:
        try:
            return self.read_mix[seg][slot]
        except KeyError:
            raise RuntimeError(
                f"no cached {slot[1]} state for segment {seg} in {type(slot[0]).__name__}; the model's token mixers "
                "differ between passes, which sharedprefix does not support."
            ) from None

    def write_index(self, indexer, seg: int, k: torch.Tensor) -> None:
        self.index_keys.setdefault(seg, {})[indexer] = k.detach()

    def read_index(self, indexer, seg: int) -> torch.Tensor:
        try:
            return self.index_keys[seg][indexer]
        except KeyError:
            raise RuntimeError(
                f"no cached indexer keys for segment {seg} in {type(indexer).__name__}; its indexer did not run in the "
                "pass that cached the segment, which sharedprefix does not support."
            ) from None

    def write_h(self, seg: int, h: torch.Tensor) -> None:
        self.graph_h[seg] = h

    def write_router(self, router_logits, spans) -> None:
        """The router logits (one (L, E) per MoE layer, of a packed row) of the ``spans`` (segment, start, end) of
        segments it records."""
        for seg, a, b in spans:
            self.graph_router[seg] = tuple(z[a:b] for z in router_logits)

    def router(self, seg: int) -> tuple:
        return self.read_router[seg]

    def add_term(self, seg: int, term: torch.Tensor) -> None:
        """A scalar of ``seg``'s recorded graph that its deferred backward adds to the surrogate."""
        self.terms[seg] = term if seg not in self.terms else self.terms[seg] + term

    def write_values(self, seg: int, lp: torch.Tensor, ent: torch.Tensor | None) -> None:
        self.graph_vals[seg] = (lp, ent)

    def values(self, seg: int) -> tuple:
        return self.read_vals[seg]

    def read_kv(self, module, seg: int):
        try:
            return self.read_kv_[seg][module]
        except KeyError:
            raise RuntimeError(
                f"no cached K/V for segment {seg} in "
                f"{type(module[0] if isinstance(module, tuple) else module).__name__}"
                "; the model's attention layers differ "
                "between passes, which sharedprefix does not support."
            ) from None

    def h(self, seg: int) -> torch.Tensor:
        return self.read_h[seg]

    def seal(self, seg: int, keep_graph: bool) -> None:
        """Make segment ``seg``'s recorded tensors readable by later passes."""
        if seg not in self.graph_kv and seg not in self.graph_mix:
            raise RuntimeError(f"segment {seg} was to be cached but no attention layer or token mixer recorded it.")
        if not self.leaves:
            self.read_kv_[seg] = self.graph_kv.pop(seg, {})
            self.read_mix[seg] = self.graph_mix.pop(seg, {})
            self.read_h[seg] = self.graph_h.pop(seg)
            if seg in self.graph_router:
                self.read_router[seg] = self.graph_router.pop(seg)
            if seg in self.graph_vals:
                self.read_vals[seg] = self.graph_vals.pop(seg)
            return
        leaf = _leaf
        self.read_kv_[seg] = {m: (leaf(k), leaf(v)) for m, (k, v) in self.graph_kv.get(seg, {}).items()}
        self.read_mix[seg] = {m: leaf(t) for m, t in self.graph_mix.get(seg, {}).items()}
        self.read_h[seg] = leaf(self.graph_h[seg])
        if seg in self.graph_router:
            self.read_router[seg] = tuple(leaf(z) for z in self.graph_router[seg])
        if seg in self.graph_vals:
            self.read_vals[seg] = tuple(leaf(t) for t in self.graph_vals[seg])
        if not keep_graph:
            del self.graph_h[seg]
            self.graph_kv.pop(seg, None)
            self.graph_mix.pop(seg, None)
            self.graph_vals.pop(seg, None)
            self.graph_router.pop(seg, None)

    def surrogate(self, seg: int, through_outputs: bool = False) -> torch.Tensor | None:
        """``sum(dK * K) + sum(dV * V) + sum(dh * h) + sum(dvalues * values) + sum(dstate * state)`` over ``seg``'s
        recorded graph tensors, with the gradients accumulated on its leaves: its backward pushes exactly those
        gradients through the prompt's graph.

        ``through_outputs``: include ``0 * sum(h)`` when h got no gradient, so that the backward passes
        through every layer's output (FSDP2 unshards a layer's parameters when the gradient of its
        output arrives); it adds exactly zero.
        """
        total = None
        h, lh = self.graph_h[seg], self.read_h[seg]
        if through_outputs and lh.grad is None and h.requires_grad:
            total = (h * 0.0).sum()
        pairs = [
            (t, leaf) for m, kv in self.graph_kv.get(seg, {}).items() for t, leaf in zip(kv, self.read_kv_[seg][m])
        ]
        pairs += [(t, self.read_mix[seg][m]) for m, t in self.graph_mix.get(seg, {}).items()]
        pairs.append((h, lh))
        if seg in self.graph_vals:
            pairs += [(t, leaf) for t, leaf in zip(self.graph_vals[seg], self.read_vals[seg]) if t is not None]
        pairs += list(zip(self.graph_router.get(seg, ()), self.read_router.get(seg, ())))
        for t, leaf in pairs:
            if leaf.grad is not None and t.requires_grad:
                term = (t * leaf.grad).sum()
                total = term if total is None else total + term
        if seg in self.terms:
            total = self.terms[seg] if total is None else total + self.terms[seg]
        return total

    def _leaves(self, segments=None) -> list[torch.Tensor]:
        """Every leaf later passes read (``seal``), whose ``.grad`` they accumulate (``segments``: theirs only)."""
        keep = (lambda s: True) if segments is None else (lambda s: s in segments)  # noqa: E731
        out = [t for s, kv in self.read_kv_.items() if keep(s) for pair in kv.values() for t in pair]
        out += [t for s, t in self.read_h.items() if keep(s)]
        out += [t for s, vals in self.read_vals.items() if keep(s) for t in vals if t is not None]
        out += [t for s, mix in self.read_mix.items() if keep(s) for t in mix.values()]
        out += [t for s, zs in self.read_router.items() if keep(s) for t in zs]
        return [t for t in out if t is not None and t.requires_grad]

    def hold_grads(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Set every leaf's ``.grad`` aside (no copy) and return (leaf, held gradient) pairs: a call accumulates
        from zero (``schedule.step``)."""
        held = [(t, t.grad) for t in self._leaves()]
        for t, _ in held:
            t.grad = None
        return held

    def grad_marks(self, segments) -> list:
        """(leaf, its ``.grad`` object, that gradient's version) of every leaf of ``segments``: ``grads_moved``
        tells whether a backward accumulated into any of them since."""
        return [(t, t.grad, None if t.grad is None else t.grad._version) for t in self._leaves(segments)]

    @staticmethod
    def grads_moved(marks: list) -> bool:
        return any(t.grad is not g or (g is not None and g._version != v) for t, g, v in marks)

    def merge_grads(self, held: list) -> None:
        """Add the ``held`` gradients to what accumulated since, out of place (the held tensors stay intact)."""
        for t, g in held:
            if g is not None:
                t.grad = g if t.grad is None else t.grad + g

    def scale_grads(self, factor: float) -> None:
        """Every leaf's accumulated gradient times ``factor`` (out of place)."""
        for t in self._leaves():
            if t.grad is not None:
                t.grad = t.grad * factor

    @staticmethod
    def restore_grads(held: list) -> None:
        """Every leaf's ``.grad`` as ``hold_grads`` found it."""
        for t, g in held:
            t.grad = g

    def surrogates(self, segs, through: bool) -> torch.Tensor | None:
        """The sum of ``segs``' surrogates (one segment, or a tuple one pass recorded), or None where none has any."""
        total = None
        for s in segs if isinstance(segs, tuple) else (segs,):
            if (sur := self.surrogate(s, through_outputs=through)) is not None:
                total = sur if total is None else total + sur
        return total

    def release(self, seg: int) -> None:
        for d in (
            self.graph_kv,
            self.graph_h,
            self.read_kv_,
            self.read_h,
            self.graph_vals,
            self.read_vals,
            self.states,
            self.index_keys,
            self.terms,
            self.graph_mix,
            self.read_mix,
            self.graph_router,
            self.read_router,
        ):
            d.pop(seg, None)


def _leaf(t):
    """A detached copy of ``t`` that requires grad (a leaf of the passes that read it); None stays None."""
    return None if t is None else t.detach().requires_grad_(True)
