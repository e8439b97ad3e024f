"""``sp.plan_step`` under DeepSpeed ZeRO-1/2/3 on 2 CPU processes (gloo), float64: each rank's groups split over 3
microbatches (every prompt in two or three of them), one DeepSpeed micro-step each (``gradient_accumulation_steps=3``,
``engine.step()`` after every micro-step, the update at the third), against DeepSpeed's own plain run of the same
micro-steps (a forward per row, ``engine.backward`` per micro-step). Usage: torchrun --nproc_per_node=2
deepspeed_step_worker.py STAGE OUT. Rank 0 writes {case: {"grads": full gradients before the boundary's step,
"params": parameters after it, ...}} to OUT; a case that raised has "error", a refusal "refusal"."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deepspeed  # noqa: E402
from deepspeed.utils import safe_get_full_grad  # noqa: E402
from parallel.deepspeed_worker import engine_of  # noqa: E402

import sharedprefix as sp  # noqa: E402
from helpers import random_groups, refused_on_second_call, tiny_model  # noqa: E402
from sharedprefix.schedule.step import Step  # noqa: E402
from support.schedule import microbatch_weights  # noqa: E402
from support.torchrun import settle_gc  # noqa: E402

K = 3  # microbatches of the step = DeepSpeed's gradient_accumulation_steps
BUDGET = 8  # splits the 20-token prompt into a chain, and the microbatches into passes
PROMPTS = (20, 9)


def microbatches(rank):
    """This rank's two groups, their completions spread over K microbatches (as TRL's shuffle spreads them)."""
    g = random_groups(31 + rank, 2, list(PROMPTS), [[3, 4, 1, 5, 2, 6], [2, 5, 3]])
    sub = lambda x, idx: sp.Group(x.prompt, [x.completions[i] for i in idx])  # noqa: E731
    return [[sub(g[0], [0, 1]), sub(g[1], [0])], [sub(g[0], [2, 3])], [sub(g[1], [1, 2]), sub(g[0], [4, 5])]]


def weights(rank):
    """(n_k, T_k) float64 weights of each microbatch's completion tokens."""
    return microbatch_weights(microbatches(rank), seed=7 + rank)


def loss_of(W):
    return lambda b: (b.logprobs * W[b.index, : b.logprobs.shape[1]] * b.mask).sum()


def model_of(moe=False):
    """The tiny float64 Qwen3, or with ``moe`` a tiny float64 Mixtral without its load-balancing loss (eager experts:
    ``grouped_mm`` has no float64 kernel), whose MoE blocks DeepSpeed makes ZeRO-3 leaf modules."""
    if not moe:
        return tiny_model("qwen3", dtype=torch.float64)
    model = tiny_model("mixtral", dtype=torch.float64)
    model.config._experts_implementation = "eager"
    return model


def reference(moe=False):
    """The float64 gradient DeepSpeed's accumulation should hold at the boundary: the mean over the two ranks of each
    rank's plain micro-steps' gradients, each divided by K (``engine.backward``'s scaling), and the initial
    parameters."""
    model = model_of(moe)
    for rank in range(2):
        mbs, Ws = microbatches(rank), weights(rank)
        for k in range(K):
            (plain_loss(model, mbs[k], Ws[k]) / K / 2).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def plain_loss(engine, groups, W):
    """The plain run of one micro-step: a forward of each [prompt, completion] row through ``engine`` (or a model)."""
    total = 0.0
    for i, (g, c) in enumerate((x, c) for x in groups for c in x.completions):
        logits = engine(input_ids=torch.cat([g.prompt, c])[None], use_cache=False).logits[0]
        lp = logits[g.prompt.shape[0] - 1 : -1].log_softmax(-1).gather(-1, c[:, None])[:, 0]
        total = total + (lp * W[i, : c.shape[0]]).sum()
    return total


def padded_loss(engine, groups, W):
    """The plain run of one micro-step as one forward of its rows, right-padded and masked: a ZeRO-3 leaf module
    reduces its gradient in a module hook of each forward, so DeepSpeed's own run of one forward per row finds a
    parameter twice in its reduce bucket (``stage3.py``'s ``__reduce_and_partition_ipg_grads`` assertion)."""
    rows = [(torch.cat([g.prompt, c]), g.prompt.shape[0], c) for g in groups for c in g.completions]
    width = max(r.shape[0] for r, _, _ in rows)
    ids = torch.stack([torch.cat([r, r[:1].expand(width - r.shape[0])]) for r, _, _ in rows])
    mask = (torch.arange(width)[None] < torch.tensor([r.shape[0] for r, _, _ in rows])[:, None]).long()
    logits = engine(input_ids=ids, attention_mask=mask, use_cache=False).logits
    total = 0.0
    for i, (r, p, c) in enumerate(rows):
        lp = logits[i, p - 1 : r.shape[0] - 1].log_softmax(-1).gather(-1, c[:, None])[:, 0]
        total = total + (lp * W[i, : c.shape[0]]).sum()
    return total


def plain_step(engine, mbs, Ws, ks, padded=False):
    """DeepSpeed's own micro-steps ``ks``: a forward per row (``padded``: one of all rows), ``engine.backward``,
    ``engine.step()`` (the last left to ``finish``)."""
    for k in ks:
        engine.backward((padded_loss if padded else plain_loss)(engine, mbs[k], Ws[k]))
        if k < K - 1:
            engine.step()


def micro_step(engine, step, k, W, deferred, fail=False):
    """Microbatch ``k``'s call: ``sp.backward``, or deferred log-probs and ``engine.backward``. ``fail``: it raises,
    on its first pass at microbatch 1, mid-call at microbatch 2 (a loss refused on its second pass; deferred: a NaN in
    the loss's gradient of the rows of its last pass)."""
    if deferred:
        if fail:
            W = W.clone()
            passes = [st for st in step.splan.microbatches[k] if getattr(st, "rows", ())]
            assert len(passes) > 1, passes
            W[[step.views[k].local[r] for r in passes[-1].rows]] = float("nan")
        engine.backward((sp.logprobs(engine, step.microbatch(k)).logprobs * W).sum())
        return
    fn = loss_of(W)
    if fail:
        fn = refused_on_second_call(fn) if k == 2 else refused_on_second_call(_raise)
    sp.backward(engine, step.microbatch(k), fn)


def _raise(batch):
    raise ValueError("microbatch refused")


def run(stage, case, rank):
    mbs, Ws = microbatches(rank), weights(rank)
    moe = case.startswith("moe")
    model = model_of(moe)
    gas = 2 if case in ("straddle_refused", "clock_refused") else 1 if case == "update_then_deferred_backward" else K
    engine = engine_of(stage, gas, model=model)
    if moe and stage == 3:  # DeepSpeed made the MoE blocks ZeRO-3 leaf modules, as by default
        from deepspeed.utils import get_z3_leaf_modules

        assert {type(m).__name__ for m in get_z3_leaf_modules(engine.module)} == {"MixtralSparseMoeBlock"}
    out: dict = {}
    if case in ("plain", "moe_plain"):
        plain_step(engine, mbs, Ws, range(K), padded=moe)
    elif case.startswith(("keep", "offload", "recompute", "budget", "moe_step")):
        mode = case.split("_")[-1] if case.startswith("budget") else "keep" if moe else case
        budget = BUDGET if case.startswith("budget") else None
        step = sp.plan_step(engine, mbs, max_tokens=budget, prefix_activations=mode)
        tokens = 0
        for k in range(K):
            tokens += sp.backward(engine, step.microbatch(k), loss_of(Ws[k])).tokens_computed
            if k < K - 1:
                engine.step()
        assert step.state == "finished", step.state
        out["tokens"] = tokens
    elif case.startswith("deferred"):
        budget = BUDGET if case == "deferred_budget" else None
        step = sp.plan_step(engine, mbs, max_tokens=budget, prefix_activations="recompute" if budget else "keep")
        for k in range(K):
            lp = sp.logprobs(engine, step.microbatch(k))
            engine.backward((lp.logprobs * Ws[k]).sum())
            if k < K - 1:
                engine.step()
        assert step.state == "finished", step.state
    elif case == "straddle_refused":  # gradient_accumulation_steps=2: a step of 3 straddles the boundary after 2
        refusals = []
        try:
            sp.plan_step(engine, mbs)
        except ValueError as e:
            refusals.append(str(e))
        plain_step(engine, mbs, Ws, [0])  # micro-step 1 of 2 now: a step of 2 straddles, a step of 1 does not
        try:
            sp.plan_step(engine, mbs[:2])
        except ValueError as e:
            refusals.append(str(e))
        sp.plan_step(engine, mbs[:1]).release()
        return {"refusals": refusals}
    elif case == "clock_refused":  # accelerate's way: the boundary set by the caller, engine.step() only there
        step = sp.plan_step(engine, mbs[:2])  # (the boundary cannot be read ahead: not refused here)
        versions = [p._version for p in engine.module.parameters()]
        engine.set_gradient_accumulation_boundary(True)
        sp.backward(engine, step.microbatch(0), loss_of(Ws[0]))
        engine.step()  # the update: the step's microbatch 1 would read prompts cached at the old parameters
        out["versions_moved"] = sum(p._version != v for p, v in zip(engine.module.parameters(), versions))
        try:
            sp.backward(engine, step.microbatch(1), loss_of(Ws[1]))
        except RuntimeError as e:
            out["refusal"] = str(e)
        try:  # a call outside the step: the step can no longer finish, named
            with torch.no_grad():
                sp.logprobs(engine, mbs[0])
        except RuntimeError as e:
            out["outside"] = str(e)
        step.release()
        return out
    elif case == "update_then_deferred_backward":  # deferred log-probs (no step) backpropagated after an engine.step()
        lp = sp.logprobs(engine, mbs[0], defer=True)
        engine.backward(plain_loss(engine, mbs[1], Ws[1]))
        engine.step()  # gradient_accumulation_steps=1: an update, which leaves the version counters as they were
        try:
            engine.backward((lp.logprobs * Ws[0]).sum())
        except RuntimeError as e:
            out["refusal"] = str(e)
        return out
    elif case == "mixed_refused":  # sp.backward then deferred log-probs in one step: two units of the shared share
        step = sp.plan_step(engine, mbs)
        sp.backward(engine, step.microbatch(0), loss_of(Ws[0]))
        engine.step()
        try:
            engine.backward((sp.logprobs(engine, step.microbatch(1)).logprobs * Ws[1]).sum())
        except ValueError as e:
            out["refusal"] = str(e)
        step.release()
        return out
    elif case.startswith("failed"):  # microbatch `at` fails; the user reruns it and the rest plainly
        at = 1 if case in ("failed", "failed_control") else 2  # (microbatch 2: on its second pass, mid-call)
        step = sp.plan_step(engine, mbs, max_tokens=BUDGET)
        deferred = case == "failed_deferred"
        deliver = Step._deliver_partial
        if case == "failed_control":  # the completed microbatches' shared share never delivered
            Step._deliver_partial = lambda self, model: None
        try:
            for k in range(at + 1):
                if k < at:
                    micro_step(engine, step, k, Ws[k], deferred)
                    engine.step()
                    continue
                try:
                    micro_step(engine, step, k, Ws[k], deferred, fail=True)
                except ValueError as e:
                    out["error_seen"] = str(e)
        finally:
            Step._deliver_partial = deliver
        assert step.state == "failed", step.state
        plain_step(engine, mbs, Ws, range(at, K))
    out.update(finish(engine))
    return out


def finish(engine):
    """{"grads": the full gradients before the boundary's ``engine.step()``, "params": the parameters after it}, in
    the model's dtype (float64)."""
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    grads = {n: safe_get_full_grad(p).detach().clone() for n, p in named}
    engine.step()
    with deepspeed.zero.GatheredParameters([p for _, p in named]):  # ZeRO-3's partitions, whole (1/2: as they are)
        params = {n: p.detach().clone() for n, p in named}
    return {"grads": grads, "params": params}


CASES = [
    "plain",
    "keep",
    "offload",
    "recompute",
    "budget_keep",
    "budget_offload",
    "budget_recompute",
    "deferred",
    "deferred_budget",
    "straddle_refused",
    "clock_refused",
    "mixed_refused",
    "update_then_deferred_backward",
    "failed",
    "failed_last",
    "failed_deferred",
    "failed_control",
    "moe_plain",  # at ZeRO-3 the MoE blocks are leaf modules (DeepSpeed's default), reduced in a module hook
    "moe_step",
]


def main(stage, out):
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no C++ build: gloo collectives
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    result = {}
    only = os.environ.get("SP_DS_CASES")  # a comma-separated subset, when debugging one case
    for case in only.split(",") if only else CASES:
        settle_gc()
        try:
            result[case] = run(int(stage), case, rank)
        except Exception as e:  # reported, so that the test names the case
            import traceback

            traceback.print_exc()
            result[case] = {"error": f"{type(e).__name__}: {e}"}
    if rank == 0:
        torch.save(result, out)
    dist.barrier()


if __name__ == "__main__":
    from support.torchrun import run_worker

    run_worker(main, sys.argv[1], sys.argv[2])
