"""What one optimizer step costs over a trainer's own microbatches: the plain per-row run, a call per microbatch
(each prompt once per microbatch) and ``sp.plan_step`` (each prompt once per step) in each prefix mode; tokens
computed, time and peak memory of the step.

The layout is TRL's default with accumulation: groups of G completions, their rows shuffled into GA microbatches of
``rows`` rows each (so every group's completions fall in several microbatches), one optimizer step over all of them.
Each configuration runs in a fresh process; peak memory is the growth of the peak resident set over the level after
set-up (the model, its ``.grad`` buffers and the rows), as ``sharedprefix bench --memory`` measures it on the CPU
(``tools.bench``; ``max_memory_allocated`` on a GPU, which this file has not run on). One thread. Run:

  PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/step_memory.py > benchmarks/step_memory_cpu.txt
"""

import json
import os
import subprocess
import sys
import time

import torch

import sharedprefix as sp
from sharedprefix.tools.bench import _peak_rss_bytes, _reset_peak_rss, _rss_bytes, bench_loss, bench_model, make_groups

SPEC = dict(n_groups=2, prompt=2048, completion=64, G=8, rows=4, layers=4)
KINDS = ["plain", "per_microbatch", "step_keep", "step_offload", "step_recompute"]


def microbatches(groups, rows, seed=0):
    """TRL's shuffle: every row of the generation batch in a random order, split into microbatches of ``rows``."""
    items = [(gi, i) for gi, g in enumerate(groups) for i in range(g.group_size)]
    perm = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed)).tolist()
    out = []
    for s in range(0, len(perm), rows):
        chosen = [items[j] for j in perm[s : s + rows]]
        mb = []
        for gi in sorted({gi for gi, _ in chosen}):
            mb.append(sp.Group(groups[gi].prompt, [groups[gi].completions[i] for gi2, i in chosen if gi2 == gi]))
        out.append(mb)
    return out


def plain_microbatch(model, mb):
    """The plain run of one microbatch: its rows right-padded into one batch, forward and backward."""
    rows = [torch.cat([g.prompt, c]) for g in mb for c in g.completions]
    L = max(len(r) for r in rows)
    ids = torch.stack([torch.nn.functional.pad(r, (0, L - len(r))) for r in rows])
    logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), -1)
    loss, i = 0.0, 0
    for g in mb:
        P = len(g.prompt)
        for c in g.completions:
            loss = loss - logp[i, P - 1 : P - 1 + len(c)].gather(-1, c[:, None]).sum()
            i += 1
    loss.backward()
    return sum(len(r) for r in rows)


def child(kind: str) -> dict:
    torch.set_num_threads(1)
    model = bench_model(num_hidden_layers=SPEC["layers"])
    groups = make_groups(SPEC["n_groups"], SPEC["prompt"], SPEC["completion"], SPEC["G"])
    mbs = microbatches(groups, SPEC["rows"])
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    _reset_peak_rss()
    base = _rss_bytes()
    t0 = time.perf_counter()
    tokens = 0
    if kind == "plain":
        for mb in mbs:
            tokens += plain_microbatch(model, mb)
    elif kind == "per_microbatch":
        for mb in mbs:
            tokens += sp.backward(model, mb, bench_loss).tokens_computed
    else:
        step = sp.plan_step(model, mbs, prefix_activations=kind.split("_")[1])
        for k in range(len(mbs)):
            tokens += sp.backward(model, step.microbatch(k), bench_loss).tokens_computed
    dt = time.perf_counter() - t0
    return {"time_s": dt, "peak_bytes": _peak_rss_bytes() - base, "tokens": tokens, "microbatches": len(mbs)}


def main():
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    ideal = SPEC["n_groups"] * (SPEC["prompt"] + SPEC["G"] * SPEC["completion"])
    print(
        f"groups {SPEC['n_groups']} x G={SPEC['G']}, prompt {SPEC['prompt']}, completions {SPEC['completion']}, "
        f"{SPEC['rows']} rows a microbatch (TRL's shuffle), {SPEC['layers']} layers, cpu, one thread; one optimizer "
        f"step per configuration, each in a fresh process; ideal = every prompt once + every completion token once "
        f"= {ideal} tokens"
    )
    print(f"  {'config':<16} {'tokens':>7} {'/ideal':>7} {'time s':>8} {'peak MiB':>9}")
    for kind in KINDS:
        out = subprocess.run(
            [sys.executable, __file__, "--child", kind], capture_output=True, text=True, env=env, check=False
        )
        if out.returncode:
            raise RuntimeError(out.stderr[-3000:])
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"  {kind:<16} {r['tokens']:>7} {r['tokens'] / ideal:>7.2f} {r['time_s']:>8.2f} "
            f"{r['peak_bytes'] / 2**20:>9.1f}"
        )


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2])))
    else:
        main()
