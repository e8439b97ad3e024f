"""DeepSpeed ZeRO stages 1, 2 and 3: a ``deepspeed.DeepSpeedEngine`` passed as the model.

Passes run on the engine's module directly, so DeepSpeed's module hooks run as in its own forward: ZeRO-1/2 keep
every parameter whole (a forward runs no collective); ZeRO-3 gathers each module's parameters around its forward and
again for its backward, and leaves them empty (shape ``[0]``) elsewhere, so sharedprefix reads sizes from the modules'
declared sizes (``model.streams.declared_rows``) and runs its float32 head inside the head module's own call
(``model.adapter.in_own_call``). Each call begins a micro-step as ``DeepSpeedEngine.forward`` would
(``clear_backward_seen_flag``: ZeRO-3 otherwise replaces, instead of adding to, the previous micro-step's gradient).

DeepSpeed reduces and partitions gradients in post-accumulate-grad hooks that must run *inside* a backward (they
count the parameters of the running backward's graph and queue its epilogue on the autograd engine), so they cannot
be fired after the call as the other engines fire them (``parallel.grad_hooks``): every backward of a call runs with
them set aside, and the call's whole gradient is then delivered through one more backward of its own
(``engine.backward`` of a scalar whose gradient is the call's), where autograd runs each parameter's tensor hooks,
accumulates, and runs DeepSpeed's hooks once, on the total, as in the one ``engine.backward`` of a plain step. Under
ZeRO-3 that backward runs with the parameters gathered (``gathered``): autograd checks a gradient against the shape
it recorded for the parameter and accumulates into whole ``.grad`` tensors, which ZeRO-3's hooks then reduce-scatter
into its partitions. A deferred call's node takes the parameters the same way, and keeps them gathered until the
caller's backward ends (``gather_until_backward_ends``), or fails (``Release``). A failed call reaches none of the
hooks, so DeepSpeed's partitioned buffers stay as they were.

ZeRO-3's leaf modules (``deepspeed.utils.set_z3_leaf_modules``; DeepSpeed's default for the MoE blocks of Mixtral and
Qwen-MoE) reduce their parameters' gradients in a module full backward hook, not in the parameters' hooks: it would run
in each backward of a call on that pass's share (DeepSpeed then finds a parameter twice in its reduce bucket). So each
pass runs with those hooks set aside (``call``: autograd takes a module's full backward hooks when its forward runs),
and the backward that delivers the call's gradient (``Deliver``; a deferred call's: the caller's) queues them, once,
to run when it ends, after autograd accumulated into ``.grad``. A grad-enabled ``sp.logprobs`` then defers
(``must_defer``; ``defer=False`` is refused, ``check_undeferred``), so that its backward is one of sharedprefix's; the
cache path, whose passes run outside ``call``, is refused with leaf modules.

So ``sp.backward(engine, ...)`` is ``engine.backward`` of the call's loss: DeepSpeed divides the gradient by its
``gradient_accumulation_steps`` as it divides a loss, and accumulation over micro-steps and the step itself stay
DeepSpeed's (``engine.step()``). Hybrid models, of the packed path and of the cache path, need nothing more: their
passes are the modules' own calls too (tested at every stage). Refused at the first call, each with its reason: fp16
loss scaling, ZeRO++ (quantised weights or gradients, hierarchical partitioning: not verified), a cache-path hybrid
with ZeRO-3 leaf modules, a tensor-parallel model. DeepSpeed's tuned ``zero_optimization`` settings (``overlap_comm``,
``contiguous_gradients``, ``reduce_scatter``, ``round_robin_gradients``, bucket and prefetch sizes, persistence,
``zero.Init``) need nothing more: they change how DeepSpeed moves the gradient it is given, not which.

Steps of ``sp.plan_step`` (``parallel.engine_step``): each microbatch's call is one DeepSpeed micro-step, and the step's
shared prompts' gradient is delivered in its last microbatch's ``engine.backward``, scaled by 1 / GA as every
micro-step's is; ZeRO's reductions are linear in what they are given (``own_grad_hooks``: a step leaves them to it).
A step lies within one accumulation window (``check_step``); DeepSpeed's update leaves the parameters' version counters
as they were, so its ``global_steps`` tells a step that they changed (``step_clock``); deferred log-probs carry the
caller's 1 / GA already (``delivery_scale``), so a step's microbatches are delivered one way, and a step's graph-kept
log-probs are refused (``step_graph_refusal``).
"""

from __future__ import annotations

import sys

import torch

from sharedprefix.parallel.engine import Engine, Transaction
from sharedprefix.parallel.engines.deepspeed_nodes import Deliver, Release
from sharedprefix.parallel.engines.single import Single


def _deepspeed_engine(model: torch.nn.Module):
    """``model`` itself if it is a DeepSpeed engine (only looked for where deepspeed is imported already)."""
    ds = sys.modules.get("deepspeed")
    cls = getattr(ds, "DeepSpeedEngine", None) if ds is not None else None
    return model if cls is not None and isinstance(model, cls) else None


class DeepSpeed(Single):
    """One process's behaviour (passes without collectives, errors raised on their own rank: DeepSpeed's hooks never
    ran), with DeepSpeed's delivery of the call's gradient."""

    name = "DeepSpeed ZeRO"
    step_aux_refusal = "DeepSpeed (a step's MoE load-balancing loss has not been run under its engine)"
    step_graph_refusal = (
        "a DeepSpeed engine: log-probs that keep their graph would run the step's shared prompts' backward after your "
        "engine.backward ended, outside its micro-step"
    )
    replays_tensor_hooks = False  # autograd runs them in the delivering backward
    accumulates_itself = True  # over its gradient_accumulation_steps (``check_sync``)
    data_in_place = False  # (ZeRO-3 swaps p.data for its partitions)

    def __init__(self, root, world_size: int, engine, tensor: int = 1):
        super().__init__(root, world_size, tensor=tensor, data_size=world_size)
        self.ds = engine
        self.leaf_hooks = _leaf_hooks(engine)  # ZeRO-3's leaf modules' reduction hooks: [(module, handle)]
        if self.leaf_hooks:  # a grad-enabled ``sp.logprobs`` defers: its passes run without the leaves' hooks
            # (``call``), which only a backward of sharedprefix's own then runs, once
            self.must_defer = f"a DeepSpeed ZeRO-3 engine with leaf modules ({_names(self.leaf_hooks)})"

    def call(self, fn, guard: bool = True):
        """A pass with ZeRO-3's leaf-module hooks set aside (module full backward hooks are taken when the module's
        forward runs: a pass without them leaves none in its graph). Each would reduce its module's gradient in every
        backward of the call, on that pass's share; the delivering backward runs them once (``_fire_leaf_hooks``)."""
        if not self.leaf_hooks:
            return fn()
        held = [(handle, handle.hooks_dict_ref().pop(handle.id)) for _, handle in self.leaf_hooks]
        try:
            return fn()
        finally:
            for handle, hook in held:
                handle.hooks_dict_ref()[handle.id] = hook

    def _fire_leaf_hooks(self) -> None:
        """ZeRO-3's leaf-module reductions, once, on the call's whole gradient: queued from inside the backward that
        delivers it, so that they run when it ends, after autograd accumulated into ``.grad`` (and before
        DeepSpeed's own end-of-backward callback, which its parameter hooks queue later)."""

        def fire():
            for module, handle in self.leaf_hooks:
                handle.hooks_dict_ref()[handle.id](module, None, None)

        torch.autograd.Variable._execution_engine.queue_callback(fire)

    @classmethod
    def match(cls, model: torch.nn.Module, root: torch.nn.Module, world: int, tensor: int) -> Engine | None:
        engine = _deepspeed_engine(model)
        if engine is None:
            return None
        _refuse(engine, tensor)
        return cls(root, world, engine, tensor=tensor)

    def start(self) -> None:
        """As ``DeepSpeedEngine.forward`` begins a micro-step (sharedprefix runs the engine's module, not the engine):
        the optimizer closes the previous micro-step's backward (ZeRO-3 counts it, so that this one's gradient is
        added to it instead of replacing it; ZeRO-1/2 drop its accumulation buffers). Not inside a backward (a
        deferred call's backward runs inside the caller's ``engine.backward``, whose micro-step it is)."""
        super().start()
        clear = getattr(self.ds.optimizer, "clear_backward_seen_flag", None)
        if clear is not None and torch._C._current_graph_task_id() == -1:
            clear()

    def finish_grads(
        self, tx: Transaction, model: torch.nn.Module, sync: bool, grad_reduction: str, collect: bool
    ) -> dict | None:
        grads = tx.collect()  # ``.grad`` back as the call found it; the call's gradient by parameter
        if collect:  # a deferred call: the caller's ``engine.backward`` scaled its loss and delivers the gradient
            if grads and self.leaf_hooks:  # inside that backward
                self._fire_leaf_hooks()
            return grads
        if grads:  # through DeepSpeed's own backward: its loss scaling, hooks inside a backward, epilogue
            params = list(grads)
            then = self._fire_leaf_hooks if self.leaf_hooks else None
            with self.gathered(params):  # ZeRO-3: whole while autograd records and accumulates them
                with torch.enable_grad():
                    out = Deliver.apply([grads[p] for p in params], then, *params)
                self.ds.backward(out)
        return None

    def gathered(self, params):
        """ZeRO-3's ``GatheredParameters`` over ``params`` (read-only: partitioned again on exit, nothing
        broadcast); a no-op for stages 1 and 2, whose parameters are whole."""
        import deepspeed

        return deepspeed.zero.GatheredParameters(_partitioned(params), modifier_rank=None)

    def gather_until_backward_ends(self, params):
        """Gathered now, partitioned again by a callback the running backward runs when it ends (after autograd
        accumulated into them and DeepSpeed's hooks reduced it), or, where that backward fails (a later node of the
        caller's loss raises), when autograd drops the callback unrun (``Release``); a no-op for stages 1 and 2."""
        import deepspeed

        block = deepspeed.zero.GatheredParameters(_partitioned(params), modifier_rank=None)
        block.__enter__()
        leftovers = getattr(getattr(self.ds.optimizer, "parameter_offload", None), "release_backward_leftovers", None)
        torch.autograd.Variable._execution_engine.queue_callback(Release(block, leftovers))

    def fire_hooks(self) -> None:
        """Nothing: the delivering backward (``finish_grads``) ran every hook once, inside a backward."""

    def check_cache_path(self, name: str, why_hybrid: str) -> None:
        super().check_cache_path(name, why_hybrid)
        if self.leaf_hooks:
            raise ValueError(
                f"{name} is a hybrid model on sharedprefix's cache path, passed as a DeepSpeed ZeRO-3 engine with leaf "
                f"modules ({_names(self.leaf_hooks)}): that path runs the model's own forward outside the passes "
                "that set the leaves' reduction hooks aside, so each would reduce one pass's share. Use ZeRO stage 1 "
                f"or 2, or ZeRO-3 without leaf modules.{why_hybrid}"
            )

    def check_undeferred(self) -> None:
        if self.leaf_hooks:
            raise ValueError(
                f"sharedprefix.logprobs with grad enabled and defer=False on a DeepSpeed ZeRO-3 engine with leaf "
                f"modules ({_names(self.leaf_hooks)}): ZeRO-3 reduces a leaf module's gradient in the module's full "
                "backward hook, which sharedprefix's passes set aside so that it runs once, on the call's whole "
                "gradient, in a backward of sharedprefix's own; the graph that defer=False would hand back has none "
                "of those hooks, so your engine.backward would never reduce the leaf modules' gradients. Leave "
                "defer=None (the call then defers by itself: its backward runs inside your engine.backward, exact), "
                "or use sp.backward."
            )

    def step_clock(self) -> object:
        """DeepSpeed's optimizer steps (``global_steps``): its update writes the flat buffers or partitions behind the
        parameters, at every stage, and leaves their version counters as they were."""
        return int(self.ds.global_steps)

    def check_step(self, count: int) -> None:
        """A step's microbatches are consecutive micro-steps of one accumulation window: the step's last at or before
        DeepSpeed's boundary (``micro_steps`` counts the ``engine.step()`` calls). Where the caller sets the boundary
        itself (accelerate's ``set_gradient_accumulation_boundary``, or ``managed_gradient_accumulation`` off) it
        cannot be read ahead, and ``step_clock`` names a step whose parameters changed."""
        ds = self.ds
        managed = getattr(ds, "managed_gradient_accumulation", lambda: True)()
        if getattr(ds, "_is_gradient_accumulation_boundary", None) is not None or not managed:
            return
        ga, done = int(ds.gradient_accumulation_steps()), int(ds.micro_steps)
        at = done % ga
        if at + count > ga:
            raise ValueError(
                f"a step of {count} microbatches beginning at DeepSpeed micro-step {done}, micro-step {at} of its "
                f"gradient_accumulation_steps={ga}: its microbatches straddle the accumulation boundary after "
                f"micro-step {done + ga - at - 1}, where engine.step() updates the parameters, so its later "
                "microbatches would read prompts cached at the old parameters and the earlier ones' share of them "
                f"would miss that update. Plan a step over at most {ga - at} microbatch(es) from here (steps aligned "
                "with DeepSpeed's accumulation: gradient_accumulation_steps a multiple of the step's microbatches), "
                "or run these microbatches as calls of their own."
            )

    def own_grad_hooks(self) -> frozenset[int]:
        """ZeRO's reduction hooks (``optimizer._grad_acc_hooks``: a handle of each parameter's
        post-accumulate-grad hook, at every stage)."""
        return frozenset(h.id for h in getattr(self.ds.optimizer, "_grad_acc_hooks", None) or [] if hasattr(h, "id"))

    def delivery_scale(self) -> float:
        """``engine.backward`` divides the call's gradient by ``gradient_accumulation_steps`` (``finish_grads``)."""
        return 1.0 / int(self.ds.gradient_accumulation_steps())

    def check_sync(self, sync: bool) -> None:
        if not sync:
            raise ValueError(
                "sync=False with a DeepSpeed engine: DeepSpeed accumulates gradients over its own "
                "gradient_accumulation_steps (each sp.backward is one micro-step, reduced as engine.backward would; "
                "engine.step() steps at the boundary), so sharedprefix has no synchronisation to skip. Leave "
                "sync=True and set gradient_accumulation_steps in the DeepSpeed config."
            )


def _leaf_hooks(engine) -> list:
    """[(leaf module, handle of the full backward hook ZeRO-3 reduces its gradient in)] (none below ZeRO-3)."""
    handles = getattr(engine.optimizer, "_leaf_module_hooks", None) or []
    if int(engine.zero_optimization_stage()) != 3 or not handles:
        return []
    modules = {id(m._backward_hooks): m for m in engine.module.modules()}
    return [(modules[id(h.hooks_dict_ref())], h) for h in handles]


def _names(leaf_hooks) -> str:
    return ", ".join(sorted({type(m).__name__ for m, _ in leaf_hooks}))


def _partitioned(params) -> list:
    """The ZeRO-3 parameters among ``params`` that are partitioned now: those that are whole already (a persistent
    one, or one a module's forward or backward holds) stay as their holder leaves them."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return [p for p in params if getattr(p, "ds_status", None) == ZeroParamStatus.NOT_AVAILABLE]


def _refuse(engine, tensor: int) -> None:
    """Raise ValueError for a DeepSpeed setting sharedprefix does not run exactly (module docstring), naming it."""
    zeropp = [
        name
        for name, on in (
            ("zero_quantized_weights", engine.zero_quantized_weights()),
            ("zero_quantized_gradients", engine.zero_quantized_gradients()),
            ("zero_hpz_partition_size", int(engine.zero_hpz_partition_size()) > 1),
        )
        if on
    ]
    if zeropp:
        raise ValueError(
            f"the DeepSpeed engine uses ZeRO++ ({', '.join(zeropp)}): quantised weight gathers, quantised gradient "
            "reduction and hierarchical partitioning change what the ranks exchange, and sharedprefix has not "
            "verified its results against DeepSpeed's own run with them (which does not run on the CPU test "
            "processes). Turn them off (ZeRO-3 without them is exact)."
        )
    if engine.fp16_enabled():
        raise ValueError(
            "the DeepSpeed engine has fp16 enabled (dynamic loss scaling): sharedprefix's backward runs outside "
            'DeepSpeed\'s loss scaler. Use bf16 ("bf16": {"enabled": true}) or float32.'
        )
    if tensor > 1:
        raise ValueError(
            f"the DeepSpeed engine's model is tensor-parallel (tp_size={tensor}), which sharedprefix has not been "
            "verified with under DeepSpeed. Use tensor parallelism alone or under FSDP2."
        )
