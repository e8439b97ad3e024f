"""Launch a test worker under torchrun and fail (never hang) when it does."""

import os
import subprocess
import sys


def torchrun(worker: str, args: list[str], nproc: int = 2, timeout: float = 120) -> None:
    """Run ``worker`` with ``args`` on ``nproc`` CPU ranks (one thread each); a non-zero exit fails with the tail of
    its stderr, and a hang fails after ``timeout`` seconds (never retried: a hang is what some tests test)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", worker, *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(
            f"{nproc}-process run of {args} did not end in {timeout} s: {str(e.stderr)[-3000:]}"
        ) from None
    assert proc.returncode == 0, proc.stderr[-4000:]
