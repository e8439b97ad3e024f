"""Host time a GRPO step saves by planning once per batch (``integrations.plan_cache``), on CPU.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/trl_plan_reuse.py [--layers 4] [--repeats 15]

One step is what SharedPrefixGRPOTrainer does for one microbatch of TRL rows ``[left-padded prompt | completion]``:
the old-policy and reference log-probs (no grad; the reference is a second model of the same configuration) and the
policy's (grad enabled, deferred under the budget, then TRL's loss backward). "plain" builds the tree and plans in
each of the three calls (before issue 41); "reuse" looks the plan up by the microbatch's content, planning once. The
two run interleaved in one process, on a tiny Qwen3 (so that the host work is visible), and the medians are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import sharedprefix as sp
from sharedprefix.integrations.plan_cache import PlanCache
from sharedprefix.integrations.trl_batch import to_rows, tree_rows


def batch(groups: int, size: int, prompt: int, completion: int, seed: int = 0):
    """(B, L) TRL rows: ``groups`` prompts of ``prompt`` tokens (left-padded), ``size`` completions each."""
    g = torch.Generator().manual_seed(seed)
    P, B = prompt + 4, groups * size
    ids = torch.zeros(B, P + completion, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i in range(groups):
        p = torch.randint(1, 90, (prompt,), generator=g)
        for j in range(size):
            b = i * size + j
            n = int(torch.randint(completion // 2, completion + 1, (1,), generator=g))
            ids[b, P - prompt : P] = p
            ids[b, P : P + n] = torch.randint(1, 90, (n,), generator=g)
            mask[b, P - prompt : P + n] = 1
    return ids, mask, completion


def step(policy, ref, ids, mask, keep, budget, cache: PlanCache | None) -> None:
    def source(model):
        if cache is None:
            tr = tree_rows(ids, mask, keep)
            return tr.tree, tr
        return cache.lookup(
            model, (ids, mask), (keep,), lambda: ((t := tree_rows(ids, mask, keep)).tree, t), max_tokens=budget
        )

    with torch.no_grad():
        for model in (policy, ref):  # old-policy and reference log-probs
            src, tr = source(model)
            to_rows(sp.logprobs(model, src, max_tokens=budget).logprobs, tr, ids.shape[0], keep)
    src, tr = source(policy)
    out = sp.logprobs(policy, src, max_tokens=budget, defer=True)
    lp = to_rows(out.logprobs, tr, ids.shape[0], keep)
    lp.sum().backward()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--budget", type=int, default=256)
    a = ap.parse_args()
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=a.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    policy, ref = Qwen3ForCausalLM(cfg).eval(), Qwen3ForCausalLM(cfg).eval()
    ids, mask, keep = batch(groups=4, size=8, prompt=96, completion=24)
    times: dict[str, list[float]] = {"plain": [], "reuse": []}
    for r in range(a.repeats + 2):
        for name in ("plain", "reuse") if r % 2 == 0 else ("reuse", "plain"):
            cache = PlanCache() if name == "reuse" else None
            t = time.perf_counter()
            step(policy, ref, ids, mask, keep, a.budget, cache)
            if r >= 2:  # the first two rounds warm up
                times[name].append(time.perf_counter() - t)
            policy.zero_grad(set_to_none=True)
    plain, reuse = statistics.median(times["plain"]), statistics.median(times["reuse"])
    print(
        f"tiny Qwen3, {a.layers} layers, 4 groups x 8 completions, prompt 96, completions <= 24, max_tokens={a.budget}"
    )
    print(
        f"step (old + ref + policy fwd/bwd), median of {a.repeats}: plain {plain * 1e3:.1f} ms, reuse "
        f"{reuse * 1e3:.1f} ms, saved {(plain - reuse) * 1e3:.1f} ms ({(plain - reuse) / plain:.0%})"
    )


if __name__ == "__main__":
    main()
