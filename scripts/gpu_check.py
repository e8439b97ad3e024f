"""scripts/dev gpu-check: everything that needs a CUDA GPU, in one command, with no set-up step.

Runs from the source tree (PYTHONPATH=src) with the machine's own python3 and packages (torch, transformers,
pytest): the `gpu` tests (the varlen flash primitive and the cascade in bf16, sp.logprobs / sp.backward by the
2x rule), the GPU benchmark (`sharedprefix bench --device cuda`, with its dense-dispatch ablation), the long-prompt
table (`bench --device cuda --long --no-capacity`), the capacity line (`--long --capacity-only`), the hybrid tree
benchmark at Qwen3.5's own layer dimensions (`bench --device cuda --hybrid --tree --dims qwen3.5 --layers 16`), with
eager against compiled decoder layers (`bench --device cuda --compile`) run right after the tests, and one optimizer
step over a trainer's microbatches (`benchmarks/step_speed.py --device cuda`: ``sp.plan_step`` against the plain
rows, a call per microbatch and a call per whole group); each under its own timeout (890 s together: on a machine
whose commands are limited to 600 s, run `--only tests compile bench step` and `--only long capacity hybrid` as two
commands), so that a hang still leaves a report. Writes
benchmarks/gpu_<device>.txt, whose last line is machine-readable (``summary_line``):

    gpu-summary gpu_tests=pass|fail|not_run flop_eff_8192_512_16=F flop_eff_min=F long_vs_inpass_min=F
                long_peak_vs_plain_max=F capacity_vs_plain=F offload_vs_recompute_max=F
                hybrid_tree_vs_tokens=F hybrid_tree_vs_flops=F hybrid_tree_flops_vs_tokens=F
                compile_eager_x=F compile_compiled_x=F compile_vs_eager=F compile_timed_recompiles=F
                step_vs_whole_max=F step_flop_frac_min=F

flop_eff: the speed-up over the plain rows divided by the FLOP ratio (at P=8192, T=512, G=16; the smallest over the
table); long_vs_inpass_min: in-pass sharing's time over ours (keep), the smallest over the long shapes;
long_peak_vs_plain_max: our peak (recompute) over the plain rows', the largest; capacity_vs_plain: our longest prompt
over the plain rows'; offload_vs_recompute_max: offload's time over recompute's, the largest; hybrid_tree_vs_tokens,
hybrid_tree_vs_flops: the hybrid packed tree's speed-up over plain rows divided by the ratio of tokens computed, and by
the (estimated) FLOP ratio; hybrid_tree_flops_vs_tokens: that FLOP ratio over the token ratio; compile_eager_x,
compile_compiled_x: our speed-up over the plain rows with eager and with compiled decoder layers (layer.compile());
compile_vs_eager: the compiled speed-up over the eager one (the target: at least 1); compile_timed_recompiles: the
graphs compiled plus the graph breaks seen during the compile step's timed runs (the target: 0); step_vs_whole_max:
a step's time over whole groups' (each prompt once in both), the largest over the step table's shapes (issue 45's
target: at most 1.05); step_flop_frac_min: the step's speed-up over the plain rows divided by the FLOP ratio, the
smallest (its target: at least 0.9). "nan" where a step did not report the figure (it failed, timed out or ran out
of memory).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import time

import torch
import transformers

from sharedprefix.attention.kernels import missing_cuda_ops
from sharedprefix.tools.bench_compile import figures as compile_figures
from sharedprefix.tools.bench_hybrid import tree_figures


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


# seconds per step, from the first H200 run of every step (2026-12-04: tests 85, compile 66, bench 87; long and capacity
# ran out of 60 and 40; the step tests and benchmark have never run on a GPU: tests 150 and step 150 are guesses);
# 890 s in all, more than one device command's 600 s: run it as two commands (--only)
TIMEOUTS = {"tests": 150, "compile": 120, "bench": 110, "long": 170, "capacity": 100, "hybrid": 90, "step": 150}
_NUM = r"(nan|inf|[0-9.]+)"


def parse_flop_eff(lines) -> dict:
    """{(P, T, G): speed-up over plain / FLOP ratio} from the GPU benchmark's table rows."""
    row = re.compile(rf"^\s*(\d+)\s+(\d+)\s+(\d+) \|\s+{_NUM}\s+{_NUM}\s+{_NUM} \|\s+{_NUM}x\s+{_NUM}x\s+{_NUM}x")
    out = {}
    for line in lines:
        if m := row.match(line):
            P, T, G = (int(x) for x in m.groups()[:3])
            out[P, T, G] = float(m.group(7)) / float(m.group(9))
    return out


def parse_long(lines) -> dict:
    """{(P, T, G): {run: (seconds, peak MiB)}} from the long-prompt table (``tools.bench_long.run``)."""
    row = re.compile(
        rf"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(plain|in_pass|keep|offload|recompute)\s+{_NUM}\s+(-|{_NUM[1:-1]})\s"
    )
    out: dict = {}
    for line in lines:
        if m := row.match(line + " "):
            P, T, G = (int(x) for x in m.groups()[:3])
            peak = float("nan") if m.group(6) == "-" else float(m.group(6))
            out.setdefault((P, T, G), {})[m.group(4)] = (float(m.group(5)), peak)
    return out


def parse_capacity(lines) -> dict:
    """{run: longest prompt} from the capacity line (``tools.bench_long.capacity``)."""
    for line in lines:
        if line.startswith("capacity ") and (m := re.search(r": plain (\d+).*\| in_pass (\d+).*\| ours (\d+)", line)):
            return dict(zip(("plain", "in_pass", "ours"), (int(x) for x in m.groups())))
    return {}


def parse_step(lines) -> dict:
    """{shape: {setting: (seconds, speed-up over plain / FLOP ratio)}} from ``benchmarks/step_speed.py``'s table."""
    row = re.compile(rf"^\| ([^|]+?) \| ([a-z ]+) \| {_NUM} \| {_NUM} \| {_NUM} \| {_NUM} \|")
    out: dict = {}
    for line in lines:
        if m := row.match(line):
            out.setdefault(m.group(1), {})[m.group(2)] = (float(m.group(3)), float(m.group(6)))
    return out


def _ratio(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b):
        return float("nan")
    return a / b if b else float("inf")


def _pick(values, how) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return how(vals) if vals and len(vals) == len(list(values)) else float("nan")


def summary_line(
    tests_ok: bool | None, bench_lines, long_lines, capacity_lines, hybrid_lines=(), compile_lines=(), step_lines=()
) -> str:
    """The machine-readable last line of benchmarks/gpu_<device>.txt (the module docstring defines each figure)."""
    eff = parse_flop_eff(bench_lines)
    hyb = tree_figures(hybrid_lines)
    comp = compile_figures(compile_lines)
    long = parse_long(long_lines)
    cap = parse_capacity(capacity_lines)
    step = parse_step(step_lines)
    nan = float("nan")
    get = lambda r, k, i: r.get(k, (nan, nan))[i]  # noqa: E731
    figures = {
        "flop_eff_8192_512_16": eff.get((8192, 512, 16), nan),
        "flop_eff_min": _pick(list(eff.values()), min),
        "long_vs_inpass_min": _pick([_ratio(get(r, "in_pass", 0), get(r, "keep", 0)) for r in long.values()], min),
        "long_peak_vs_plain_max": _pick(
            [_ratio(get(r, "recompute", 1), get(r, "plain", 1)) for r in long.values()], max
        ),
        "capacity_vs_plain": _ratio(float(cap.get("ours", nan)), float(cap.get("plain", nan))),
        "offload_vs_recompute_max": _pick(
            [_ratio(get(r, "offload", 0), get(r, "recompute", 0)) for r in long.values()], max
        ),
        **{f"hybrid_tree_{k}": hyb.get(k, nan) for k in ("vs_tokens", "vs_flops", "flops_vs_tokens")},
        **{f"compile_{k}": comp.get(k, nan) for k in ("eager_x", "compiled_x", "vs_eager")},
        "compile_timed_recompiles": comp.get("timed_graphs", nan) + comp.get("timed_breaks", nan),
        "step_vs_whole_max": _pick([_ratio(get(r, "step", 0), get(r, "whole groups", 0)) for r in step.values()], max),
        "step_flop_frac_min": _pick([get(r, "step", 1) for r in step.values()], min),
    }
    tests = "not_run" if tests_ok is None else "pass" if tests_ok else "fail"
    return "gpu-summary gpu_tests=" + tests + "".join(f" {k}={v:.3f}" for k, v in figures.items())


def main() -> int:
    ap = argparse.ArgumentParser(description="the gpu tests and the GPU benchmark, in one command")
    ap.add_argument("--log-dir", default=None, help="also write the whole output of each step into this folder")
    ap.add_argument(
        "--only",
        nargs="+",
        choices=list(TIMEOUTS),
        default=list(TIMEOUTS),
        help="run only these steps (the others read nan)",
    )
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
    ran_tests = "tests" in args.only
    rc_tests, out = 0, []
    if ran_tests:
        rc_tests, out = _run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-m",
                "gpu",
                "tests/gpu",
                "-p",
                "no:cacheprovider",
                "-rfE",
                "--tb=short",
            ],
            env,
            TIMEOUTS["tests"],
            keep=25,
            log=log("gpu_tests.log"),
        )
    lines += [
        "",
        f"gpu tests (exit {rc_tests}, {time.time() - t0:.0f} s):" if ran_tests else "gpu tests: not run (--only)",
        *out,
    ]
    print("\n".join(lines[-len(out) - 2 :]), flush=True)
    outs: dict = {key: [] for key in TIMEOUTS}
    bench = [sys.executable, "-m", "sharedprefix.cli.main", "bench", "--device", "cuda"]
    steps = [
        ("compile", "sharedprefix bench --device cuda --compile", [*bench, "--compile", "--repeats", "2"]),
        ("bench", "sharedprefix bench --device cuda", [*bench, "--repeats", "2"]),
        (
            "long",
            "sharedprefix bench --device cuda --long --no-capacity",
            [*bench, "--long", "--no-capacity", "--repeats", "1"],
        ),
        ("capacity", "sharedprefix bench --device cuda --long --capacity-only", [*bench, "--long", "--capacity-only"]),
        (
            "hybrid",
            "sharedprefix bench --device cuda --hybrid --tree --dims qwen3.5 --layers 16",
            [*bench, "--hybrid", "--tree", "--dims", "qwen3.5", "--layers", "16", "--repeats", "1"],
        ),
        (
            "step",
            "benchmarks/step_speed.py --device cuda",
            [sys.executable, "benchmarks/step_speed.py", "--device", "cuda", "--repeats", "2"],
        ),
    ]
    rcs = [rc_tests]
    for key, title, cmd in steps:
        if key not in args.only:
            continue
        t0 = time.time()
        rc, out = _run(cmd, env, TIMEOUTS[key], log=log(f"gpu_{key}.log"))
        rcs.append(rc)
        outs[key] = out
        lines += ["", f"{title} (exit {rc}, {time.time() - t0:.0f} s)", *out]
        print("\n".join(lines[-len(out) - 2 :]), flush=True)
    lines += [
        "",
        summary_line(
            rc_tests == 0 if ran_tests else None,
            outs["bench"],
            outs["long"],
            outs["capacity"],
            outs["hybrid"],
            outs["compile"],
            outs["step"],
        ),
    ]
    print(lines[-1], flush=True)
    part = "" if set(args.only) == set(TIMEOUTS) else "_only_" + "_".join(k for k in TIMEOUTS if k in args.only)
    path = f"benchmarks/gpu_{re.sub(r'[^A-Za-z0-9]+', '_', name).strip('_').lower()}{part}.txt"
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path}")
    if args.log_dir:
        with open(os.path.join(args.log_dir, os.path.basename(path)), "w") as f:
            f.write("\n".join(lines) + "\n")
    return next((rc for rc in rcs if rc), 0)


if __name__ == "__main__":
    sys.exit(main())
