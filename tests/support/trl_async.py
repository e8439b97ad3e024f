"""TRL's AsyncGRPOTrainer driven on CPU without a vLLM server: a stub rollout worker that queues fixed rollouts, a
no-op weight transfer (both as TRL's own tests stub them), and CPU stand-ins for the two kernels TRL's own path needs
(the FA3 varlen attention its tree attention calls, and, for float64 runs, its float32 chunked log-prob head), plus a
``TreeRow`` that shares nothing (TRL's packing with tree packing off: one chain per sample). Needs trl and datasets."""

import math
import queue
import warnings

import numpy as np
import torch
from trl.experimental.async_grpo import async_grpo_trainer, packing
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample
from trl.trainer import utils as trl_utils

from helpers import tiny_model


def rollouts(vocab, n_groups, G, prompt_len, completion_lens, seed=0):
    """``n_groups`` groups of ``G`` rollouts (group by group, as a worker finishes them): a random prompt of
    ``prompt_len`` tokens, completions of random lengths in ``completion_lens``, old log-probs near a uniform model's
    (-log vocab, +-0.3, so that some tokens are clipped), advantages of mean 0 within each group."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for group in range(n_groups):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
        adv = torch.randn(G, generator=g, dtype=torch.float64)
        adv = (adv - adv.mean()).tolist()
        for i in range(G):
            t = int(torch.randint(completion_lens[0], completion_lens[1] + 1, (1,), generator=g))
            completion = torch.randint(3, vocab, (t,), generator=g).tolist()
            old = (-math.log(vocab) + 0.3 * (2 * torch.rand(t, generator=g, dtype=torch.float64) - 1)).tolist()
            out.append(
                RolloutSample(
                    prompt=[{"role": "user", "content": f"prompt {group}"}],
                    completion=[{"role": "assistant", "content": f"completion {i}"}],
                    input_ids=np.array(prompt + completion),
                    completion_mask=np.array([0] * prompt_len + [1] * t),
                    old_log_probs=np.array([0.0] * prompt_len + old),
                    advantage=float(adv[i]),
                    model_version=0,
                    group_id=group,
                    metrics={"reward": float(adv[i])},
                )
            )
    return out


class StubRolloutWorker:
    """Queues ``samples`` when started; nothing else (TRL's RolloutWorkerProtocol)."""

    def __init__(self, samples):
        self.rollout_buffer: queue.Queue = queue.Queue()
        self.metrics_queue: queue.Queue = queue.Queue()
        self._samples = samples

    def start(self):
        for s in self._samples:
            self.rollout_buffer.put(s)

    def stop(self):
        pass

    def update_model_version(self, model_version):
        pass

    def check_health(self, stale_after_s):
        raise RuntimeError("the stub rollout worker ran out of samples")


class StubWeightTransfer:
    """A no-op weight sync that drains the parameter stream, as the real client does (WeightTransferProtocol)."""

    def init_weight_transfer(self):
        pass

    def pause(self):
        pass

    def send_weights(self, iterator):
        for _ in iterator:
            pass

    def resume(self):
        pass

    def destroy(self):
        pass


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                     causal=True, window_size=(-1, -1), **kw):  # fmt: skip
    """flash-attention's ``flash_attn_varlen_func`` contract in plain torch, in the inputs' dtype: entry i's queries
    (the last of its keys, causal aligned to the bottom right) attend to its keys; q (Tq, H, D), k/v (Tk, Hkv, D)."""
    assert window_size == (-1, -1) and not kw, (window_size, kw)
    H, D = q.shape[1], q.shape[2]
    scale = softmax_scale if softmax_scale is not None else D**-0.5
    out = torch.empty_like(q)
    for i in range(cu_seqlens_q.numel() - 1):
        qs, qe, ks, ke = (int(x) for x in (cu_seqlens_q[i], cu_seqlens_q[i + 1], cu_seqlens_k[i], cu_seqlens_k[i + 1]))
        qi = q[qs:qe].transpose(0, 1)  # (H, n, D)
        ki = k[ks:ke].transpose(0, 1).repeat_interleave(H // k.shape[1], 0)
        vi = v[ks:ke].transpose(0, 1).repeat_interleave(H // v.shape[1], 0)
        s = qi @ ki.transpose(1, 2) * scale  # (H, n, m)
        n, m = qe - qs, ke - ks
        if causal:
            hidden = torch.arange(m)[None] > torch.arange(n)[:, None] + (m - n)
            s = s.masked_fill(hidden, float("-inf"))
        out[qs:qe] = (s.softmax(-1) @ vi).transpose(0, 1)
    return out


class ReferenceFlashAttn:
    """Stands in for ``packing._flash_attn()`` (the FA3 kernel from the Hub) on CPU."""

    flash_attn_varlen_func = staticmethod(varlen_attention)


class Float64Head:
    """TRL's ``_ChunkedLogProbFunction`` contract (log-prob and entropy of each row's label, temperature, soft-cap,
    logit scale) computed in the inputs' dtype with autograd, where TRL's computes in float32 (for float64 runs)."""

    @staticmethod
    def apply(hidden, weight, bias, labels, temperature, chunk_size, softcap, logit_scale, outputs):
        z = hidden @ weight.T + (0 if bias is None else bias)
        z = z * logit_scale
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        logp = (z / temperature).log_softmax(-1)
        lp = logp.gather(-1, labels[:, None])[:, 0]
        ent = -(logp.exp() * logp).sum(-1) if "entropy" in outputs else None
        return lp, ent, None, None, None


def patch_trl_kernels(monkeypatch, float64_head=False, share=True):
    """TRL's own path on CPU: the reference varlen attention for FA3, no MFU metric; with ``float64_head`` its head
    in the model's dtype; with ``share=False`` tree packing off (every sample its own chain)."""
    monkeypatch.setattr(packing, "_flash_attn", lambda: ReferenceFlashAttn)
    # TRL reads the CUDA device name for its MFU metric in __init__, which fails without CUDA; None: no MFU metric
    monkeypatch.setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda accelerator, dtype: None)
    if float64_head:
        monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", Float64Head)
    if not share:
        monkeypatch.setattr(async_grpo_trainer, "TreeRow", UnsharedRow)


class UnsharedRow(packing.TreeRow):
    """TRL's TreeRow with nothing shared: each sample gets a root of its own, so the packed row is one chain per
    sample (TRL's plain padding-free packing) and each segment attends to its own sample only."""

    def add(self, sample):
        roots, self.roots = self.roots, {}
        super().add(sample)
        ((key, node),) = self.roots.items()
        roots[(*key, len(self.samples))] = node
        self.roots = roots


def save_tiny_qwen3(path, vocab, seed=0):
    """A tiny Qwen3 (2 layers, width 32, 4 heads over 2 K/V heads) with ``vocab`` tokens, saved to ``path``."""
    model = tiny_model(
        "qwen3",
        dtype=torch.float32,
        seed=seed,
        vocab_size=vocab,
        intermediate_size=64,
        head_dim=8,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model.train().save_pretrained(path)
    return str(path)


def build(cls, cfg_cls, model_path, tok, out, samples, dtype=torch.float64, **settings):
    """``cls`` (``AsyncGRPOTrainer`` or ours) on the model at ``model_path`` in ``dtype``, fed ``samples`` by the
    stub worker; 2 plain-SGD steps at a constant rate of 0.5, CPU, no saving or reporting; ``settings`` add to or
    override these. Norms of a float64 model compute in float64 (``dtype_faithful_norms``)."""
    import datasets

    from sharedprefix.tools.reference import dtype_faithful_norms

    base = dict(
        output_dir=str(out),
        max_steps=2,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        use_cpu=True,
        bf16=False,
        # transformers kernelizes a model loaded with kernels installed on its first train(), which resets every
        # norm's forward (undoing dtype_faithful_norms): off, for both trainers
        model_init_kwargs={"dtype": dtype, "use_kernels": False},
        num_generations=4,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        token_budget=0,  # FixedCountBatcher: per_device_train_batch_size samples a microbatch
        epsilon=0.2,
    )
    args = cfg_cls(**{**base, **settings})
    data = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": "x"}]] * 4})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cls(
            model=model_path,
            reward_funcs=[],
            args=args,
            train_dataset=data,
            processing_class=tok,
            rollout_worker=StubRolloutWorker(samples),
            weight_transfer=StubWeightTransfer(),
        )
    if dtype == torch.float64:
        dtype_faithful_norms(trainer.model)
    return trainer


def train(trainer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return trainer
