"""The bf16 2x rule for SharedPrefixRLOOTrainer over seeds: per seed, the update's error against the exact float64
run (RLOOTrainer with a plain forward of each row as its hook, Qwen3's norms in float64), ours over RLOOTrainer's own
bf16 run's (accelerate's autocast over float32 weights), 2 steps, beta 0.1, without a budget and with a 24-token budget
that splits every group. A seed where a bf16 run sampled another batch than the float64 run at step 2 (its error above
a tenth of the update) is reported as such and left out of the means: that is sampling, not rounding.

Usage: PYTHONPATH=src python scripts/rloo_bf16_seeds.py [FIRST_SEED] [N_SEEDS]   (about 2 minutes a seed on 2 CPU cores)
"""

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trl import RLOOConfig, RLOOTrainer  # noqa: E402

from sharedprefix.integrations.trl import SharedPrefixRLOOConfig, SharedPrefixRLOOTrainer  # noqa: E402
from sharedprefix.recipes.grpo.tasks import build_tokenizer  # noqa: E402
from support.grpo import float64_qwen3_norms, plain_rows, qwen3_model, train_two_steps  # noqa: E402

BUDGETS = (None, 24)


def main(first: int, n: int) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tmp = Path(tempfile.mkdtemp())
    with pytest.MonkeyPatch.context() as m:
        float64_qwen3_norms(m)
        tok = build_tokenizer()
        model = qwen3_model(tok)
        model.save_pretrained(tmp / "init")
        init, state = str(tmp / "init"), {k: p.detach().clone() for k, p in model.named_parameters()}

        def run(cls, cfg, name, seed, **kw):
            t = train_two_steps(cls, cfg, init, tok, tmp / f"{name}{seed}", seed=seed, beta=0.1, **kw)
            return torch.cat(
                [(p.detach().double() - state[k].double()).flatten() for k, p in t.model.named_parameters()]
            )

        ratios: dict = {b: [] for b in BUDGETS}
        for seed in range(first, first + n):
            ref = run(plain_rows(RLOOTrainer), RLOOConfig, "ref", seed, model_init_kwargs={"dtype": torch.float64})
            scale = float(ref.abs().max())
            plain = float((run(RLOOTrainer, RLOOConfig, "plain", seed, bf16=True) - ref).abs().max())
            errs = {
                b: float(
                    (run(SharedPrefixRLOOTrainer, SharedPrefixRLOOConfig, f"sp{b}", seed, bf16=True,
                         sharedprefix_max_tokens=b) - ref).abs().max()
                )
                for b in BUDGETS
            }  # fmt: skip
            line = f"seed {seed}: update {scale:.3g}, RLOOTrainer bf16 error {plain:.3g}"
            if max(plain, *errs.values()) > 0.1 * scale:
                print(line + ", ours " + ", ".join(f"{e:.3g}" for e in errs.values()) + ": another batch, left out")
                continue
            for b, e in errs.items():
                ratios[b].append(e / plain)
            print(line + ", " + ", ".join(f"ours (budget {b}) {e / plain:.2f}x" for b, e in errs.items()), flush=True)
        for b, r in ratios.items():
            if r:
                print(
                    f"budget {b}: mean {sum(r) / len(r):.2f}x, min {min(r):.2f}x, max {max(r):.2f}x over {len(r)} seeds"
                )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 0, int(sys.argv[2]) if len(sys.argv) > 2 else 8)
