"""scripts/dev gpu-check: everything that needs a CUDA GPU, in one command, with no set-up step.

Runs from the source tree (PYTHONPATH=src) with the machine's own python3 and packages (torch, transformers,
pytest): the `gpu` tests (the varlen flash primitive and the cascade in bf16, sp.logprobs / sp.backward by the
2x rule), then the GPU benchmark (`sharedprefix bench --device cuda`). Writes benchmarks/gpu_<device>.txt.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

import torch
import transformers

from sharedprefix.attention.kernels import missing_cuda_ops


def _run(cmd, env, timeout, keep=None, log=None):
    """(exit code; stdout lines, the last ``keep`` of them, then stderr's last 20 on a failure). With ``log`` (a
    path), the whole stdout and stderr are written there too.

    A timeout (exit 124, as timeout(1)) is reported with what the command printed so far, instead of ending
    gpu-check without its report.
    """
    try:
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        rc, stdout, stderr = res.returncode, res.stdout, res.stderr
    except subprocess.TimeoutExpired as e:
        text = lambda b: (b.decode(errors="replace") if isinstance(b, bytes) else b) or ""  # noqa: E731
        rc, stdout, stderr = 124, text(e.stdout), text(e.stderr) + f"\ntimed out after {timeout} s"
    if log:
        with open(log, "w") as f:
            f.write(stdout + "\n--- stderr ---\n" + stderr)
    out = stdout.strip().splitlines()
    out = out[-keep:] if keep else out
    return rc, out + (stderr.strip().splitlines()[-20:] if rc != 0 else [])


def main() -> int:
    ap = argparse.ArgumentParser(description="the gpu tests and the GPU benchmark, in one command")
    ap.add_argument("--log-dir", default=None, help="also write the whole output of each step into this folder")
    args = ap.parse_args()
    log = (lambda name: os.path.join(args.log_dir, name)) if args.log_dir else (lambda name: None)  # noqa: E731
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device visible to torch; nothing to check.", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    lines = [
        f"gpu-check {time.strftime('%Y-%m-%d %H:%M')} on {name}; torch {torch.__version__} (CUDA "
        f"{torch.version.cuda}), transformers {transformers.__version__}"
    ]
    missing = missing_cuda_ops()
    lines.append("aten varlen flash ops: " + ("present" if not missing else "MISSING " + ", ".join(missing)))
    print("\n".join(lines), flush=True)
    env = {**os.environ, "PYTHONPATH": "src" + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.time()
    rc_tests, out = _run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu", "-p", "no:cacheprovider", "-rfE", "--tb=short"],
        env,
        180,
        keep=25,
        log=log("gpu_tests.log"),
    )
    lines += ["", f"gpu tests (exit {rc_tests}, {time.time() - t0:.0f} s):", *out]
    print("\n".join(lines[-len(out) - 2 :]), flush=True)
    t0 = time.time()
    rc_bench, out = _run(
        [sys.executable, "-m", "sharedprefix.cli.main", "bench", "--device", "cuda", "--repeats", "2"], env, 270, log=log("gpu_bench.log")
    )
    lines += ["", f"benchmark: sharedprefix bench --device cuda (exit {rc_bench}, {time.time() - t0:.0f} s)", *out]
    print("\n".join(lines[-len(out) - 2 :]), flush=True)
    path = f"benchmarks/gpu_{re.sub(r'[^A-Za-z0-9]+', '_', name).strip('_').lower()}.txt"
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path}")
    if args.log_dir:
        with open(os.path.join(args.log_dir, os.path.basename(path)), "w") as f:
            f.write("\n".join(lines) + "\n")
    return rc_tests or rc_bench


if __name__ == "__main__":
    sys.exit(main())
