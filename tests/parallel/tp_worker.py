"""One rank of the tensor-parallel tests (run under torchrun): a tiny model saved, loaded back with transformers'
own ``tp_plan="auto"`` (DTensor weights over every rank), and every sharedprefix call on it.

Usage: torchrun --nproc_per_node=W tp_worker.py MODELS OUT  (MODELS: comma-separated builder names, ``BUILDERS``)
Rank 0 writes {model: {call: log-probs or whole gradients}} to OUT; the test compares them with one process.
"""

import os
import sys
import types

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel.worker import BUDGET, groups_and_weights, shard_of, tree_and_weights, whole_grads  # noqa: E402

import sharedprefix as sp  # noqa: E402
from helpers import tiny_model  # noqa: E402
from sharedprefix.tools.reference import Float64Inside  # noqa: E402


def _zoo(entry):
    from sharedprefix.tools.zoo.configs import build, float64_norms

    model, _ = build(entry)
    float64_norms(model)
    return model


# name -> a float64 model with dtype-faithful norms, the same weights on every call (seeded)
BUILDERS = {
    "llama": lambda: tiny_model("llama"),
    "qwen3": lambda: tiny_model("qwen3"),
    "gemma3": lambda: _zoo("gemma3_text"),  # sliding-window and full layers, q/k norms
    "qwen3_moe": lambda: _zoo("qwen3_moe"),  # experts under transformers' packed colwise / rowwise plan
    "gpt_oss": lambda: _zoo("gpt_oss"),  # attention sinks, sliding windows, MoE; only the embedding is sharded
    "mqa": lambda: tiny_model("llama", num_key_value_heads=1),  # one K/V head: fewer than any TP degree > 1
    "qwen3_kv4": lambda: tiny_model("qwen3", num_key_value_heads=4),  # 4 K/V heads: one per rank at TP degree 4
}
# calls whose backward recomputes a forward, where Float64Inside (a mode autograd's recomputation does not see)
# cannot keep Qwen3-MoE's float32 router softmax float64: not run on it (GPT-OSS covers MoE there)
NEEDS_MODE_IN_BACKWARD = {"qwen3_moe": ("defer", "checkpointing")}


def build(name):
    """``BUILDERS[name]``, or the zoo's tiny model of entry E for ``zoo:E`` (held-out sweeps)."""
    return BUILDERS[name]() if name in BUILDERS else _zoo(name.removeprefix("zoo:"))


def faithful_classes(model) -> None:
    """The dtype-faithful norm forwards of ``model`` (set per instance by ``build``) set on the norm classes, so that
    a model loaded with ``tp_plan`` gets them under transformers' own TP forward wrappers (which capture the
    forward when the plan is applied; a forward replaced on the instance afterwards would drop them). A class some
    of whose instances kept their own forward (a norm without a weight) is left as it is."""
    fns: dict = {}
    for mod in model.modules():
        f = vars(mod).get("forward")
        ours = isinstance(f, types.MethodType) and f.__func__.__module__.startswith("sharedprefix")
        fns.setdefault(type(mod), set()).add(f.__func__ if ours else None)
    for cls, found in fns.items():
        if len(found) == 1 and None not in found:
            cls.forward = found.pop()


def load(name, root, **kw):
    """``BUILDERS[name]``'s model as saved under ``root`` by ``save``, loaded back (``tp_plan="auto"`` in ``kw``)
    in float64, with its dtype-faithful norms set on their classes (the test's one-process reference loads the
    same checkpoint the same way: buffers made at load, such as Gemma 3's float32 embedding scale, agree)."""
    import transformers as tf

    faithful_classes(build(name))
    model = tf.AutoModelForCausalLM.from_pretrained(os.path.join(root, name), dtype=torch.float64, **kw)
    model.config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    return model.eval()


def save(name, rank, root):
    if rank == 0:
        build(name).save_pretrained(os.path.join(root, name))
    dist.barrier()


def calls(model, robust=False):
    """Every call of the tests, on the same groups on every rank: {name: log-probs or whole gradients}. ``robust``
    (held-out sweeps): a call that raises is recorded as its error and the next one runs."""
    groups, W = groups_and_weights()
    loss_fn = lambda b: (b.logprobs * W[b.index, : b.logprobs.shape[1]] * b.mask).sum()  # noqa: E731
    out = {}

    def attempt(key, fn):
        try:
            out[key] = fn()
        except Exception as e:  # noqa: BLE001
            if not robust:
                raise
            out[key] = f"{type(e).__name__}: {e}"
            model.zero_grad(set_to_none=True)

    def no_grad(fn):
        with torch.no_grad():
            return fn().logprobs

    def grads(fn):
        return whole_grads(model, fn)

    def deferred():
        lp = sp.logprobs(model, groups, max_tokens=BUDGET, defer=True)
        (lp.logprobs * W[:, : lp.logprobs.shape[1]] * lp.mask).sum().backward()

    def checkpointed():
        model.gradient_checkpointing_enable()
        model.train()
        try:
            sp.backward(model, groups, loss_fn, max_tokens=BUDGET, prefix_activations="recompute")
        finally:
            model.gradient_checkpointing_disable()
            model.eval()

    attempt("logprobs", lambda: no_grad(lambda: sp.logprobs(model, groups)))
    attempt("logprobs_budget", lambda: no_grad(lambda: sp.logprobs(model, groups, max_tokens=BUDGET)))
    attempt("whole", lambda: grads(lambda: sp.backward(model, groups, loss_fn)))
    for mode in ("keep", "recompute", "offload"):
        attempt(
            mode,
            lambda m=mode: grads(lambda: sp.backward(model, groups, loss_fn, max_tokens=BUDGET, prefix_activations=m)),
        )
    skip = NEEDS_MODE_IN_BACKWARD.get(getattr(model.config, "model_type", ""), ())
    if "defer" not in skip:
        attempt("defer", lambda: grads(deferred))
    tree, _, _, TW = tree_and_weights()
    tree_loss = lambda b: (b.logprobs * TW[b.index, : b.logprobs.shape[1]]).sum()  # noqa: E731
    attempt("tree", lambda: grads(lambda: sp.backward(model, tree, tree_loss, max_tokens=BUDGET)))
    if "checkpointing" not in skip:
        attempt("checkpointing", lambda: grads(checkpointed))
    return out


def calls_2d(model):
    """FSDP2 x TP (transformers' ``DistributedConfig(tp_size=2, fsdp_size=2)``: a (fsdp, tp) mesh, TP inside): the
    groups sharded over the data dimension only (``sp.shard_groups`` by the rank's fsdp coordinate); every call's
    gradient is the sum over the data dimension, whole: {name: this rank's log-probs or the whole gradients}."""
    dp = model._device_mesh["fsdp"]
    rank, size = dp.get_local_rank(), dp.size()
    groups, W = groups_and_weights()
    mine, gidx = shard_of(groups, rank, size)
    loss_fn = lambda b: (b.logprobs * W[gidx[b.index], : b.logprobs.shape[1]] * b.mask).sum()  # noqa: E731
    out = {"dp_rank": rank}
    with torch.no_grad():
        out["logprobs"] = sp.logprobs(model, mine).logprobs
        out["logprobs_budget"] = sp.logprobs(model, mine, max_tokens=BUDGET).logprobs

    def grads(fn):
        return whole_grads(model, fn)

    out["whole"] = grads(lambda: sp.backward(model, mine, loss_fn))
    out["recompute"] = grads(lambda: sp.backward(model, mine, loss_fn, max_tokens=BUDGET))

    tree, _, _, TW = tree_and_weights()  # (sp.logprobs with grad is refused under FSDP2, deferred or not)
    tmine = sp.shard_groups(tree, rank, size)
    glob = torch.tensor(tmine.index)
    out["tree"] = grads(
        lambda: sp.backward(
            model, tmine, lambda b: (b.logprobs * TW[glob[b.index], : b.logprobs.shape[1]]).sum(), max_tokens=BUDGET
        )
    )
    model.gradient_checkpointing_enable()
    model.train()
    out["checkpointing"] = grads(lambda: sp.backward(model, mine, loss_fn, max_tokens=BUDGET))
    model.gradient_checkpointing_disable()
    model.eval()
    out["verify"] = str(sp.verify(model))
    return out


def refusals(rank, root):
    """Layouts refused at the first call (the messages), and ``sp.verify`` on a tensor-parallel Qwen3."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    groups, _ = groups_and_weights()
    out = {}

    def message(fn):
        try:
            fn()
        except (ValueError, TypeError) as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    model = load("qwen3", root, tp_plan="auto")
    out["sequence_group"] = message(lambda: sp.logprobs(model, groups, sequence_group=dist.group.WORLD))
    out["verify"] = str(sp.verify(model))
    # bfloat16 under TP: sharedprefix (a splitting budget) and the plain TP forward of each row, whole gradients
    from helpers import plain_logprobs

    bf16 = load("qwen3", root, tp_plan="auto").to(torch.bfloat16)
    _, W = groups_and_weights()
    loss = lambda b: (b.logprobs.double() * W[b.index, : b.logprobs.shape[1]]).sum()  # noqa: E731
    out["bf16"] = whole_grads(bf16, lambda: sp.backward(bf16, groups, loss, max_tokens=BUDGET))
    out["bf16_plain"] = whole_grads(bf16, lambda: (plain_logprobs(bf16, groups)[0].double() * W).sum().backward())
    own = tiny_model("llama")  # a user's own plan over the attention projections, not transformers'
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(own.model.layers[0].self_attn, mesh, {"q_proj": ColwiseParallel(), "o_proj": RowwiseParallel()})
    out["parallelize_module"] = message(lambda: sp.logprobs(own, groups))
    return out


def main(names, out, robust=False):
    import faulthandler

    faulthandler.dump_traceback_later(500, exit=True)  # a hang prints where it is and fails instead of blocking CI
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    results = {}
    for name in names.split(","):
        if name.endswith("@fsdp2xtp"):  # 4 ranks: FSDP2 over 2 x TP over 2, transformers' own 2-D layout
            from transformers.distributed import DistributedConfig

            base = name.split("@")[0]
            save(base, rank, os.path.dirname(out))
            with Float64Inside():
                cfg = DistributedConfig(tp_size=2, fsdp_size=2)
                results[name] = calls_2d(load(base, os.path.dirname(out), distributed_config=cfg))
            continue
        if name == "refusals":
            save("qwen3", rank, os.path.dirname(out))
            results[name] = refusals(rank, os.path.dirname(out))
            continue
        save(name, rank, os.path.dirname(out))
        try:
            with Float64Inside():  # routers' float32 softmax kept float64, as in the reference
                results[name] = calls(load(name, os.path.dirname(out), tp_plan="auto"), robust)
        except Exception as e:  # noqa: BLE001  a refusal (the test checks its message), or a crash the test reports
            results[name] = f"{type(e).__name__}: {e}"
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from support.torchrun import run_worker

    run_worker(main, sys.argv[1], sys.argv[2], len(sys.argv) > 3 and sys.argv[3] == "--robust")
