"""sharedprefix inside verl (0.9.1): an FSDP2 engine that computes each prompt once per mini-batch.

Importing this module (``VERL_USE_EXTERNAL_MODULES=sharedprefix.integrations.verl``, read by every
verl process when it imports ``verl``; verl's ``actor_rollout_ref.model.external_lib`` imports it
too, when a worker builds its model config, before the engine, though that path was not run in
the tests) replaces the
engine verl builds for every language-model backend (the policy and the reference model) with
``SharedPrefixFSDPEngine``, a subclass of verl's ``FSDPEngineWithLMHead`` that overrides
``forward_backward_batch`` (and ``initialize``, to check the built model). Model building, FSDP2
sharding, optimizer, checkpoints, weight sync and the losses stay verl's own. Anything that is not
FSDP2 is refused when the engine is built.

Per call (one mini-batch of one data-parallel rank):

1. verl's global normalisers, as verl computes them: ``batch_num_tokens`` (all-reduced) and
   ``dp_size``; ``loss_function`` (e.g. ``ppo_loss``) is verl's, unchanged.
2. verl's own micro-batches (``prepare_micro_batches``, exactly as verl's engine calls it: static
   ``micro_batch_size_per_gpu`` of any size, below rollout.n too, or dynamic token-budget micro-batches; no
   regrouping, ``force_group_size`` left alone), so that every loss of verl's (``geo_mean``, ``kl_cov``,
   ``clip_cov`` and bypass mode's batch-normalised importance weights too, which read the rows of each micro-batch)
   and every per-micro-batch metric is verl's.
3. Each micro-batch becomes a ``sharedprefix.Tree`` of its rows (a token trie: every shared prefix once, across
   groups too), response tokens trained; ``verl_step`` runs them. Training plans all micro-batches of the call as one
   ``sp.plan_step`` step, so that each prompt is computed once per mini-batch however its rows are spread over the
   micro-batches, and runs micro-batch k's backward as ``sp.backward(model, step.microbatch(k), loss_fn)`` with
   verl's loss: called once on the micro-batch's log-probs inside its pass, or, where ``SHAREDPREFIX_MAX_TOKENS``
   splits a micro-batch into several passes, evaluated on values computed first (one no-grad call over the
   mini-batch) and differentiated with respect to them, ``sp.backward`` then running the linear loss
   ``sum(dL/dlogp * logp + dL/dH * H)`` (exact by the chain rule). Gradients are averaged over ranks as FSDP2 does
   (``grad_reduction="mean"``) and reduced in the same micro-batches as verl. Forward-only calls (old-policy and
   reference log-probs, entropy) run one no-grad ``sp.logprobs`` over the mini-batch under a budget of verl's
   largest micro-batch, cut back into verl's micro-batches. A call that raises releases its step.
4. Outputs are verl's: ``log_probs`` / ``entropy`` as jagged tensors shifted by one (see
   ``verl_layout``), zero at the prompt positions (verl computes those too, but no loss reads
   them); the metrics gain ``sharedprefix/tokens_computed`` (with grad, when training),
   ``sharedprefix/tokens_no_grad`` and ``sharedprefix/tokens_plain`` (``verl_step``).

Ulysses and vision-language models keep a call per micro-batch (the core refuses a step with a sequence group; the
VL path builds groups with ``prompt_inputs`` per micro-batch): rows are regrouped by prompt (stable), with dynamic
batch sizes verl's ``force_group_size`` is set to the group size, a group split across micro-batches is refused
(naming the setting to change), and so is a loss of verl's that depends on the micro-batches where ours differ from
verl's (``verl_losses``); each micro-batch runs ``sp.logprobs`` / ``sp.backward`` on its own (the values-first path
under a budget, as above).

Ulysses (``ulysses_sequence_parallel_size > 1``): verl hands every rank of a sequence group the same
micro-batches; the engine passes verl's own Ulysses group as the core's ``sequence_group``
(``parallel.sequence``: each rank computes a slice of every packed row outside attention, a slice of the heads
inside it; log-probs whole on every rank, verl's loss on them, FSDP2 over every rank summing the shares). verl's
dynamic micro-batch budget is per sequence group (``max_token_len_per_gpu * sp_size``), as in verl's engine.

Vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL; ``verl_vl``): rows are grouped by prompt tokens and
identical ``multi_modal_inputs``, each micro-batch becomes ``sp.Group``s with ``prompt_inputs`` (a tree carries
none), verl's 3-D position ids are checked against the model's own, and verl's process-wide patches of those
models' classes are undone for the duration of each sharedprefix call (``verl_vl.own_forward``).

Hybrids: the core's cache-path hybrids (``model.mixers.FAMILIES``, path ``CACHE``) are refused at build (that path does
not run under FSDP2); the packed-path ones (``model.mixers``) are accepted when the core can reach their token mixers
in this transformers version (``check_model``, after verl builds the model), refused with the core's reason otherwise.
Under verl's transformers 5.10, LFM2 (its ``nn.Conv1d``: ``model.mixers.conv_module``) is accepted, and so are
Qwen3-Next and Qwen3.5, whose gated delta-nets bind their delta rule on each instance (wrapped there by
``model.mixers``); OLMo-hybrid, whose 5.10 convolutions are three ``nn.Conv1d`` subclasses with their own forward, is
refused.

Devices: the passes run on FSDP2's compute device, not on the device of a parameter, so that engines whose
parameters FSDP2 keeps in host memory (``CPUOffloadPolicy``: a forward-only engine such as the reference model,
which verl always offloads, and ``offload_policy=True``) compute where verl computes them.

Setting: ``SHAREDPREFIX_MAX_TOKENS`` (environment, read when the engine is built): tokens one
sharedprefix pass may hold; unset = one pass per micro-batch's own rows (whose computed tokens are at most the plain
count verl bounds), plus the step's shared prompts, recorded one segment at a time.

Notation: B = rows of a micro-batch, L = longest row, total = its tokens.
"""

from __future__ import annotations

from collections import Counter
from contextlib import ExitStack

import torch
import torch.distributed as dist
import transformers
from verl.utils import tensordict_utils as tu
from verl.utils.dataset.dataset_utils import DatasetPadMode
from verl.utils.device import get_device_id, get_device_name
from verl.utils.seqlen_balancing import restore_dynamic_batch
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.engine.utils import detach_tree, postprocess_batch_func, prepare_micro_batches

import sharedprefix as sp
from sharedprefix import settings
from sharedprefix.integrations import verl_step
from sharedprefix.integrations.verl_layout import (
    check_positions,
    group_keys,
    grouping_order,
    response_lengths,
    rows_of,
    split_groups,
    to_verl,
)
from sharedprefix.integrations.verl_losses import micro_batch_dependent, signature
from sharedprefix.integrations.verl_vl import (
    check_mrope_positions,
    check_vl_config,
    image_keys,
    own_forward,
    row_inputs,
    vl_groups,
)
from sharedprefix.integrations.verl_vl import to_rows as vl_to_rows
from sharedprefix.model import mixers
from sharedprefix.model.head import compiled_head

ENV_MAX_TOKENS = "SHAREDPREFIX_MAX_TOKENS"
__all__ = ["ENV_MAX_TOKENS", "SharedPrefixFSDPEngine", "check_config", "register"]


# -- refusals at engine build ---------------------------------------------------------------------------------------


def check_config(model_config, engine_config) -> None:
    """Raise ``ValueError`` for a verl setting this engine does not compute exactly (or would silently ignore)."""
    strategy = getattr(engine_config, "strategy", None)
    if strategy != "fsdp2":
        what = "FSDP1 (FullyShardedDataParallel)" if strategy == "fsdp" else f"the {strategy!r} backend"
        raise ValueError(
            f"strategy={strategy!r}: sharedprefix's verl engine runs on FSDP2 only, not {what}. Set "
            "actor_rollout_ref.actor.strategy=fsdp2 and actor_rollout_ref.ref.strategy=fsdp2 (or do not import "
            "sharedprefix.integrations.verl)."
        )
    for owner, name in ((model_config, "use_fused_kernels"), (engine_config, "use_fused_kernels")):
        if getattr(owner, name, False):
            raise ValueError(
                f"{name}=True: verl's fused kernels replace the model's forward and LM head, which sharedprefix "
                "computes itself. Set actor_rollout_ref.model.use_fused_kernels=False."
            )
    if getattr(model_config, "use_liger", False):
        raise ValueError(
            "use_liger=True: verl swaps the model's RMSNorm, rotary embedding and SwiGLU for Liger's Triton kernels, "
            "which run on GPUs only; sharedprefix's verl engine is checked against verl's own engine on CPU, where "
            "they cannot run, so the combination has never been compared and is refused rather than trusted. Set "
            "actor_rollout_ref.model.use_liger=False."
        )
    hf_config = getattr(model_config, "hf_config", None)
    model_type = getattr(hf_config, "model_type", None)
    if hf_config is not None and getattr(hf_config, "vision_config", None) is not None:
        check_vl_config(hf_config, int(getattr(engine_config, "ulysses_sequence_parallel_size", 1) or 1))
    text_type = getattr(hf_config.get_text_config(), "model_type", model_type) if hf_config is not None else None
    if mixers.on_path(text_type, mixers.CACHE):  # the core's cache path for hybrids (its packed ones: check_model)
        raise ValueError(
            f"model_type={text_type!r} is a hybrid model (recurrent, SSM or convolution layers beside attention) that "
            "sharedprefix runs on its cache path, which drives the model's own cache-aware forward and does not run "
            "inside FSDP2's unshard and reshard hooks; verl's engine is FSDP2. Train it without sharedprefix's verl "
            "engine (or with sp.backward under DDP)."
        )
    if getattr(model_config, "model_type", "language_model") != "language_model":
        raise ValueError(
            f"model_type={model_config.model_type!r}: sharedprefix's verl engine computes log-probs of a language "
            "model; it does not implement value or reward heads."
        )
    mp = getattr(engine_config, "mixed_precision", None) or {}
    if str(mp.get("param_dtype", "bf16")) in ("fp16", "float16"):
        raise ValueError(
            "mixed_precision.param_dtype=fp16: fp16 loss scaling is not supported by sharedprefix's verl engine. Use "
            "bf16 or fp32."
        )
    if getattr(engine_config, "pad_to_length", False):
        raise ValueError(
            "pad_to_length=True pads verl's packed micro-batch to static shapes; sharedprefix builds its own rows "
            "and would silently ignore it. Set actor_rollout_ref.actor.pad_to_length=False."
        )
    qat = getattr(engine_config, "qat", None)
    if qat is not None and getattr(qat, "enable", False):
        raise ValueError("qat.enable=True: quantisation-aware training is not supported by sharedprefix's verl engine.")
    if getattr(model_config, "enable_activation_offload", False):
        raise ValueError(
            "enable_activation_offload=True: verl's activation offloader (verl.utils.activation_offload) numbers the "
            "layers of one forward and expects that forward's backward next, while sharedprefix runs forwards without "
            "a backward (its head check, a split prompt's no-grad pass, FSDP2's recomputation), after which the "
            "offloader's layer window fails (KeyError). Set actor_rollout_ref.model.enable_activation_offload=False "
            "(sharedprefix's passes already hold only their own tokens' activations)."
        )


def check_model(module) -> None:
    """Raise ``ValueError``, once verl has built the model, for a hybrid whose token mixers the core's packed path
    cannot reach in this transformers version (``model.mixers.check_reachable``: the seams it wraps are missing, as
    OLMo-hybrid's three convolutions under 5.10, or a mixer holds a kernel package's function where the seam is bound
    on the instance). 5.10's gated delta-nets that bind the module's own ``torch_chunk_gated_delta_rule`` on the
    instance are reached (``model.mixers.active`` wraps the instance attribute too)."""
    if not mixers.on_packed_path(module):
        return
    try:
        mixers.check_reachable(module)
    except ValueError as e:
        raise ValueError(
            f"{e} (transformers {transformers.__version__}.) sharedprefix's verl engine refuses it when the engine is "
            "built; train it without the engine, or in an environment whose transformers calls those functions by "
            "their module-level names (5.24 does)."
        ) from e


def max_tokens_from_env() -> int | None:
    raw = settings.read(ENV_MAX_TOKENS).strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(
            f"{ENV_MAX_TOKENS}={raw!r}; expected a positive integer (tokens one sharedprefix pass may hold), or unset "
            "for one pass per micro-batch."
        )
    return value


# -- per-batch refusals -----------------------------------------------------------------------------------------------

_REFUSED_FLAGS = {
    "calculate_sum_pi_squared": "actor_rollout_ref.actor.calculate_sum_pi_squared=False",
    "distillation_use_topk": "distillation off (top-k distillation needs the full logits)",
    "distillation_only": "distillation off",
}


def _check_batch(data, vl: bool) -> None:
    if not vl and any(row_inputs(data, len(data))):
        raise ValueError(
            "the batch has multi_modal_inputs but the model is not a vision-language model; sharedprefix's verl engine "
            "would ignore them. Train a vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) on image rows."
        )
    pad_mode = tu.get_non_tensor_data(data=data, key="pad_mode", default=DatasetPadMode.NO_PADDING)
    if pad_mode != DatasetPadMode.NO_PADDING:
        raise ValueError(f"pad_mode={pad_mode!r}; sharedprefix's verl engine reads verl's no-padding layout only.")
    for key, fix in _REFUSED_FLAGS.items():
        if tu.get_non_tensor_data(data=data, key=key, default=False):
            raise ValueError(f"{key}=True is not supported by sharedprefix's verl engine; set {fix}.")
    for key in ("routed_experts", "teacher_logprobs"):
        if key in data.keys():
            raise ValueError(f"the batch has {key!r}; it is not supported by sharedprefix's verl engine.")
    for key in ("prompts", "responses", "input_ids", "position_ids"):
        if key not in data.keys():
            raise ValueError(
                f"the batch has no {key!r}; sharedprefix's verl engine handles RL batches (prompts and responses in "
                "verl's no-padding layout), not SFT batches."
            )


def _temperature(micro_batch) -> float:
    t = micro_batch.get("temperature", None) if "temperature" in micro_batch.keys() else None
    t = tu.unwrap_non_tensor_data(t)
    if t is None:
        raise ValueError("the micro-batch has no 'temperature'; verl's engine expects one (the rollout temperature).")
    if isinstance(t, torch.Tensor):
        distinct = torch.unique(t.detach().float().cpu())
        if distinct.numel() != 1:
            raise ValueError(
                f"per-sample temperatures ({distinct.tolist()[:4]}...) are not supported by sharedprefix's verl "
                "engine: rows sharing a prompt are computed together at one temperature. Use one rollout temperature."
            )
        t = float(distinct[0])
    return float(t)


# -- the engine -------------------------------------------------------------------------------------------------------


class SharedPrefixFSDPEngine(FSDPEngineWithLMHead):
    """verl's FSDP2 language-model engine with each micro-batch's shared prefixes computed once."""

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        check_config(model_config, engine_config)
        self.sp_max_tokens = max_tokens_from_env()
        hf_config = getattr(model_config, "hf_config", None)
        self.sp_vl = hf_config is not None and getattr(hf_config, "vision_config", None) is not None
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)

    def initialize(self):
        super().initialize()
        check_model(self.module)

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        _check_batch(data, self.sp_vl)
        tu.assign_non_tensor(data, sp_size=self.ulysses_sequence_parallel_size)  # verl's micro-batch budget reads it
        group = self.get_data_parallel_group()
        batch_num_tokens = data["loss_mask"].sum().to(get_device_id())
        dist.all_reduce(batch_num_tokens, op=dist.ReduceOp.SUM, group=group)
        tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens.item(), dp_size=self.get_data_parallel_size())
        if self.sp_vl or self.use_ulysses_sp:  # no step there (the core refuses one with a sequence group)
            return self._regrouped_batch(data, group, loss_function, forward_only)
        return self._step_batch(data, group, loss_function, forward_only)

    # the mini-batch as one step over verl's own micro-batches (verl_step) -----------------------------------------

    def _step_batch(self, data, group, loss_function, forward_only):
        micro_batches, indices = prepare_micro_batches(data=data, dp_group=group, same_micro_num_in_dp=True)
        temperature = _temperature(data)
        entropy = bool(tu.get_non_tensor_data(data=data, key="calculate_entropy", default=False))
        mbs = verl_step.micro_batches_of(micro_batches, get_device_id())
        defer_sync = getattr(self.engine_config, "use_no_sync_for_gradient_accumulation", True)
        syncs = [k == len(mbs) - 1 or not defer_sync for k in range(len(mbs))]
        kw = dict(temperature=temperature)
        with self._sp_context():
            if forward_only:
                outputs = verl_step.forward_only(self, mbs, loss_function, entropy, kw)
            else:
                outputs = verl_step.train(self, mbs, loss_function, entropy, syncs, kw)
        return postprocess_batch_func(output_lst=outputs, indices=indices, data=data)

    def _sp_context(self):
        """Around sharedprefix's calls: verl's autocast, the model's own class functions (verl's VL patches undone),
        and the head compiled as verl compiles its entropy (``use_torch_compile``)."""
        dtype = getattr(self, "_autocast_dtype", torch.bfloat16)
        stack = ExitStack()
        if dtype != torch.float32:
            stack.enter_context(torch.autocast(device_type=get_device_name(), dtype=dtype))
        stack.enter_context(own_forward())
        stack.enter_context(compiled_head(bool(getattr(self.engine_config, "use_torch_compile", False))))
        return stack

    # Ulysses and vision-language rows: each micro-batch its own call, rows regrouped by prompt --------------------

    def _regrouped_batch(self, data, group, loss_function, forward_only):
        resp = response_lengths(data["responses"], data.get("attention_mask", None))
        keys = group_keys(data["input_ids"], data["input_ids"].offsets().diff().cpu() - resp)
        if self.sp_vl:  # images belong to the prompt: a group is its prompt tokens and its inputs
            keys = [k + b"|" + m for k, m in zip(keys, image_keys(row_inputs(data, len(keys))))]
        order = grouping_order(keys)
        regrouped = order != list(range(len(order)))
        natural = self._natural_micro_batches(data, loss_function, forward_only)
        if regrouped:
            data = tu.index_select_tensor_dict(data, order)
            keys = [keys[i] for i in order]
        dynamic = tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True)
        sizes = set(Counter(keys).values())
        if dynamic and tu.get_non_tensor_data(data=data, key="force_group_size", default=1) == 1 and len(sizes) == 1:
            self._check_group_budget(data, keys)
            tu.assign_non_tensor(data, force_group_size=sizes.pop())

        micro_batches, indices = prepare_micro_batches(data=data, dp_group=group, same_micro_num_in_dp=True)
        members = indices if indices is not None else _chunks(len(keys), [len(mb) for mb in micro_batches])
        split = self._agree_max(len(split_groups(keys, members)))  # every rank raises, none waits for the others
        if split:
            raise ValueError(_split_message(split, dynamic, data))
        if natural is not None:
            ours = [[order[i] for i in mb] for mb in members]  # rows of verl's batch, in verl's order
            dependence, theirs = natural
            differ = signature(ours, dependence.on) != signature(theirs, dependence.on)
            if self._agree_max(int(differ)):  # every rank raises, none waits for the others
                raise ValueError(_membership_message(dependence.setting, ours, theirs, dynamic))

        outputs = []
        defer_sync = getattr(self.engine_config, "use_no_sync_for_gradient_accumulation", True)
        for i, mb in enumerate(micro_batches):
            sync = (i == len(micro_batches) - 1) or not defer_sync
            with torch.profiler.record_function(f"micro_batch{i}"):
                outputs.append(self._micro_batch(mb, loss_function, forward_only, sync))
        out = postprocess_batch_func(output_lst=outputs, indices=indices, data=data)
        if regrouped:
            out["model_output"] = {k: restore_dynamic_batch(v, [order]) for k, v in out["model_output"].items()}
        return out

    # one micro-batch ---------------------------------------------------------------------------------------------

    def _micro_batch(self, mb, loss_function, forward_only, sync):
        mb = mb.to(get_device_id())
        temperature = _temperature(mb)
        entropy = bool(tu.get_non_tensor_data(data=mb, key="calculate_entropy", default=False))
        rows = rows_of(mb["input_ids"], response_lengths(mb["responses"], mb.get("attention_mask", None)))
        source, align = rows.tree, (lambda values: values)
        if self.sp_vl:  # groups with prompt_inputs (a tree carries none); their (N, T) values back onto the rows
            hf_config = self.model_config.hf_config
            groups, members = vl_groups(
                mb["input_ids"], rows.prompt_lengths, row_inputs(mb, len(rows.lengths)), hf_config
            )
            check_mrope_positions(self.module, mb["position_ids"], groups, members, rows.lengths)
            source = groups
            align = lambda values: vl_to_rows(values, groups, members, rows.lengths, rows.prompt_lengths)  # noqa: E731
        else:
            check_positions(mb["position_ids"], rows.lengths)
        offsets = mb["input_ids"].offsets()
        plan = sp.plan(source, self.sp_max_tokens)
        dp_group = self.get_data_parallel_group()

        def model_output(lp, ent):
            out = {"log_probs": torch.nested.nested_tensor_from_jagged(to_verl(align(lp), rows.lengths), offsets)}
            if ent is not None:
                out["entropy"] = torch.nested.nested_tensor_from_jagged(to_verl(align(ent), rows.lengths), offsets)
            return out

        kw = dict(temperature=temperature, max_tokens=self.sp_max_tokens, sequence_group=self._sequence_group())
        with self._sp_context():
            if forward_only:
                with torch.no_grad():
                    res = sp.logprobs(self.module, source, entropy=entropy, **kw)
                    outs = model_output(res.logprobs, res.entropy)
                    loss, metrics = (
                        loss_function(model_output=outs, data=mb, dp_group=dp_group)
                        if loss_function is not None
                        else (torch.tensor(1.0), {})
                    )
                computed = plan.tokens_computed
            elif self._passes_agreed(len(plan.passes)) == 1:
                loss, metrics, outs, computed = self._one_pass(
                    source, mb, loss_function, model_output, entropy, sync, kw
                )
            else:
                loss, metrics, outs, computed = self._chain_rule(
                    source, mb, loss_function, model_output, entropy, sync, kw
                )
        metrics = dict(metrics)
        metrics["sharedprefix/tokens_computed"] = float(computed)
        metrics["sharedprefix/tokens_plain"] = float(plan.plain_tokens)
        out = {"loss": float(loss.detach().item()), "metrics": metrics}
        if forward_only or tu.get_non_tensor_data(data=mb, key="return_model_output", default=False):
            out["model_output"] = detach_tree(outs)  # training drops it, as verl does (train_batch discards it)
        return out

    def _natural_micro_batches(self, data, loss_function, forward_only):
        """(the loss's ``Dependence``, verl's own micro-batches of ``data`` as row lists) when training with a loss of
        verl's that depends on the micro-batches (``verl_losses.micro_batch_dependent``); None otherwise."""
        setting = None if forward_only or loss_function is None else micro_batch_dependent(loss_function)
        if setting is None:
            return None
        mbs, indices = prepare_micro_batches(
            data=data, dp_group=self.get_data_parallel_group(), same_micro_num_in_dp=True
        )
        rows = (
            [list(map(int, i)) for i in indices] if indices is not None else _chunks(len(data), [len(m) for m in mbs])
        )
        return setting, rows

    def _sequence_group(self):
        """verl's Ulysses group (``ulysses_sequence_parallel_size > 1``: its ranks hold the same micro-batches),
        the core's ``sequence_group``; None without Ulysses."""
        return self.ulysses_parallel_group if self.use_ulysses_sp else None

    def _agree_max(self, value: int) -> int:
        """The largest ``value`` over the data-parallel ranks (so that every rank takes the same branch)."""
        t = torch.tensor([value], dtype=torch.int64, device=get_device_id())
        if dist.is_initialized() and dist.get_world_size(self.get_data_parallel_group()) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.get_data_parallel_group())
        return int(t.item())

    def _passes_agreed(self, passes: int) -> int:
        """Every rank takes the same path (the chain-rule path runs one more set of FSDP2 collectives)."""
        return self._agree_max(passes)

    def _check_group_budget(self, data, keys) -> None:
        """verl's dynamic micro-batching counts plain tokens, and whole groups must fit its budget."""
        lengths = data["input_ids"].offsets().diff().tolist()
        plain: Counter = Counter()
        for k, n in zip(keys, lengths):
            plain[k] += n
        largest = self._agree_max(max(plain.values()))
        limit = int(tu.get_non_tensor_data(data=data, key="max_token_len_per_gpu", default=largest))
        limit *= self.ulysses_sequence_parallel_size  # verl's budget per sequence group, as prepare_micro_batches
        if largest > limit:
            raise ValueError(
                f"a prompt group holds {largest} tokens as plain rows, above the dynamic micro-batch budget "
                f"max_token_len_per_gpu={limit}: verl's dynamic batching counts plain tokens, and sharedprefix keeps "
                f"each group in one micro-batch (it then computes the prompt once). Raise "
                f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu (and the log_prob_max_token_len_per_gpu settings) "
                f"to at least {largest}; set {ENV_MAX_TOKENS} to bound the tokens of one sharedprefix pass."
            )

    def _one_pass(self, source, mb, loss_function, model_output, entropy, sync, kw):
        """The micro-batch in one pass: verl's loss on its log-probs, inside ``sp.backward``."""
        B = len(mb)
        seen = {}

        def loss_fn(batch):
            if batch.index.numel() != B:
                raise RuntimeError(f"expected one pass with all {B} rows, got {batch.index.numel()} (internal error).")
            lp = batch.logprobs.new_zeros(B, batch.logprobs.shape[1]).index_copy(0, batch.index, batch.logprobs)
            ent = (
                batch.entropy.new_zeros(B, batch.entropy.shape[1]).index_copy(0, batch.index, batch.entropy)
                if entropy
                else None
            )
            outs = model_output(lp, ent)
            loss, metrics = loss_function(model_output=outs, data=mb, dp_group=self.get_data_parallel_group())
            seen.update(loss=loss.detach(), metrics=metrics, outs=detach_tree(outs))
            return loss

        res = sp.backward(
            self.module,
            source,
            loss_fn,
            entropy=entropy,
            prefix_activations="recompute",
            sync=sync,
            grad_reduction="mean",
            **kw,
        )
        return seen["loss"], seen["metrics"], seen["outs"], res.tokens_computed

    def _chain_rule(self, source, mb, loss_function, model_output, entropy, sync, kw):
        """Several passes: verl's loss on values computed without a graph, then its gradient through ``sp.backward``."""
        with torch.no_grad():
            res = sp.logprobs(self.module, source, entropy=entropy, **kw)
        lp = res.logprobs.detach().requires_grad_(True)
        ent = res.entropy.detach().requires_grad_(True) if entropy else None
        outs = model_output(lp, ent)
        loss, metrics = loss_function(model_output=outs, data=mb, dp_group=self.get_data_parallel_group())
        leaves = [lp] + ([ent] if ent is not None else [])
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        g_lp = grads[0] if grads[0] is not None else torch.zeros_like(lp)
        g_ent = grads[1] if ent is not None and grads[1] is not None else None

        def linear(batch):
            total = (batch.logprobs * g_lp[batch.index].to(batch.logprobs.dtype)).sum()
            if g_ent is not None:
                total = total + (batch.entropy * g_ent[batch.index].to(batch.entropy.dtype)).sum()
            return total

        back = sp.backward(
            self.module,
            source,
            linear,
            entropy=g_ent is not None,
            prefix_activations="recompute",
            sync=sync,
            grad_reduction="mean",
            **kw,
        )
        computed = sp.plan(source, kw["max_tokens"]).tokens_computed + back.tokens_computed
        return loss.detach(), metrics, outs, computed


def _chunks(n: int, sizes: list[int]) -> list[list[int]]:
    out, a = [], 0
    for s in sizes:
        out.append(list(range(a, a + s)))
        a += s
    if a != n:
        raise RuntimeError(f"micro-batches hold {a} rows of {n} (internal error).")
    return out


def _rows(micro_batches: list[list[int]], shown: int = 4) -> str:
    text = "; ".join(str(mb if len(mb) <= 2 * shown else mb[:shown] + ["..."]) for mb in micro_batches[:shown])
    return text + ("; ..." if len(micro_batches) > shown else "")


def _membership_message(setting: str, ours: list[list[int]], natural: list[list[int]], dynamic: bool) -> str:
    how = (
        "with dynamic batch sizes it sets force_group_size, so its micro-batches are formed from whole groups"
        if dynamic
        else "its static micro-batches hold the rows regrouped by prompt"
    )
    return (
        f"{setting}, so its gradient depends on which rows share a micro-batch. sharedprefix's verl engine keeps each "
        f"prompt group in one micro-batch ({how}); for this batch its micro-batches (rows {_rows(ours)}) differ from "
        f"the ones verl's engine forms (rows {_rows(natural)}), and the result would differ from verl's. Use static "
        "micro-batches (actor_rollout_ref.actor.use_dynamic_bsz=False) of a multiple of rollout.n rows with the rows "
        "of each group adjacent, as verl's rollout and uid-level balancing deliver them (actor_rollout_ref.actor."
        "use_prefix_grouper=True, shuffle=False), or a policy loss normalised by global constants (vanilla, gspo, ...)."
    )


def _split_message(n: int, dynamic: bool, data) -> str:
    if dynamic:
        fix = (
            "with dynamic batch sizes the engine sets force_group_size to the group size, which needs every group "
            "of this rank to have the same number of rows: keep groups whole on one rank (set "
            "actor_rollout_ref.actor.use_prefix_grouper=True for uid-level balancing, or trainer.balance_batch="
            "False) and do not filter rows out of groups"
        )
    else:
        mbs = tu.get_non_tensor_data(data=data, key="micro_batch_size_per_gpu", default=None)
        fix = (
            f"static micro-batches of {mbs} rows split the groups: set ppo_micro_batch_size_per_gpu and the "
            "log_prob_micro_batch_size_per_gpu settings to multiples of rollout.n, and keep groups whole on one rank "
            "(actor_rollout_ref.actor.use_prefix_grouper=True)"
        )
    return (
        f"{n} prompt group(s) of this rank are split across micro-batches, so sharedprefix would compute their "
        f"prompts more than once; {fix}."
    )


# -- registration -----------------------------------------------------------------------------------------------------


def register() -> None:
    """Make ``SharedPrefixFSDPEngine`` the engine of every language-model backend verl has registered.

    verl's ``EngineRegistry.register`` refuses a second class for a (backend, device) key, so the
    existing entries are replaced in its table. Backends other than FSDP2 are taken too, so that a run
    that imported sharedprefix but picked another strategy is refused at engine build (see
    ``check_config``) instead of silently running without it.
    """
    table = EngineRegistry._engines.setdefault("language_model", {})
    for slots in table.values():
        for key in slots:
            slots[key] = SharedPrefixFSDPEngine
    for backend in ("fsdp", "fsdp2"):  # verl registers its FSDP engines for these devices
        for key in ("cuda", "npu"):
            table.setdefault(backend, {})[key] = SharedPrefixFSDPEngine


register()
