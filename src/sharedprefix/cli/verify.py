"""Check exactness on a tiny built-in model, then print a one-line speed comparison.

With ``--model PATH``: check your own local checkpoint instead, in its own dtype and on ``--device``
(``sp.verify``: random groups, one pass and a budget that splits a group, judged by the 2x rule
against a float64 copy), report any refusal with its reason and the speed ratio of the check's
forward; the exit code is non-zero when it is not exact.

Exactness: float64 log-probs and gradients of sharedprefix against a plain transformers
forward of each [prompt + completion] row (SDPA), with and without a token budget.
Speed: forward+backward of the plain run against sharedprefix on a small float32 model.
"""

from __future__ import annotations

import sys

HELP = "verify exactness on a tiny model and print a one-line speed comparison"


def add_arguments(p):
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="a local transformers causal-LM checkpoint folder to check")
    p.add_argument("--device", default="cpu", help="device for --model (default cpu)")
    p.add_argument("--no-speed", dest="speed", action="store_false", help="skip the speed comparison")


def _grads(model):
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _own_model(args) -> int:
    import torch
    import transformers as tf

    import sharedprefix as sp
    from sharedprefix.tools.reference import plain_logprobs
    from sharedprefix.tools.timing import best_time
    from sharedprefix.tools.verify import default_groups

    model = tf.AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True, dtype="auto")
    model = model.to(args.device).eval()
    report = sp.verify(model, seed=args.seed)
    print(f"{type(model).__name__} ({model.dtype}, {args.device}):")
    print(report)
    if report.ok:
        groups = default_groups(model, args.seed)
        with torch.no_grad():
            calls = (lambda: plain_logprobs(model, groups), lambda: sp.logprobs(model, groups))
            times = [best_time(fn, 1) for fn in calls]
        print(
            f"speed of the check's forward: plain {times[0] * 1e3:.1f} ms, sharedprefix {times[1] * 1e3:.1f} ms "
            f"({times[0] / times[1]:.2f}x; tiny groups, not a benchmark)"
        )
    return 0 if report.ok else 1


def run(args):
    if args.model:
        return _own_model(args)
    import torch
    from tqdm import tqdm

    import sharedprefix as sp
    from sharedprefix.tools import bench
    from sharedprefix.tools.reference import dtype_faithful_norms, plain_logprobs

    checks = [(None, "keep"), (60, "offload"), (20, "recompute")]
    # progress on stderr, only when stderr is a terminal (tqdm's disable=None); results on stdout via tqdm.write
    bar = tqdm(
        total=1 + len(checks) + (4 if args.speed else 0),
        desc="verify: plain reference",
        leave=False,
        disable=None,
        dynamic_ncols=True,
        file=sys.stderr,
    )
    torch.manual_seed(args.seed)
    model = bench.bench_model(
        dtype=torch.float64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=500,
    )
    dtype_faithful_norms(model)
    groups = bench.make_groups(3, 40, 9, 5, vocab=500, seed=args.seed)
    model.zero_grad(set_to_none=True)
    ref, _ = plain_logprobs(model, groups)
    (ref * ref.ne(0)).sum().backward()
    want = _grads(model)
    bar.update()
    worst_lp = worst_grad = 0.0
    for budget, mode in checks:
        bar.set_description(f"verify: budget={budget} prefix={mode}")
        res = sp.backward(
            model, groups, lambda b: (b.logprobs * b.mask).sum(), max_tokens=budget, prefix_activations=mode
        )
        got = _grads(model)
        with torch.no_grad():
            lp = sp.logprobs(model, groups, max_tokens=budget).logprobs
        worst_lp = max(worst_lp, float((lp - ref.detach()).abs().max()))
        worst_grad = max(
            worst_grad, max(float((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-300)) for n in want)
        )
        tqdm.write(
            f"budget={budget!s:>4} prefix={mode:<9} passes={res.passes} tokens {res.tokens_computed} vs plain "
            f"{res.tokens_plain}",
            file=sys.stdout,
        )
        bar.update()
    ok = worst_lp <= 1e-9 and worst_grad <= 1e-9
    tqdm.write(
        f"exactness (float64): max |delta logprob| = {worst_lp:.2e}, max relative grad error = {worst_grad:.2e} "
        f"-> {'OK' if ok else 'FAILED'}",
        file=sys.stdout,
    )
    if not args.speed:
        bar.close()
        return 0 if ok else 1
    m32 = bench.bench_model(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=8000,
    )
    g32 = bench.make_groups(1, 1024, 64, 8, vocab=8000)
    bar.set_description("verify: speed, plain run")
    t_plain = bench.best_time(lambda: (m32.zero_grad(), bench.plain_step(m32, g32)), 1, bar)
    bar.set_description("verify: speed, sharedprefix")
    t_shared = bench.best_time(lambda: (m32.zero_grad(), bench.shared_step(m32, g32)), 1, bar)
    bar.close()
    fr = bench.flops(m32.config, g32, shared=False) / bench.flops(m32.config, g32, shared=True)
    print(
        f"speed (prompt 1024, G=8 x 64, fwd+bwd, float32, CPU): plain {t_plain:.2f}s, sharedprefix "
        f"{t_shared:.2f}s -> {t_plain / t_shared:.2f}x faster (FLOP ratio {fr:.2f}x)"
    )
    return 0 if ok else 1
