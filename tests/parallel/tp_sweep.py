"""Held-out tensor-parallel sweep (a tool, not a test): zoo models loaded with ``tp_plan="auto"`` on 2 ranks, every
call of ``tp_worker.calls`` against the same calls in one process on the same checkpoint, float64, 1e-9.

Comparing with the one-process sharedprefix run (not the plain forward) isolates what tensor parallelism changes:
a model whose float32 casts the float64 harness cannot reach in some call (a recomputation inside a backward does
not see ``Float64Inside``) fails that call the same way in both runs, and is reported as such, not as a mismatch.

Usage: python tests/parallel/tp_sweep.py OUT_DIR ENTRY [ENTRY ...]   (zoo entries, e.g. mistral cohere mixtral)
Prints one line per model: exact (calls compared), refused (the message), or MISMATCH (the call and the error).
"""

import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel.tp_worker import calls, load  # noqa: E402
from parallel.worker import present  # noqa: E402

from helpers import assert_grads_close  # noqa: E402
from sharedprefix.tools.reference import Float64Inside  # noqa: E402


def main(root, entries):
    names = [f"zoo:{e}" for e in entries]
    out = os.path.join(root, "tp.pt")
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tp_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        worker,
        ",".join(names),
        out,
        "--robust",
    ]
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    got = torch.load(out, weights_only=False)
    for name in names:
        tp = got[name]
        if isinstance(tp, str):
            print(f"{name}: refused or failed at load: {tp[:300]}")
            continue
        with Float64Inside():
            one = calls(load(name, root), robust=True)
        compared, same_error, bad = [], [], []
        for call, want in one.items():
            have = tp[call]
            if isinstance(want, str) or isinstance(have, str):
                (same_error if isinstance(want, str) and have == want else bad).append(call)
                continue
            try:
                if call.startswith("logprobs"):
                    assert float((have - want).abs().max()) <= 1e-9
                else:
                    assert_grads_close(present(have), present(want), 1e-9)
                compared.append(call)
            except AssertionError as e:
                bad.append(f"{call} ({e})")
        status = "MISMATCH " + "; ".join(bad) if bad else "exact"
        print(f"{name}: {status} | compared {compared} | same error in one process: {same_error}")


if __name__ == "__main__":
    from support.torchrun import run_worker

    run_worker(main, sys.argv[1], sys.argv[2:])
