"""Count the aten ops one training step dispatches: ``sp.backward`` against the plain per-row step.

On a GPU every aten op is at least one kernel launch, and a tiny model's step is all launches, so the number of ops
a step dispatches is what sets its speed there (and the host time of any model's step). ``count`` runs a step under
a ``TorchDispatchMode`` that sees every op of its forward and backward (on the CPU autograd runs the backward on the
calling thread, so the mode sees it too) and records each op by name and by where it came from:

- the built-in autograd node whose backward runs it (``backward:MmBackward0``), else
- the innermost frame of sharedprefix's own code (``attention.cascade:merged_forward``), else
- the innermost transformers frame (``transformers:modeling_qwen3``), else ``other``.

The plain step is what a plain trainer does for one group: the G rows ``[prompt + completion_i]`` right-padded to
one batch with an attention mask, one transformers forward, the loss, one backward (``tools.bench.plain_rows_step``).
``sp.backward`` runs the same group with the same loss. A warm-up step of each runs first (first calls build caches).

Counted per step at several depths, ops(layers) = per_call + per_layer * layers; ``fit`` gives both terms.

Two groups are measured (``GROUPS``): "ragged", 8 completions of 6-14 tokens, and "equal", 8 completions of 8
tokens (the plain step pads nothing there, so its per-call ops are fewest).

    PYTHONPATH=src python -m sharedprefix.tools.opcount --layers 4 16 [--groups ragged equal] [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import sharedprefix as sp

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../sharedprefix
_SKIP = (os.path.join(_PKG, "tools"),)


def _where() -> str:
    node = torch._C._current_autograd_node()
    if node is not None and not isinstance(node, torch.autograd.function.BackwardCFunction):
        return "backward:" + node.name()  # a built-in op's backward (a custom Function's: its own frames below)
    f = sys._getframe(2)
    hf = None
    while f is not None:
        fn = f.f_code.co_filename
        if fn.startswith(_PKG) and not fn.startswith(_SKIP):
            mod = os.path.relpath(fn, _PKG)[:-3].replace(os.sep, ".")
            return f"{mod}:{f.f_code.co_name}"
        if hf is None and "transformers" in fn:
            hf = "transformers:" + os.path.basename(fn)[:-3]
        f = f.f_back
    return hf or "other"


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched inside it: ``ops[name]``, ``where[place]`` and ``both[(place, name)]``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.where: collections.Counter = collections.Counter()
        self.both: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        place = _where()
        self.ops[name] += 1
        self.where[place] += 1
        self.both[(place, name)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def tiny_qwen3(layers: int, dtype=torch.float64, seed: int = 0):
    """The tests' tiny Qwen3 (``tests/helpers.py`` ``tiny_model()``: the zoo's tiny config, head_dim 12) with
    ``layers`` layers, in ``dtype``, eval mode, float64-faithful norms for float64."""
    import transformers as tf

    from sharedprefix.tools import zoo
    from sharedprefix.tools.reference import dtype_faithful_norms

    cfg = zoo.tiny_config(
        "qwen3",
        max_position_embeddings=512,
        head_dim=12,
        num_hidden_layers=layers,
        layer_types=["full_attention"] * layers,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = getattr(tf, zoo.entries()["qwen3"])(cfg).to(dtype).eval()
    if dtype == torch.float64:
        dtype_faithful_norms(model)
    return model


def one_group(prompt_len: int = 48, lengths=(9, 14, 6, 11, 14, 8, 12, 10), vocab: int = 97, seed: int = 0):
    """One group: a ``prompt_len``-token prompt and completions of ``lengths`` tokens (G = len(lengths))."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(0, vocab, (prompt_len,), generator=g)
    return sp.Group(p, [torch.randint(0, vocab, (n,), generator=g) for n in lengths])


GROUPS = {"ragged": {}, "equal": {"lengths": (8,) * 8}}  # the measured groups: one_group(**GROUPS[name])


def _loss(b):
    return -(b.logprobs * b.mask).sum()


def count(model, group, which: str, **kwargs) -> OpCounter:
    """The ops of one step, ``which`` = "ours" (``sp.backward``) or "plain" (``tools.bench.plain_rows_step``),
    after one warm-up step; gradients are zeroed before each step (not counted)."""
    from sharedprefix.tools.bench import plain_rows_step

    def step():
        if which == "ours":
            sp.backward(model, [group], _loss, **kwargs)
        else:
            plain_rows_step(model, [(group.prompt, c) for c in group.completions])

    model.zero_grad(set_to_none=True)
    step()
    model.zero_grad(set_to_none=True)
    counter = OpCounter()
    with counter:
        step()
    model.zero_grad(set_to_none=True)
    return counter


def measure(layers=(4, 16), group=None, dtype=torch.float64, **kwargs) -> dict:
    """{layers: (ours, plain)} counters for one group on the tiny Qwen3 at each depth."""
    group = group if group is not None else one_group()
    out = {}
    for n in layers:
        model = tiny_qwen3(n, dtype)
        out[n] = (count(model, group, "ours", **kwargs), count(model, group, "plain"))
    return out


def fit(a: tuple[int, int], b: tuple[int, int]) -> tuple[float, float]:
    """(per_call, per_layer) of a line through (layers, ops) points ``a`` and ``b``."""
    per_layer = (b[1] - a[1]) / (b[0] - a[0])
    return a[1] - per_layer * a[0], per_layer


def report(res: dict, top: int = 25) -> str:
    lines = []
    for n, (ours, plain) in res.items():
        lines.append(
            f"{n:3d} layers: ours {ours.total:6d} ops, plain {plain.total:6d} ops, ratio {ours.total / plain.total:.3f}"
        )
    ns = sorted(res)
    if len(ns) >= 2:
        a, b = ns[0], ns[-1]
        for i, who in enumerate(("ours", "plain")):
            c, per = fit((a, res[a][i].total), (b, res[b][i].total))
            lines.append(f"  {who:5s}: {c:8.1f} per call + {per:7.2f} per layer")
    n = ns[-1]
    ours, plain = res[n]
    lines.append(f"\nops by name at {n} layers, ours - plain (top {top}):")
    diff = {k: ours.ops[k] - plain.ops.get(k, 0) for k in set(ours.ops) | set(plain.ops)}
    for k, d in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top]:
        lines.append(f"  {d:+6d}  {k:40s} ours {ours.ops[k]:6d}  plain {plain.ops.get(k, 0):6d}")
    if len(ns) >= 2:
        a, b = ns[0], ns[-1]
        lines.append(f"\nours by place: per layer (from {a} and {b} layers), per call (top {top}):")

        def fitted(field: str) -> list:
            """(per layer, per call, key) of each key of ``Counts.<field>``, fitted from the two layer counts."""
            at_a, at_b = getattr(res[a][0], field), getattr(res[b][0], field)
            return [(*reversed(fit((a, at_a.get(k, 0)), (b, at_b.get(k, 0)))), k) for k in set(at_a) | set(at_b)]

        rows = fitted("where")
        for per, c, p in sorted(rows, key=lambda r: -(abs(r[0]) * b + abs(r[1])))[:top]:
            lines.append(f"  {per:7.2f}/layer {c:8.1f}/call  {p}")
        lines.append(f"\nours by (place, op) per layer (top {top}):")
        rows = fitted("both")
        for per, c, k in sorted(rows, key=lambda r: -abs(r[0]))[:top]:
            lines.append(f"  {per:7.2f}/layer {c:8.1f}/call  {k[0]}  {k[1]}")
        lines.append(f"\nours by (place, op) per call (top {top}):")
        for per, c, k in sorted(rows, key=lambda r: -abs(r[1]))[:top]:
            lines.append(f"  {per:7.2f}/layer {c:8.1f}/call  {k[0]}  {k[1]}")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    ap.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    args = ap.parse_args(argv)
    for name in args.groups:
        group = one_group(**GROUPS[name])
        print(f"== group {name}: {group!r}")
        print(report(measure(tuple(args.layers), group=group, dtype=getattr(torch, args.dtype)), args.top) + "\n")


if __name__ == "__main__":
    main()
