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


def run_worker(main, *args) -> None:
    """Run a torchrun worker's ``main(*args)`` and leave without interpreter teardown: everything is computed, saved
    and the process group destroyed by then, and a DDP reducer or gloo work still referenced at teardown has aborted a
    rank after a passing run ("terminate called without an active exception", once in CI). A ``main`` that raises
    still fails the run: its traceback is printed and the exit status is 1."""
    import os
    import traceback

    status = 0
    try:
        main(*args)
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def settle_gc() -> None:
    """Collect the garbage, then freeze what survives (``gc.freeze``: left out of every later collection). A worker
    calls it after its imports and before each case: DeepSpeed's ZeRO-3 optimizer calls ``gc.collect()`` at every
    engine build, and a full collection scans every object the imports of torch, transformers and DeepSpeed made, and
    every engine of the cases before it (0.3 to 0.7 s a build on 2 CPU cores, the largest single cost of a ZeRO-3
    launch). With the survivors frozen, each collection scans only the case's own objects. No result changes: the
    garbage is still collected, and frozen objects are live ones, never freed until the worker exits."""
    import gc

    gc.collect()
    gc.freeze()
