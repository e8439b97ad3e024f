"""A compact GRPO loop on sharedprefix: sample G completions per prompt, score, one exact update.

Each step: draw ``prompts_per_step`` prompts (from a generator seeded by the step, so a resumed
run sees the same data), sample G completions each with the model's own ``generate`` (seeded
by the step too), compute group-relative advantages, and run ``sp.backward`` with the GRPO
loss under the token budget; then one optimizer step. One iteration per batch, so the
old policy is the current one (ratio 1, the clipped objective's gradient is -A grad log p).

Checkpoints hold model, optimizer, step and RNG state and are written atomically (to a
temporary folder, then renamed); metrics are JSONL, one line per step, and a resumed run
drops lines of steps it will redo, so no step is lost or repeated.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass

import torch

import sharedprefix as sp
from sharedprefix import losses


@dataclass
class TrainConfig:
    task: str = "kv"
    records: int = 48
    model: str | None = None  # a local transformers checkpoint folder; None: the embedded default
    group_size: int = 8
    prompts_per_step: int = 8
    steps: int = 300
    warmup_steps: int = 30
    lr: float = 1e-3
    warmup_lr: float = 3e-3
    max_new_tokens: int = 3
    temperature: float = 1.0
    max_tokens: int | None = 1024
    prefix_activations: str = "keep"
    loss_type: str = "grpo"
    epsilon: float = 0.2
    seed: int = 0
    output: str = "runs/default"
    checkpoint_every: int = 20
    resume: bool = True
    bench: bool = True
    threads: int | None = None


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
def sample_completions(model, tokenizer, prompt_ids: torch.Tensor, n: int, max_new_tokens: int, temperature: float,
                       seed: int) -> list[torch.Tensor]:
    """n sampled completions of one prompt; each ends at its first EOS (kept) or at max_new_tokens."""
    torch.manual_seed(seed)
    ids = prompt_ids[None].repeat(n, 1)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=temperature,
                         top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    comps = []
    for row in out[:, prompt_ids.numel():]:
        row = row.tolist()
        if tokenizer.eos_token_id in row:
            row = row[: row.index(tokenizer.eos_token_id) + 1]
        comps.append(torch.tensor(row or [tokenizer.eos_token_id], dtype=torch.long))
    return comps


class Trainer:
    def __init__(self, cfg: TrainConfig, model, tokenizer, task, reward_fn=None, ctx=None):
        from sharedprefix.training.distributed import Context

        self.cfg, self.model, self.tok, self.task = cfg, model, tokenizer, task
        self.ctx = ctx or Context(model)
        self.reward_fn = reward_fn or (lambda comps, answers: [task.reward(c, a) for c, a in zip(comps, answers)])
        self.opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
        self.step = 0
        self.warm_done = False

    # -- data -------------------------------------------------------------------------------------------------
    def batch(self, step: int):
        rng = random.Random(self.cfg.seed * 1_000_003 + step)
        return [self.task.sample(rng) for _ in range(self.cfg.prompts_per_step)]

    # -- warm-up: teach the answer format (random values) with a few supervised steps ------------------------------
    def warmup(self):
        cfg = self.cfg
        opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.warmup_lr, weight_decay=0.0)
        rng = random.Random(cfg.seed + 17)
        for _ in range(cfg.warmup_steps):
            groups = []
            for s in [self.task.sample(rng) for _ in range(cfg.prompts_per_step)]:
                target = self.tok(self.task.warmup_target(rng), add_special_tokens=False)["input_ids"]
                groups.append(sp.Group(encode_prompt(self.tok, s.prompt), [target]))
            n = len(groups)  # global: one target per prompt
            mine = [groups[i] for i in self.ctx.shard(groups)]
            if mine:
                sp.backward(self.model, mine, lambda b, n=n: -(b.logprobs * b.mask).sum() / n, max_tokens=cfg.max_tokens)
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
            comps = sample_completions(self.model, self.tok, p, cfg.group_size, cfg.max_new_tokens, cfg.temperature,
                                       seed=cfg.seed * 7_919 + step * 1_009 + i)
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
            loss, m = losses.policy_loss(b.logprobs, b.logprobs.detach(), adv[b.index], b.mask, norm,
                                         loss_type=cfg.loss_type, epsilon=cfg.epsilon)
            for k in stats:
                stats[k] += m[k]
            return loss

        res = sp.backward(self.model, groups, loss_fn, max_tokens=cfg.max_tokens,
                          prefix_activations=cfg.prefix_activations)
        self.ctx.sync(self.model)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        self.step += 1
        correct, loss, computed, plain = self.ctx.all_sum(
            [float((rewards >= 1.0).sum()), res.loss, float(res.tokens_computed), float(res.tokens_plain)])
        return {"step": step, "reward": reward_sum / n_all, "accuracy": correct / n_all, "loss": loss,
                "step_time_s": dt, "tokens_computed": int(computed), "tokens_plain": int(plain), "passes": res.passes,
                "tokens_per_s": plain / dt}

    # -- checkpoints --------------------------------------------------------------------------------------------
    def save(self, folder: str):
        tmp = folder + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "step": self.step,
                    "warm_done": self.warm_done, "config": asdict(self.cfg)}, os.path.join(tmp, "state.pt"))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)

    def load(self, folder: str):
        state = torch.load(os.path.join(folder, "state.pt"), weights_only=False)
        self.model.load_state_dict(state["model"])
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
