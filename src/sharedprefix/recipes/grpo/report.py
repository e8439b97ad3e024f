"""Reporting for ``sharedprefix train``: the reward/step-time plot, a summary, and the speed comparison."""

from __future__ import annotations

import torch


def plot_metrics(rows: list[dict], path: str) -> None:
    """PNG with reward per step (and its running mean) and step time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    reward = [r["reward"] for r in rows]
    k = max(1, len(rows) // 10)
    smooth = [sum(reward[max(0, i - k + 1) : i + 1]) / len(reward[max(0, i - k + 1) : i + 1]) for i in range(len(rows))]
    fig, (a, b) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    a.plot(steps, reward, alpha=0.35, label="mean reward")
    a.plot(steps, smooth, label=f"running mean ({k} steps)")
    a.set_ylabel("reward")
    a.legend()
    b.plot(steps, [r["step_time_s"] for r in rows], color="tab:green")
    b.set_ylabel("step time (s)")
    b.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def fifths(rows: list[dict]) -> tuple[float, float]:
    """Mean reward over the first and the last 20% of the steps."""
    n = max(1, len(rows) // 5)
    first = sum(r["reward"] for r in rows[:n]) / n
    last = sum(r["reward"] for r in rows[-n:]) / n
    return first, last


def summarize(rows: list[dict]) -> str:
    if not rows:
        return "no steps run"
    first, last = fifths(rows)
    t = sum(r["step_time_s"] for r in rows)
    return (
        f"{len(rows)} GRPO steps in {t:.1f}s; mean reward first 20% of steps {first:.3f} -> last 20% {last:.3f}; "
        f"tokens computed {sum(r['tokens_computed'] for r in rows)} vs plain {sum(r['tokens_plain'] for r in rows)}"
    )


def speed_comparison(trainer) -> str:
    """Forward+backward of one training step's shape: plain rows vs sharedprefix, in this process."""
    import sharedprefix as sp
    from sharedprefix.tools import bench

    cfg, model = trainer.cfg, trainer.model
    import random

    rng = random.Random(0)
    groups = []
    for s in [trainer.task.sample(rng) for _ in range(cfg.prompts_per_step)]:
        ids = trainer.tok(s.prompt, add_special_tokens=False)["input_ids"]
        comp = [torch.tensor([trainer.tok.eos_token_id] * cfg.max_new_tokens) for _ in range(cfg.group_size)]
        groups.append(sp.Group(ids, comp))

    from tqdm import tqdm

    # progress on stderr, only when stderr is a terminal (tqdm's disable=None)
    bar = tqdm(total=8, desc="speed comparison: plain run", leave=False, disable=None, dynamic_ncols=True)
    t_plain = bench.best_time(lambda: bench.plain_step(model, groups), 3, bar)
    bar.set_description("speed comparison: sharedprefix")
    t_shared = bench.best_time(lambda: bench.shared_step(model, groups, cfg.max_tokens, cfg.prefix_activations), 3, bar)
    bar.close()
    model.zero_grad(set_to_none=True)
    p = len(groups[0].prompt)
    return (
        f"speed on this step's shape ({cfg.prompts_per_step} prompts of {p} tokens, G={cfg.group_size}, "
        f"{cfg.max_new_tokens} new tokens; forward+backward): plain {t_plain * 1e3:.1f} ms, sharedprefix "
        f"{t_shared * 1e3:.1f} ms -> {t_plain / t_shared:.2f}x"
    )
