"""Shared pieces of the verl tests (one process and torchrun workers): model, engines, batches, references.

Import ``verl_cpu`` before this module (it sets verl's CPU platform before verl's engine modules load).
Notation: B = rows of a batch, P = prompt columns (left-padded), R = response columns (right-padded), G = group size.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
import transformers as tf
from tensordict import TensorDict
from verl.trainer.config import CheckpointConfig
from verl.utils import tensordict_utils as tu
from verl.workers.config import FSDPActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from sharedprefix.tools.reference import dtype_faithful_norms

VOCAB = 96


def save_model(path: str) -> str:
    """A tiny random Qwen3 (2 layers, GQA) saved with save_pretrained; verl builds its engines from the folder."""
    cfg = tf.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        architectures=["Qwen3ForCausalLM"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = tf.Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # a less uniform distribution than the tiny init gives, so that clipping and KL bite
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(path)
    return path


def configs(path: str, attn: str = "sdpa", remove_padding: bool = True, **engine):
    model = HFModelConfig(
        path=path,
        load_tokenizer=False,
        override_config={"attn_implementation": attn},
        use_remove_padding=remove_padding,
        enable_gradient_checkpointing=True,
    )
    fields = dict(
        strategy="fsdp2",
        model_dtype="fp32",
        use_torch_compile=False,
        forward_only=False,
        mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
    )
    fields.update(engine)
    return model, FSDPEngineConfig(**fields), FSDPOptimizerConfig(lr=1e-3, total_training_steps=10), CheckpointConfig()


def build(cls, path: str, attn: str = "sdpa", remove_padding: bool = True, **engine):
    model, eng, optim, ckpt = configs(path, attn, remove_padding, **engine)
    e = cls(model_config=model, engine_config=eng, optimizer_config=optim, checkpoint_config=ckpt)
    e.initialize()
    return e


@dataclass
class Spec:
    """Groups of a batch: prompt lengths, and per group the response lengths of its G rows."""

    prompts: list[int]
    responses: list[list[int]]
    seed: int = 0
    shared_system: int = 4  # every prompt starts with the same tokens (a system prompt shared across groups)
    tool_span: tuple[int, int] | None = (1, 3)  # response columns masked out (tool output) in rows longer than 3
    order: list[int] | None = None  # a row permutation (None: group after group)
    extra: dict = field(default_factory=dict)


def rl_batch(
    spec: Spec, *, temperature=1.0, entropy=True, dynamic=False, micro=None, max_tokens=None, remove_padding=True
):
    """A verl RL mini-batch in no-padding form, as the trainer hands it to ``update_actor`` / ``compute_log_prob``
    (``remove_padding``: the worker's ``use_remove_padding``, which decides how verl's engine lays out the rows)."""
    g = torch.Generator().manual_seed(spec.seed)
    system = torch.randint(1, VOCAB, (spec.shared_system,), generator=g)
    rows = []
    for p, lens in zip(spec.prompts, spec.responses):
        prompt = torch.cat([system, torch.randint(1, VOCAB, (p - spec.shared_system,), generator=g)])
        for r in lens:
            rows.append((prompt, torch.randint(1, VOCAB, (r,), generator=g)))
    if spec.order is not None:
        rows = [rows[i] for i in spec.order]
    prompts, responses, attn = _left_padded([(p, r) for p, r in rows])
    mask = attn[:, prompts.shape[1] :].clone()
    if spec.tool_span is not None:
        a, b = spec.tool_span
        long = mask.sum(1) > b
        mask[long, a:b] = 0
    flags = dict(remove_padding=remove_padding, dynamic=dynamic, temperature=temperature, entropy=entropy)
    return _tensordict(
        prompts, responses, attn, (attn.cumsum(1) - 1).clamp(min=0), mask, g, micro, max_tokens, flags, spec.extra
    )


def _left_padded(rows):
    """(B, P) left-padded prompts, (B, R) right-padded responses and the (B, P + R) attention mask of (prompt,
    response) rows, as verl lays a batch out before removing its padding."""
    B, P, R = len(rows), max(len(p) for p, _ in rows), max(len(r) for _, r in rows)
    prompts = torch.zeros(B, P, dtype=torch.long)
    responses = torch.zeros(B, R, dtype=torch.long)
    attn = torch.zeros(B, P + R, dtype=torch.long)
    for i, (p, r) in enumerate(rows):
        prompts[i, P - len(p) :] = p
        attn[i, P - len(p) : P] = 1
        responses[i, : len(r)] = r
        attn[i, P : P + len(r)] = 1
    return prompts, responses, attn


def _tensordict(prompts, responses, attn, pos, mask, g, micro, max_tokens, flags, extra=None, multi_modal=None):
    """The batch as verl's engine takes it: padding removed (nested tensors), old / reference log-probs near the
    model's (about -4.5 nats per token here, spread so that ratios clip), one advantage per row, the engine flags."""
    B, R = responses.shape
    td = TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attn,
            "position_ids": pos,
            "response_mask": mask,
            "old_log_probs": -4.5 + 0.6 * torch.randn(B, R, generator=g),
            "ref_log_prob": -4.5 + 0.6 * torch.randn(B, R, generator=g),
            "advantages": torch.randn(B, 1, generator=g).expand(B, R).contiguous(),
        },
        batch_size=[B],
    )
    td = left_right_2_no_padding(td)
    if multi_modal is not None:
        tu.assign_non_tensor_stack(td, "multi_modal_inputs", multi_modal)
    tu.assign_non_tensor(
        td,
        use_remove_padding=flags["remove_padding"],
        use_dynamic_bsz=flags["dynamic"],
        temperature=flags["temperature"],
        calculate_entropy=flags["entropy"],
        use_fused_kernels=False,
        global_batch_size=B,
        micro_batch_size_per_gpu=micro or B,
        max_token_len_per_gpu=max_tokens or 4096,
        **(extra or {}),
    )
    return td


LOSSES = {
    # clipping + KL (k3 "low_var_kl") + entropy bonus, token-mean over the global batch
    "clip_kl_entropy": dict(
        loss_agg_mode="token-mean",
        use_kl_loss=True,
        kl_loss_coef=0.1,
        entropy_coeff=0.01,
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
    ),
    "seq_mean_token_mean": dict(loss_agg_mode="seq-mean-token-mean", clip_ratio=0.2),
    "gspo_seq_sum_norm": dict(
        loss_agg_mode="seq-mean-token-sum-norm",
        policy_loss={"loss_mode": "gspo"},
        clip_ratio_low=3e-4,
        clip_ratio_high=4e-4,
    ),
}


def loss_fn(name: str, rows: int, **overrides):
    """verl's ``ppo_loss`` as its worker binds it (``partial(ppo_loss, config=actor_config)``) under the settings
    ``LOSSES[name]``, with ``overrides`` replacing or adding settings (``policy_loss``: a dict of
    PolicyLossConfig's)."""
    kw = {**LOSSES[name], **overrides}
    if "policy_loss" in kw:
        from verl.workers.config import PolicyLossConfig

        kw["policy_loss"] = PolicyLossConfig(**kw["policy_loss"])
    cfg = FSDPActorConfig(
        strategy="fsdp2", rollout_n=1, ppo_mini_batch_size=rows, ppo_micro_batch_size_per_gpu=rows, **kw
    )
    return partial(ppo_loss, config=cfg)


def infer(engine, td):
    with engine.eval_mode():
        out = engine.infer_batch(td)
    return out


def train(engine, td, loss, frozen_ok: bool = False):
    """forward_backward_batch as BaseEngine.train_batch runs it (without the optimizer step); returns (output,
    grads). ``frozen_ok``: parameters without a gradient (LoRA's frozen base weights) are left out of grads; else
    every parameter must have one."""
    with engine.train_mode(zero_grad_on_exit=False):
        engine.optimizer_zero_grad()
        out = engine.forward_backward_batch(td, loss, forward_only=False)
        params = engine.module.named_parameters()
        grads = {n: _full(p.grad) for n, p in params if not (frozen_ok and p.grad is None)}
        engine.optimizer_zero_grad()
    return out, grads


def _full(t):
    return t.full_tensor().detach().clone() if hasattr(t, "full_tensor") else t.detach().clone()


def responses_of(nested, td):
    """(B, R) response positions of a model output (verl's own slicing)."""
    return no_padding_2_padding(nested, td)


def reference(path: str, td, loss=None, temperature=1.0):
    """Float64 yardstick: a plain transformers forward of each row (norms computed in float64), verl's loss on it.

    Returns ((B, R) log-probs, (B, R) entropies, {name: grad} or None).
    """
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager")
    model.config._experts_implementation = "eager"  # (MoE: torch's grouped_mm, the default on CPU, has no float64)
    dtype_faithful_norms(model)
    model.train(loss is not None)
    ids = td["input_ids"]
    lps, ents = [], []
    for row in ids.unbind():
        logits = model(input_ids=row[None]).logits[0] / temperature  # (len, V)
        logp = torch.log_softmax(logits, -1)
        nxt = torch.roll(row, -1)
        lps.append(logp.gather(1, nxt[:, None])[:, 0])
        ents.append(-(logp.exp() * logp).sum(-1))
    offsets = ids.offsets()
    out = {
        "log_probs": torch.nested.nested_tensor_from_jagged(torch.cat(lps), offsets),
        "entropy": torch.nested.nested_tensor_from_jagged(torch.cat(ents), offsets),
    }
    grads = None
    if loss is not None:
        tu.assign_non_tensor(td, batch_num_tokens=int(td["loss_mask"].sum()), dp_size=1)
        value, _ = loss(model_output=out, data=td, dp_group=None)
        value.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        return responses_of(out["log_probs"], td), responses_of(out["entropy"], td), grads


def micro_batch_rows(td, dp_group=None) -> list[list[int]]:
    """verl's own micro-batches of ``td`` (row indices), as its engine forms them (``prepare_micro_batches``; with
    ``dp_group``, the same number on every rank of it)."""
    from verl.workers.engine.utils import prepare_micro_batches

    mbs, indices = prepare_micro_batches(data=td, dp_group=dp_group, same_micro_num_in_dp=True)
    if indices is not None:
        return [list(i) for i in indices]
    sizes = [len(mb) for mb in mbs]
    return [list(range(sum(sizes[:k]), sum(sizes[: k + 1]))) for k in range(len(sizes))]


def float64_step(path: str, td, loss, parts, temperature=1.0, weights=torch.float32, batch_num_tokens=None, dp_size=1):
    """Float64 yardstick of a training mini-batch: a plain forward of each row (norms in float64) from the saved
    weights rounded to ``weights`` (the master weights an engine holds: verl's ``model_dtype``), verl's ``loss``
    evaluated on verl's micro-batches ``parts`` (row lists) as its engine evaluates it and summed. Under ``dp_size``
    ranks, ``batch_num_tokens`` is the global mini-batch's (the gradient returned is this rank's share, to be
    averaged over the ranks as FSDP2 does).

    Returns ((B, R) log-probs, (B, R) entropies, {name: grad}, [loss of each part], [metrics of each part])."""
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(weights).double())
    dtype_faithful_norms(model)
    lps, ents = [], []
    for row in td["input_ids"].unbind():
        logp = torch.log_softmax(model(input_ids=row[None]).logits[0] / temperature, -1)  # (len, V)
        lps.append(logp.gather(1, torch.roll(row, -1)[:, None])[:, 0])
        ents.append(-(logp.exp() * logp).sum(-1))
    tokens = int(td["loss_mask"].sum()) if batch_num_tokens is None else batch_num_tokens
    tu.assign_non_tensor(td, batch_num_tokens=tokens, dp_size=dp_size)
    total, losses, metrics = 0.0, [], []
    for part in parts:
        offsets = torch.tensor([0] + [len(lps[i]) for i in part]).cumsum(0)
        out = {
            key: torch.nested.nested_tensor_from_jagged(torch.cat([values[i] for i in part]), offsets)
            for key, values in (("log_probs", lps), ("entropy", ents))
        }
        value, m = loss(model_output=out, data=tu.index_select_tensor_dict(td, part), dp_group=None)
        total = total + value
        losses.append(float(value.detach()))
        metrics.append(m)
    names = [n for n, _ in model.named_parameters()]
    grads = dict(zip(names, torch.autograd.grad(total, list(model.parameters()))))
    offsets = td["input_ids"].offsets()
    with torch.no_grad():
        lp = responses_of(torch.nested.nested_tensor_from_jagged(torch.cat(lps), offsets), td)
        ent = responses_of(torch.nested.nested_tensor_from_jagged(torch.cat(ents), offsets), td)
    return lp, ent, grads, losses, metrics


def reported_scalars(out) -> dict[str, torch.Tensor]:
    """The loss and every metric of verl's loss an engine reported, per micro-batch (float64)."""
    values = {"loss": torch.tensor(out["loss"], dtype=torch.float64)}
    for key, m in out["metrics"].items():
        if not key.startswith("sharedprefix/"):
            values[key] = torch.tensor(getattr(m, "values", m), dtype=torch.float64)
    return values


def float64_scalars(losses: list, metrics: list) -> dict[str, torch.Tensor]:
    """``float64_step``'s losses and metrics of each micro-batch, as ``reported_scalars`` lays them out."""
    values = {"loss": torch.tensor(losses, dtype=torch.float64)}
    for key in metrics[0]:
        values[key] = torch.tensor(
            [float(getattr(m[key], "values", [m[key]])[0]) for m in metrics], dtype=torch.float64
        )
    return values


def scalars_error(got: dict, want: dict) -> float:
    """The largest error over the loss and the metrics of every micro-batch, each relative to its largest value."""
    worst = 0.0
    for key, ref in want.items():
        if got[key].shape != ref.shape:
            return float("inf")
        scale = ref.abs().max()
        worst = max(worst, float((got[key] - ref).abs().max() / scale) if scale > 0 else float(got[key].abs().max()))
    return worst


def rel(a: dict, b: dict) -> float:
    """Largest per-parameter max |a - b| / max |b| over the parameters."""
    return max(
        float((a[n].double() - b[n].double()).abs().max() / b[n].double().abs().max().clamp(min=1e-30)) for n in b
    )


def masked_rel(a, b, mask) -> float:
    d = (a.double() - b.double()).abs()[mask]
    return float(d.max() / b.double().abs()[mask].max())


def float64_errors(engine, make, loss, reference) -> dict[str, float]:
    """``engine``'s errors against a float64 run of the same update (``reference``: its log-probs, entropies,
    gradients and ``float64_scalars``) on the batch ``make()`` builds: "log_probs" and "entropy" (over the response
    tokens), "grads", "scalars" (the loss and every metric, ``scalars_error``)."""
    lp64, ent64, g64, want = reference
    td = make()
    resp = td["attention_mask"][:, -td["responses"].shape[1] :].bool()
    out = infer(engine, make())["model_output"]
    trained, grads = train(engine, make(), loss)
    return {
        "log_probs": masked_rel(responses_of(out["log_probs"], td), lp64, resp),
        "entropy": masked_rel(responses_of(out["entropy"], td), ent64, resp),
        "grads": rel(grads, g64),
        "scalars": scalars_error(reported_scalars(trained), want),
    }


def world() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


# -- torchrun workers -------------------------------------------------------------------------------------------------


def start_worker(workdir: str, before_model=None) -> tuple[int, int, str]:
    """A worker's set-up: the gloo process group, one thread, ``before_model()`` (if given), rank 0 saves the
    model under ``workdir`` while the others wait. Returns (rank, world size, model path)."""
    rank, size = world()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if before_model is not None:
        before_model()
    path = os.path.join(workdir, "model")
    if rank == 0:
        save_model(path)
    dist.barrier()
    return rank, size, path


def case_errors(ev, engine, make, lf, wrap_ours=None, grad_scale=False) -> dict:
    """One case of a worker: ``engine`` against verl's ``ev`` on this rank's batch ``make()`` (inference, then
    training with the loss ``lf``); the relative errors, the largest over the ranks. ``wrap_ours(run)``, if given,
    wraps our inference call (``run``: a function returning its output). ``grad_scale``: add the largest |gradient|
    of verl's engine (a test checks it is not zero)."""
    theirs = infer(ev, make())
    ours = wrap_ours(lambda: infer(engine, make())) if wrap_ours is not None else infer(engine, make())
    td = make()
    resp = td["attention_mask"][:, -td["responses"].shape[1] :].bool()
    errs = {}
    for key in ("log_probs", "entropy"):
        errs[key] = masked_rel(
            responses_of(ours["model_output"][key], td), responses_of(theirs["model_output"][key], td), resp
        )
    (o_v, g_v), (o_s, g_s) = train(ev, make(), lf), train(engine, make(), lf)
    errs["grads"] = rel(g_s, g_v)
    errs["loss"] = abs(sum(o_s["loss"]) - sum(o_v["loss"])) / abs(sum(o_v["loss"]))
    errs["metrics"] = metrics_error(o_s["metrics"], o_v["metrics"])
    if grad_scale:
        errs["grad_scale"] = max(float(g.abs().max()) for g in g_v.values())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, errs)
    return {k: max(e[k] for e in gathered) for k in errs}


def metrics_error(ours: dict, theirs: dict) -> float:
    """The largest relative difference of verl's metrics (each a value, a list of per-micro-batch values or a verl
    ``Metric``) between two outputs; a difference within 1e-6 counts as none (as ``pytest.approx(abs=1e-6)``)."""

    def values(m):
        m = m.aggregate() if hasattr(m, "aggregate") else m
        return torch.tensor([float(x) for x in (m if isinstance(m, (list, tuple)) else [m])], dtype=torch.float64)

    worst = 0.0
    for key, value in theirs.items():
        a, b = values(ours[key]), values(value)
        if a.shape != b.shape:
            return float("inf")
        d = (a - b).abs()
        d = torch.where(d <= 1e-6, torch.zeros_like(d), d / b.abs().clamp(min=1e-30))
        worst = max(worst, float(d.max()) if d.numel() else 0.0)
    return worst


def finish_worker(result: str, out: dict) -> None:
    """Rank 0 writes ``out`` (case -> errors) to ``result`` as JSON; every rank leaves the process group."""
    if dist.get_rank() == 0:
        with open(result, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


__all__ = [
    "FSDPEngineWithLMHead",
    "IMAGE",
    "LOSSES",
    "Spec",
    "build",
    "case_errors",
    "configs",
    "finish_worker",
    "float64_scalars",
    "float64_step",
    "infer",
    "loss_fn",
    "masked_rel",
    "metrics_error",
    "micro_batch_rows",
    "reference",
    "reported_scalars",
    "rel",
    "responses_of",
    "rl_batch",
    "save_model",
    "scalars_error",
    "save_vl_model",
    "verl_attention_unpatched",
    "vl_batch",
    "VLSpec",
    "start_worker",
    "train",
    "world",
]


# -- vision-language rows (Qwen2-VL) -----------------------------------------------------------------------------------

IMAGE, VIDEO, V_START, V_END = 100, 101, 102, 103
VL_VOCAB = 120


_VL_TEXT = dict(
    vocab_size=VL_VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
_VL_VISION = dict(
    depth=1, hidden_size=32, num_heads=2, in_channels=3, patch_size=2, spatial_merge_size=2, temporal_patch_size=2
)
_VL_TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=V_START, vision_end_token_id=V_END)


def save_vl_model(path: str, kind: str = "qwen2_vl") -> str:
    """A tiny random Qwen2-VL, Qwen2.5-VL or Qwen3-VL (2 text layers, GQA, M-RoPE; a 1-block vision tower) saved
    with save_pretrained."""
    mrope = dict(rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]})
    if kind == "qwen2_vl":
        cfg = tf.Qwen2VLConfig(
            text_config=dict(_VL_TEXT, **mrope), vision_config=dict(_VL_VISION, embed_dim=16, mlp_ratio=2), **_VL_TOKENS
        )
        cls = tf.Qwen2VLForConditionalGeneration
    elif kind == "qwen2_5_vl":
        vision = dict(_VL_VISION, intermediate_size=24, out_hidden_size=32, fullatt_block_indexes=[0], window_size=8)
        cfg = tf.Qwen2_5_VLConfig(text_config=dict(_VL_TEXT, **mrope), vision_config=vision, **_VL_TOKENS)
        cls = tf.Qwen2_5_VLForConditionalGeneration
    else:
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1], "mrope_interleaved": True}
        vision = dict(
            _VL_VISION,
            intermediate_size=24,
            out_hidden_size=32,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0],
        )
        cfg = tf.Qwen3VLConfig(
            text_config=dict(_VL_TEXT, head_dim=8, rope_parameters=rope), vision_config=vision, **_VL_TOKENS
        )
        cls = tf.Qwen3VLForConditionalGeneration
    cfg.architectures = [cls.__name__]
    cfg.tie_word_embeddings = False
    torch.manual_seed(0)
    model = cls(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(path)
    return path


@dataclass
class VLSpec:
    """Groups of a VL batch: per group (image grid (t, h, w) or None for a text prompt, text before, text after) and
    its G response lengths. ``same_text``: groups whose prompt tokens are group 0's (their images differ)."""

    prompts: list[tuple]
    responses: list[list[int]]
    seed: int = 0
    same_text: tuple[int, ...] = ()


def vl_batch(
    path: str,
    spec: VLSpec,
    *,
    remove_padding=True,
    temperature=1.0,
    entropy=True,
    dynamic=False,
    micro=None,
    max_tokens=None,
    order=None,
):
    """A verl RL mini-batch with images, as verl's agent loop builds it: per-row ``multi_modal_inputs``
    (pixel_values, image_grid_thw, images_seqlens) and (B, 4, L) position ids (text positions, then the model's
    get_rope_index positions, verl's ``_compute_position_ids``)."""
    g = torch.Generator().manual_seed(spec.seed)
    base = tf.AutoModelForImageTextToText.from_pretrained(path).model
    rows = []
    for gi, ((grid, before, after), lens) in enumerate(zip(spec.prompts, spec.responses)):
        text = torch.Generator().manual_seed(1000 * spec.seed + (0 if gi in spec.same_text else gi))
        parts, inputs = [torch.randint(1, 90, (before,), generator=text)], None
        if grid is not None:
            t, h, w = grid
            parts += [torch.tensor([V_START]), torch.full((t * h * w // 4,), IMAGE), torch.tensor([V_END])]
            grid_t = torch.tensor([grid])
            inputs = {
                "pixel_values": torch.randn(t * h * w, 3 * 2 * 2 * 2, generator=g),
                "image_grid_thw": grid_t,
                "images_seqlens": torch.repeat_interleave(grid_t[:, 1] * grid_t[:, 2], grid_t[:, 0]),
            }
        parts.append(torch.randint(1, 90, (after,), generator=text))
        prompt = torch.cat(parts)
        for r in lens:
            rows.append((prompt, torch.randint(1, 90, (r,), generator=g), inputs))
    if order is not None:
        rows = [rows[i] for i in order]
    prompts, responses, attn = _left_padded([(p, r) for p, r, _ in rows])
    B, P, R = len(rows), prompts.shape[1], responses.shape[1]
    pos = torch.zeros(B, 4, P + R, dtype=torch.long)
    for i, (p, r, inputs) in enumerate(rows):
        full = torch.cat([p, r])
        valid = attn[i].bool()
        kw = {}
        if inputs is not None:
            kw = dict(image_grid_thw=inputs["image_grid_thw"], mm_token_type_ids=(full == IMAGE).int()[None])
        else:
            kw = dict(mm_token_type_ids=torch.zeros(1, len(full), dtype=torch.int))
        with torch.no_grad():
            vision, _ = base.get_rope_index(input_ids=full[None], **kw)  # (3, 1, len)
        pos[i, 0, valid] = torch.arange(len(full))
        pos[i, 1:, valid] = vision[:, 0]
    flags = dict(remove_padding=remove_padding, dynamic=dynamic, temperature=temperature, entropy=entropy)
    mm = [inputs for _, _, inputs in rows]
    return _tensordict(prompts, responses, attn, pos, attn[:, P:].clone(), g, micro, max_tokens, flags, multi_modal=mm)


@contextmanager
def verl_attention_unpatched():
    """verl's engine as it runs with ``use_remove_padding=False`` (verl then leaves the VL attention classes alone):
    the transformers attention forwards back for the duration, although an engine built in this process with
    ``use_remove_padding=True`` replaced them process-wide. verl's other patches (model forwards) stay."""
    from sharedprefix.integrations.verl_vl import ORIGINALS

    swapped = []
    for (cls, attr), fn in ORIGINALS.items():
        if cls.__name__.endswith("Attention") and attr == "forward" and cls.__dict__.get(attr) is not fn:
            swapped.append((cls, cls.__dict__[attr]))
            cls.forward = fn
    try:
        yield
    finally:
        for cls, current in swapped:
            cls.forward = current
