"""Show the passes sharedprefix would run for groups of given shapes under a token budget.

Example: sharedprefix plan --prompt 4096 --completion 256 --group-size 16 --groups 2 --max-tokens 6144
"""

from __future__ import annotations

HELP = "show the passes of a plan and the plain run's token count"


def add_arguments(p):
    p.add_argument(
        "--prompt", type=int, nargs="+", default=[4096], help="prompt length(s), one per group or one for all"
    )
    p.add_argument("--completion", type=int, default=256, help="completion length")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--groups", type=int, default=1, help="number of groups")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens one pass may hold")


def run(args):
    import torch

    import sharedprefix as sp

    prompts = args.prompt * args.groups if len(args.prompt) == 1 else args.prompt
    groups = [
        sp.Group(torch.zeros(p, dtype=torch.long), [torch.zeros(args.completion, dtype=torch.long)] * args.group_size)
        for p in prompts
    ]
    print(sp.plan(groups, args.max_tokens).describe())
    return 0
