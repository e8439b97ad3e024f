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
   groups too), response tokens trained, or, for a vision-language model, ``sp.Group``s with ``prompt_inputs``
   (below); ``verl_step`` runs them. Training plans all micro-batches of the call as one ``sp.plan_step`` step, so
   that each prompt is computed once per mini-batch however its rows are spread over the micro-batches, and runs
   micro-batch k's backward as ``sp.backward(model, step.microbatch(k), loss_fn)`` with verl's loss: called once on
   the micro-batch's log-probs inside its pass, or, where ``SHAREDPREFIX_MAX_TOKENS`` splits a micro-batch into
   several passes, evaluated on values computed first (one no-grad call over the mini-batch) and differentiated with
   respect to them, ``sp.backward`` then running the linear loss ``sum(dL/dlogp * logp + dL/dH * H)`` (exact by the
   chain rule). Gradients are averaged over ranks as FSDP2 does (``grad_reduction="mean"``) and reduced in the same
   micro-batches as verl. Forward-only calls (old-policy and reference log-probs, entropy) run one no-grad
   ``sp.logprobs`` over the mini-batch under a budget of verl's largest micro-batch, cut back into verl's
   micro-batches. A call that raises releases its step.
4. Outputs are verl's: ``log_probs`` / ``entropy`` as jagged tensors shifted by one (see
   ``verl_layout``), zero at the prompt positions (verl computes those too, but no loss reads
   them); the metrics gain ``sharedprefix/tokens_computed`` (with grad, when training),
   ``sharedprefix/tokens_no_grad`` and ``sharedprefix/tokens_plain`` (``verl_step``).

Ulysses (``ulysses_sequence_parallel_size > 1``): verl hands every rank of a sequence group the same
micro-batches, so every rank plans the same step; the engine passes verl's own Ulysses group as the core's
``sequence_group`` (``parallel.sequence``: each rank computes a slice of every packed row outside attention, a slice
of the heads inside it, and caches the shared prompts' K/V of its heads between micro-batches; log-probs whole on
every rank, verl's loss on them, FSDP2 over every rank summing the shares). verl's dynamic micro-batch budget is per
sequence group (``max_token_len_per_gpu * sp_size``), as in verl's engine.

Vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL; ``verl_vl``): the rows of each micro-batch with the same
prompt tokens and identical ``multi_modal_inputs`` become one ``sp.Group`` with ``prompt_inputs`` (a tree carries
none), wherever verl put them; the step merges a prompt's groups of several micro-batches (its vision tower and
prompt once per mini-batch); verl's 3-D position ids are checked against the model's own, and verl's process-wide
patches of those models' classes are undone for the duration of each sharedprefix call (``verl_vl.own_forward``).
With Ulysses they are refused when the engine is built (the core's sequence-parallel path refuses ``prompt_inputs``).

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

from contextlib import ExitStack

import torch
import torch.distributed as dist
import transformers
from verl.utils import tensordict_utils as tu
from verl.utils.dataset.dataset_utils import DatasetPadMode
from verl.utils.device import get_device_id, get_device_name
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches

from sharedprefix import settings
from sharedprefix.integrations import verl_step
from sharedprefix.integrations.verl_vl import check_vl_config, own_forward, row_inputs
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
        return self._step_batch(data, group, loss_function, forward_only)

    # the mini-batch as one step over verl's own micro-batches (verl_step) -----------------------------------------

    def _step_batch(self, data, group, loss_function, forward_only):
        micro_batches, indices = prepare_micro_batches(data=data, dp_group=group, same_micro_num_in_dp=True)
        temperature = _temperature(data)
        entropy = bool(tu.get_non_tensor_data(data=data, key="calculate_entropy", default=False))
        mbs = verl_step.micro_batches_of(micro_batches, get_device_id(), self.module if self.sp_vl else None)
        defer_sync = getattr(self.engine_config, "use_no_sync_for_gradient_accumulation", True)
        syncs = [k == len(mbs) - 1 or not defer_sync for k in range(len(mbs))]
        kw = dict(temperature=temperature, sequence_group=self._sequence_group())
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
