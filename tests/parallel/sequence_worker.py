"""One rank of the sequence-parallel tests (run under torchrun): sp.logprobs / sp.backward with sequence_group.

Usage: torchrun --nproc_per_node=S sequence_worker.py OUT
Every rank runs every case of ``CASES`` on the same groups over the whole world as its sequence group, and writes
its own results to OUT.<rank> (log-probs, entropies, full gradients, refusal messages); the test compares each
rank's with the plain run.
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sharedprefix as sp  # noqa: E402
from helpers import float64_faithful, random_groups, tiny_model  # noqa: E402

# a group larger than the budget (prompt 30: chunks of 16 + 14; completions in 2 passes) and two small ones;
# row lengths that are not multiples of 4, so that rows are padded for the split
SPEC = ([30, 5, 7], [[6, 5, 6, 3], [2, 3], [3, 1, 4]])
BUDGET = 16
# name -> (arch, config overrides, budget, prefix_activations, source): H = 4 query heads everywhere
CASES = {
    "qwen3_gqa": ("qwen3", {}, None, None, "groups"),  # Hkv = 2: Hkv/S heads for S = 2, replicated for S = 4
    "qwen3_budget_keep": ("qwen3", {}, BUDGET, "keep", "groups"),
    "qwen3_budget_recompute": ("qwen3", {}, BUDGET, "recompute", "groups"),
    "gemma_mqa_budget": ("gemma", {}, BUDGET, "keep", "groups"),  # Hkv = 1 < S
    "llama_mha_tree": ("llama", dict(num_key_value_heads=4), BUDGET, "keep", "tree"),
    "mistral_window_budget": ("mistral", dict(sliding_window=5), BUDGET, "recompute", "groups"),  # a sliding window
    # attention sinks (one logit per head: each rank takes its heads' slice), a window, MoE; and score soft-capping
    "gpt_oss_sinks_budget": ("zoo:gpt_oss", {}, BUDGET, "keep", "groups"),
    "gemma2_softcap_budget": ("zoo:gemma2", {}, BUDGET, "recompute", "groups"),
}


def build_model(arch, over):
    """A case's float64 model: ``zoo:<entry>`` is the zoo's tiny build of that entry with its norms in float64 (they
    cast to float32 otherwise), anything else ``tiny_model``."""
    if arch.startswith("zoo:"):
        from sharedprefix.tools.zoo.configs import build

        return float64_faithful(build(arch[4:])[0])
    return tiny_model(arch, **over)


def source(kind):
    groups = random_groups(11, 3, *SPEC)
    if kind == "groups":
        return groups
    rows = [torch.cat([g.prompt, c]).tolist() for g in groups for c in g.completions]
    rows.append(rows[0][:12] + [5, 6, 7])  # a row that shares only part of the first prompt
    return sp.Tree.from_rows(rows)


def weights(n, w):
    g = torch.Generator().manual_seed(5)
    return torch.randn(n, w, dtype=torch.float64, generator=g), torch.randn(n, w, dtype=torch.float64, generator=g)


def run_case(name, group):
    arch, over, budget, mode, kind = CASES[name]
    model = build_model(arch, over)
    src = source(kind)
    with torch.no_grad():
        out = sp.logprobs(model, src, entropy=True, max_tokens=budget, sequence_group=group)
    W, V = weights(*out.logprobs.shape)
    model.zero_grad(set_to_none=True)
    loss = lambda b: (b.logprobs * W[b.index]).sum() + 0.1 * (b.entropy * V[b.index]).sum()  # noqa: E731
    res = sp.backward(model, src, loss, max_tokens=budget, prefix_activations=mode, entropy=True, sequence_group=group)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    lp = sp.logprobs(model, src, max_tokens=budget, sequence_group=group)  # grad enabled: deferred
    (lp.logprobs * W).sum().backward()
    deferred = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return dict(
        logprobs=out.logprobs, entropy=out.entropy, grads=grads, deferred=deferred, loss=res.loss, passes=res.passes
    )


# a step over two microbatches (sp.plan_step with the sequence group): (prefix_activations, budget)
STEP_MODES = {"keep": ("keep", None), "recompute_budget": ("recompute", BUDGET)}


def step_microbatches(groups):
    """The groups' completions over two microbatches (each group's first half, then the rest: every prompt of two or
    more completions shared by both), and each microbatch's completions' indices in ``groups``' order."""
    mbs, idx, start = [[], []], [[], []], 0
    for g in groups:
        half = (g.group_size + 1) // 2
        for k, part in enumerate((range(half), range(half, g.group_size))):
            if len(part):
                mbs[k].append(sp.Group(g.prompt, [g.completions[i] for i in part]))
                idx[k] += [start + i for i in part]
        start += g.group_size
    return mbs, [torch.tensor(i) for i in idx]


def step_weights(n):
    return torch.randn(n, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(9))


def run_step(model, groups, mode, budget, group, sync_last=False):
    """``groups`` as a step of two microbatches (``step_microbatches``) under ``group``; the loss of each microbatch
    the sum of its log-probs weighted by ``step_weights`` at their indices in ``groups``. Returns (tokens computed,
    the step's state); the gradient is left in ``.grad``. ``sync_last``: reduce only in the last call (FSDP2)."""
    mbs, idx = step_microbatches(groups)
    W = step_weights(sum(g.group_size for g in groups))
    step = sp.plan_step(model, mbs, max_tokens=budget, prefix_activations=mode, sequence_group=group)
    tokens = 0
    for k in range(len(mbs)):
        loss = lambda b, k=k: (b.logprobs * W[idx[k][b.index], : b.logprobs.shape[1]]).sum()  # noqa: E731
        sync = k == len(mbs) - 1 or not sync_last
        tokens += sp.backward(model, step.microbatch(k), loss, sync=sync).tokens_computed
    return tokens, step.state


def run_steps(group):
    """{mode: {grads, tokens, state}} of ``run_step`` on one float64 Qwen3 for each of ``STEP_MODES``."""
    model = build_model("qwen3", {})
    out = {}
    for name, (mode, budget) in STEP_MODES.items():
        model.zero_grad(set_to_none=True)
        tokens, state = run_step(model, source("groups"), mode, budget, group)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        out[name] = dict(grads=grads, tokens=tokens, state=state)
    return out


def fsdp_weights(n):
    return torch.randn(n, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(7))


def run_fsdp():
    """FSDP2 over every rank x sequence groups of 2 (data-parallel group d: ranks 2d, 2d + 1), whole groups per
    data-parallel group, a budget that splits one: {full gradients, log-probs of this rank's groups, their global
    completion indices}."""
    from parallel.worker import full_grads, shard_of
    from torch.distributed.fsdp import fully_shard

    world, rank = dist.get_world_size(), dist.get_rank()
    groups_sp = [dist.new_group([2 * d, 2 * d + 1]) for d in range(world // 2)]
    d = rank // 2
    model = tiny_model("qwen3")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    groups = source("groups")
    mine, gidx = shard_of(groups, d, world // 2)
    W = fsdp_weights(sum(g.group_size for g in groups))  # over every completion, indexed by its global position
    with torch.no_grad():
        lp = sp.logprobs(model, mine, max_tokens=BUDGET, sequence_group=groups_sp[d]).logprobs
    loss = lambda b: (b.logprobs * W[gidx[b.index], : b.logprobs.shape[1]]).sum()  # noqa: E731
    sp.backward(model, mine, loss, max_tokens=BUDGET, sequence_group=groups_sp[d])
    grads = full_grads(model)
    # the same rows as a step of two microbatches (each prompt once for both), reduced by FSDP2 at the last one (the
    # first with sync=False), as verl accumulates its micro-batches; its root resharded after forward, as verl's is
    # (with fully_shard's default for a root, sp.backward with sync=False left a wrong gradient on the root's
    # parameters until the core's fix "FSDP2: sync=False calls keep the unsharded parameters' gradient")
    model = tiny_model("qwen3")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model, reshard_after_forward=True)
    mbs, idx = step_microbatches(mine)
    step = sp.plan_step(model, mbs, max_tokens=BUDGET, prefix_activations="recompute", sequence_group=groups_sp[d])
    for k in range(2):
        loss = lambda b, k=k: (b.logprobs * W[gidx[idx[k][b.index]], : b.logprobs.shape[1]]).sum()  # noqa: E731
        sp.backward(model, step.microbatch(k), loss, sync=k == 1)
    return dict(grads=grads, step_grads=full_grads(model), logprobs=lp, gidx=gidx, data_group=d)


def refusals(group):
    """{case: message} of calls that must be refused under sequence parallelism (missing: not refused)."""
    from torch.nn.parallel import DistributedDataParallel

    hybrid = tiny_model(
        "lfm2",
        dtype=torch.float32,
        num_hidden_layers=3,
        layer_types=["conv", "full_attention", "conv"],
        full_attn_idxs=None,
        conv_L_cache=3,
        block_auto_adjust_ff_dim=False,
        max_position_embeddings=128000,
    ).train()  # as built
    calls = {
        "heads": lambda: sp.logprobs(
            tiny_model("qwen3", num_attention_heads=6, num_key_value_heads=3), source("groups"), sequence_group=group
        ),
        "hybrid": lambda: sp.logprobs(hybrid, source("groups"), sequence_group=group),
        "defer_false": lambda: sp.logprobs(tiny_model("qwen3"), source("groups"), defer=False, sequence_group=group),
        "ddp": lambda: sp.backward(
            DistributedDataParallel(tiny_model("qwen3")),
            source("groups"),
            lambda b: b.logprobs.sum(),
            sequence_group=group,
        ),
        # ranks that disagree: other groups on the last rank; a bad temperature on the last rank only
        "mismatch": lambda: sp.logprobs(tiny_model("qwen3"), _rank_source(group), sequence_group=group),
        "one_rank_bad": lambda: sp.logprobs(
            tiny_model("qwen3"), source("groups"), temperature=_rank_temperature(group), sequence_group=group
        ),
    }
    msgs = {}
    for name, call in calls.items():
        try:
            call()
        except (ValueError, RuntimeError) as e:
            msgs[name] = f"{type(e).__name__}: {e}"
    return msgs


def _rank_source(group):
    last = dist.get_rank(group) == dist.get_world_size(group) - 1
    return random_groups(12, 3, *SPEC) if last else source("groups")


def _rank_temperature(group):
    return -1.0 if dist.get_rank(group) == dist.get_world_size(group) - 1 else 1.0


def main(out):
    dist.init_process_group("gloo")
    group = dist.new_group(list(range(dist.get_world_size())))
    results = {name: run_case(name, group) for name in CASES}
    results["refusals"] = refusals(group)
    results["steps"] = run_steps(group)
    results["fsdp"] = run_fsdp()
    torch.save(results, f"{out}.{dist.get_rank()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    from support.torchrun import run_worker

    run_worker(main, sys.argv[1])
