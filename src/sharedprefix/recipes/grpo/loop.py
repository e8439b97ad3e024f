"""A compact GRPO loop on sharedprefix: sample G completions per prompt, score, one exact update.

Each step: draw ``prompts_per_step`` prompts (from a generator seeded by the step, so a resumed
run sees the same data), sample G completions each with the model's own ``generate`` (seeded
by the step too), compute group-relative advantages, and run ``sp.backward`` with the GRPO
loss under the token budget; then one optimizer step. One iteration per batch, so the
old policy is the current one (ratio 1, the clipped objective's gradient is -A grad log p).

Checkpoints hold the model (``save_pretrained``), the optimizer state, the step and the warm-up
flag, and replace the previous one atomically (``checkpoint``); no RNG state is needed, since
every step seeds its own data and sampling. Metrics are JSONL, one line per step, and a resumed
run drops lines of steps it will redo, so no step is lost or repeated.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict

import torch
from tqdm import tqdm

import sharedprefix as sp
from sharedprefix import losses
from sharedprefix.recipes.grpo import checkpoint
from sharedprefix.recipes.grpo.config import TrainConfig

__all__ = [
    "TrainConfig",
    "Trainer",
    "check_rewards",
    "encode_prompt",
    "read_metrics",
    "sample_completions",
    "write_metrics",
]


def check_rewards(values, n: int) -> list[float]:
    """Rewards from a reward function: exactly ``n`` finite numbers."""
    values = list(values)
    if len(values) != n:
        raise ValueError(f"the reward function returned {len(values)} values for {n} completions; expected one each.")
    for i, v in enumerate(values):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise ValueError(f"the reward function returned {v!r} for completion {i}; expected a finite number.")
    return [float(v) for v in values]


def encode_prompt(tokenizer, text: str) -> torch.Tensor:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) == 0:
        raise ValueError(f"the prompt {text[:80]!r} tokenizes to no tokens; a prompt needs at least one token.")
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def sample_completions(
    model, tokenizer, prompt_ids: torch.Tensor, n: int, max_new_tokens: int, temperature: float, seed: int
) -> list[torch.Tensor]:
    """n sampled completions of one prompt; each ends at its first EOS (kept) or at max_new_tokens."""
    torch.manual_seed(seed)
    ids = prompt_ids[None].repeat(n, 1)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    comps = []
    for row in out[:, prompt_ids.numel() :]:
        row = row.tolist()
        if tokenizer.eos_token_id in row:
            row = row[: row.index(tokenizer.eos_token_id) + 1]
        comps.append(torch.tensor(row or [tokenizer.eos_token_id], dtype=torch.long))
    return comps


class Trainer:
    def __init__(self, cfg: TrainConfig, model, tokenizer, task, reward_fn=None, ctx=None):
        from sharedprefix.recipes.grpo.distributed import Context

        self.cfg, self.model, self.tok, self.task = cfg, model, tokenizer, task
        self.ctx = ctx or Context()
        self.reward_fn = reward_fn or (lambda comps, answers: [task.reward(c, a) for c, a in zip(comps, answers)])
        self.params = [p for p in model.parameters() if p.requires_grad]  # all weights, or a LoRA adapter's
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=0.0)
        self.step = 0
        self.warm_done = False

    # -- data -------------------------------------------------------------------------------------------------
    def batch(self, step: int):
        rng = random.Random(self.cfg.seed * 1_000_003 + step)
        return [self.task.sample(rng) for _ in range(self.cfg.prompts_per_step)]

    # -- warm-up: teach the answer format (random values) with a few supervised steps ------------------------------
    def warmup(self):
        cfg = self.cfg
        opt = torch.optim.AdamW(self.params, lr=cfg.warmup_lr, weight_decay=0.0)
        rng = random.Random(cfg.seed + 17)
        # progress on stderr, only on a terminal (tqdm's disable=None) and only on rank 0
        for _ in tqdm(
            range(cfg.warmup_steps),
            desc="warm-up",
            disable=None if self.ctx.is_main else True,
            leave=False,
            dynamic_ncols=True,
        ):
            groups = []
            for s in [self.task.sample(rng) for _ in range(cfg.prompts_per_step)]:
                target = self.tok(self.task.warmup_target(rng), add_special_tokens=False)["input_ids"]
                groups.append(sp.Group(encode_prompt(self.tok, s.prompt), [target]))
            n = len(groups)  # global: one target per prompt
            mine = [groups[i] for i in self.ctx.shard(groups)]
            if mine:
                sp.backward(
                    self.model, mine, lambda b, n=n: -(b.logprobs * b.mask).sum() / n, max_tokens=cfg.max_tokens
                )
            self.ctx.sync(self.model)
            opt.step()
            opt.zero_grad(set_to_none=True)
        self.warm_done = True

    # -- one GRPO step ------------------------------------------------------------------------------------------
    def train_step(self) -> dict:
        cfg, step = self.cfg, self.step
        t0 = time.perf_counter()
        samples = self.batch(step)
        mine = self.ctx.shard(samples)
        groups, texts, answers = [], [], []
        self.model.eval()
        for i in mine:
            s = samples[i]
            p = encode_prompt(self.tok, s.prompt)
            comps = sample_completions(
                self.model,
                self.tok,
                p,
                cfg.group_size,
                cfg.max_new_tokens,
                cfg.temperature,
                seed=cfg.seed * 7_919 + step * 1_009 + i,
            )
            groups.append(sp.Group(p, comps))
            texts += [self.tok.decode(c.tolist(), skip_special_tokens=False) for c in comps]
            answers += [s.answer] * len(comps)
        self.model.train()
        rewards = torch.tensor(check_rewards(self.reward_fn(texts, answers), len(texts)), dtype=torch.float32)
        adv = losses.group_advantages(rewards, cfg.group_size)
        lens = torch.tensor([c.numel() for g in groups for c in g.completions])
        # global normalisers: completions and tokens of the whole step, over all ranks
        n_all = len(samples) * cfg.group_size
        tokens_all, reward_sum = self.ctx.all_sum([float(lens.sum()), float(rewards.sum())])
        if cfg.loss_type in ("dapo", "bnpo"):
            norm = tokens_all
        else:
            norm = losses.normalizer(cfg.loss_type, torch.ones(n_all, 1), cfg.max_new_tokens)
        stats = {"clipped": 0.0, "tokens": 0.0}

        def loss_fn(b):
            loss, m = losses.policy_loss(
                b.logprobs,
                b.logprobs.detach(),
                adv[b.index],
                b.mask,
                norm,
                loss_type=cfg.loss_type,
                epsilon=cfg.epsilon,
            )
            for k in stats:
                stats[k] += m[k]
            return loss

        res = sp.backward(
            self.model, groups, loss_fn, max_tokens=cfg.max_tokens, prefix_activations=cfg.prefix_activations
        )
        self.ctx.sync(self.model)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        self.step += 1
        correct, loss, computed, plain = self.ctx.all_sum(
            [float((rewards >= 1.0).sum()), res.loss, float(res.tokens_computed), float(res.tokens_plain)]
        )
        return {
            "step": step,
            "reward": reward_sum / n_all,
            "accuracy": correct / n_all,
            "loss": loss,
            "step_time_s": dt,
            "tokens_computed": int(computed),
            "tokens_plain": int(plain),
            "passes": res.passes,
            "tokens_per_s": plain / dt,
        }

    # -- checkpoints --------------------------------------------------------------------------------------------
    def save(self, folder: str, base_model: str | None = None):
        """Replace the checkpoint ``folder`` atomically (``checkpoint.save_checkpoint``)."""
        state = {
            "optimizer": self.opt.state_dict(),
            "step": self.step,
            "warm_done": self.warm_done,
            "config": asdict(self.cfg),
        }
        checkpoint.save_checkpoint(folder, self.model, self.tok, state, base_model)

    def load_state(self, state: dict):
        """Optimizer, step and warm-up flag from ``checkpoint.load_trainer_state`` (the weights are loaded
        with the model)."""
        self.opt.load_state_dict(state["optimizer"])
        self.step, self.warm_done = state["step"], state["warm_done"]


def read_metrics(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_metrics(path: str, rows: list[dict]):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)
