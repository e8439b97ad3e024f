"""Graph breaks and graphs compiled per step with every decoder layer of a tiny float64 Qwen3 compiled in place.

    PYTHONPATH=src python scripts/compile_counts.py [logprobs|backward|defer ...]

Prints, per step (one layout each: group counts, lengths and budgets that split groups change), the graph breaks and
the graphs compiled (``torch._dynamo.utils.counters``, from a ``torch._dynamo.reset()`` per kind), and the largest
difference from the same call on an uncompiled copy of the model (log-probs; relative, for gradients).
"""

from __future__ import annotations

import sys
import time

import torch
import torch._dynamo
from torch._dynamo.utils import counters

sys.path.insert(0, ".")
import sharedprefix as sp  # noqa: E402
from tests.helpers import random_groups, tiny_model  # noqa: E402

LAYOUTS = [  # (groups, prompt lengths, completion lengths, max_tokens)
    (1, [7], [[3, 4]], None),
    (2, [5, 9], [[2, 6, 3], [4]], None),
    (1, [11], [[5, 2, 7, 3]], 12),
    (3, [4, 6, 8], [[3], [2, 2], [5, 1]], None),
    (2, [10, 6], [[4, 3, 2], [6, 5]], 16),
    (2, [9, 12], [[3, 5], [2, 2, 4]], 14),
]


def run(kind: str) -> None:
    torch._dynamo.reset()
    counters.clear()
    model, ref = tiny_model("qwen3", torch.float64), tiny_model("qwen3", torch.float64)
    for layer in model.model.layers:
        layer.compile()
    t0 = time.time()
    for i, (n, p, c, budget) in enumerate(LAYOUTS):
        groups = random_groups(i, n, p, c)
        before = (sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"])
        if kind == "logprobs":
            with torch.no_grad():
                got, want = (sp.logprobs(m, groups, max_tokens=budget).logprobs for m in (model, ref))
            err = float((got - want).abs().max())
        else:
            for m in (model, ref):
                m.zero_grad()
                if kind == "backward":
                    sp.backward(m, groups, lambda b: (b.logprobs * b.mask).sum(), max_tokens=budget)
                else:
                    sp.logprobs(m, groups, max_tokens=budget, defer=True).logprobs.sum().backward()
            err = max(
                float((a.grad - b.grad).abs().max() / b.grad.abs().max())
                for a, b in zip(model.parameters(), ref.parameters())
            )
        breaks, graphs = (
            a - b for a, b in zip((sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]), before)
        )
        took = time.time() - t0
        print(f"{kind} step {i}: graph breaks {breaks}, graphs compiled {graphs}, difference {err:.2g} ({took:.1f}s)")
    for reason, count in counters["graph_break"].items():
        print(f"  {count} x {reason.splitlines()[0]}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    for kind in sys.argv[1:] or ["logprobs", "backward", "defer"]:
        run(kind)
