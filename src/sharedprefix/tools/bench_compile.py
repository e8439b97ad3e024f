"""``sharedprefix bench --compile``: the speed-up of sharedprefix over the plain run with the decoder layers eager and
compiled, in one process, the four runs interleaved.

Four runs, each the forward+backward of one group with the speed benchmark's model and loss (``tools.bench``):

- eager plain / eager ours: as ``sharedprefix bench``: the G rows ``[prompt + completion_i]`` in one SDPA batch with
  logits at completion positions only (``logits_to_keep``); ``sp.backward``;
- compiled plain / compiled ours: the same on a second copy of the model (same weights) whose decoder layers are
  compiled in place, ``for layer in model.model.layers: layer.compile()`` (``docs/compile.md``): the unit torchtitan
  and verl compile, the same for both (a model compiled as a whole runs its decoder layers compiled the same way under
  sharedprefix) (``torch.compile`` of the whole plain model measured no faster on the CPU shape: 14.9 to 15.3 CPU
  seconds against 13.2 to 14.2 for compiled layers and 14.4 eager).

The benchmark has no forward-only run, so ``sp.logprobs`` is not timed here.

Compilation: static shapes (``automatic_dynamic_shapes`` off: each compiled run compiles one graph for its shape, as
it would alone at a fixed shape, instead of the second compiled run catching a dynamic recompile from the first) and a
fresh inductor cache directory (the first call compiles cold). Warm-up: one call of each eager run; each compiled run
is called until a call compiles no graph (at most three calls), and its compile time is what the calls that compiled
took beyond the steady-state time. Then ``repeats`` rounds of the four runs in a fixed order
(``timing.best_interleaved``, gradients zeroed before each call, untimed); a run's time is its best. Graph breaks and
graphs compiled (``torch._dynamo.utils.counters``, from a ``torch._dynamo.reset()``) are reported for the warm-up and
for the timed rounds (where both should be 0).

Clock: on one CPU thread, the process's CPU time plus that of the compiler processes it waited for (inductor's C++
compiler, run in-process with ``compile_threads=1``), so that other processes on a shared machine inflate neither
the steady state nor the compile time; otherwise (several threads, CUDA) wall time between device synchronisations,
with inductor's default compile threads.

Shape: on the CPU the speed benchmark's model (Qwen3, hidden 512, 4 layers, 8/4 heads of 64, vocab 32000, float32)
on a group of prompt 1024, G = 8 completions of 128 (half ``bench``'s prompt: one round of the four runs takes about
40 CPU seconds instead of 90, and the whole benchmark a few minutes on one thread); on CUDA the GPU benchmark's
model (Qwen3-4B layer shapes, 4 layers, bf16) on prompt 4096, G = 8 completions of 512.

Notation: P = prompt length, T = completion length, G = completions per group.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from contextlib import ExitStack
from unittest import mock

import torch
import torch._dynamo
import torch._inductor.config

from sharedprefix.tools import bench
from sharedprefix.tools.timing import best_interleaved, timed

RUNS = ("eager plain", "compiled plain", "eager ours", "compiled ours")
BACKEND = "inductor"  # the compiler of the compiled runs; the CLI test sets dynamo's "eager" (same traces, no codegen)
CPU_SHAPE = (1024, 128, 8)  # (P, T, G)
CUDA_SHAPE = (4096, 512, 8)


def cpu_with_children() -> float:
    """CPU seconds of this process and of the child processes it waited for (the C++ compiler's)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _counts() -> tuple[int, int]:
    counters = torch._dynamo.utils.counters
    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


def _compile_settings(one_thread: bool) -> ExitStack:
    """Static shapes, cold caches in a fresh directory, and (on one CPU thread) the compiler in this process; undone
    when the returned stack closes."""
    stack = ExitStack()
    cache = stack.enter_context(tempfile.TemporaryDirectory(prefix="sharedprefix-bench-compile-"))
    stack.enter_context(mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": cache}))
    stack.enter_context(torch._dynamo.config.patch(automatic_dynamic_shapes=False))
    if one_thread:
        stack.enter_context(torch._inductor.config.patch(compile_threads=1))
    return stack


def run(
    layers: int = 4, repeats: int = 2, device: str = "cpu", shape: tuple[int, int, int] | None = None, report=print
) -> list[str]:
    """The lines of ``sharedprefix bench --compile`` (see the module docstring), each also passed to ``report`` as it
    is known (the first before anything runs); ``shape`` = (P, T, G)."""
    cuda = str(device).startswith("cuda")
    P, T, G = shape or (CUDA_SHAPE if cuda else CPU_SHAPE)
    one_thread = torch.get_num_threads() == 1 and not cuda
    clock = cpu_with_children if one_thread else time.perf_counter
    dims, dtype = (bench.GPU_MODEL, torch.bfloat16) if cuda else (bench.BENCH_MODEL, torch.float32)
    model = "Qwen3-4B layer shapes, bf16" if cuda else "Qwen3 hidden 512, 8/4 heads of 64, vocab 32000, float32"
    where = torch.cuda.get_device_name() if cuda else "cpu, " + ("1 thread" if one_thread else "several threads")
    unit = "CPU s (this process and the compilers it ran)" if one_thread else "wall s"
    lines: list[str] = []

    def out(line: str) -> None:
        lines.append(line)
        report(line)

    out(
        f"model: {model}, {layers} layers, {where}; group: prompt {P}, G={G} completions of {T}; forward+backward, "
        f"best of {repeats} interleaved rounds, in {unit}; compiled: the decoder layers in place (layer.compile(), "
        f"backend {BACKEND}) in both compiled runs, static shapes, cold caches"
    )
    eager = bench.bench_model(dtype, **{**dims, "num_hidden_layers": layers}).to(device)
    compiled = bench.bench_model(dtype, **{**dims, "num_hidden_layers": layers}).to(device)
    for layer in compiled.model.layers:
        layer.compile(backend=BACKEND)
    groups = bench.make_groups(1, P, T, G, vocab=dims["vocab_size"])
    calls = {
        "eager plain": lambda: bench.plain_step(eager, groups),
        "compiled plain": lambda: bench.plain_step(compiled, groups),
        "eager ours": lambda: bench.shared_step(eager, groups).loss,
        "compiled ours": lambda: bench.shared_step(compiled, groups).loss,
    }

    def zero():
        eager.zero_grad()
        compiled.zero_grad()

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    warm: dict[str, list[float]] = {}  # a compiled run's warm-up calls that compiled a graph: their seconds
    with _compile_settings(one_thread):
        for name in RUNS:
            warm[name] = []
            for _ in range(3 if name.startswith("compiled") else 1):
                zero()
                before = _counts()[1]
                seconds = timed(calls[name], clock)[0]
                if _counts()[1] == before:
                    break
                warm[name].append(seconds)
        warm_breaks, warm_graphs = _counts()
        best = best_interleaved([(n, calls[n]) for _ in range(repeats) for n in RUNS], zero, clock)
    breaks, graphs = (a - b for a, b in zip(_counts(), (warm_breaks, warm_graphs)))
    t = {n: best[n][0] for n in RUNS}
    losses = [float(best[n][1]) for n in RUNS]
    compile_s = {n: sum(s - t[n] for s in warm[n]) for n in RUNS if n.startswith("compiled")}
    x_eager, x_compiled = t["eager plain"] / t["eager ours"], t["compiled plain"] / t["compiled ours"]
    out(f"{'run':>14} | {'s':>8} | {'compile s':>9} | {'loss':>14}")
    for n, loss in zip(RUNS, losses):
        c = f"{compile_s[n]:9.1f}" if n in compile_s else f"{'-':>9}"
        out(f"{n:>14} | {t[n]:8.3f} | {c} | {loss:14.6e}")
    out(
        f"speed-up: eager ours over eager plain {x_eager:.2f}x | compiled ours over compiled plain {x_compiled:.2f}x | "
        f"compiled / eager {x_compiled / x_eager:.3f} (target >= 1)"
    )
    out(
        f"compiling: plain {t['eager plain'] / t['compiled plain']:.2f}x faster, ours "
        f"{t['eager ours'] / t['compiled ours']:.2f}x faster"
    )
    out(
        f"timed rounds: graphs compiled {graphs}, graph breaks {breaks} | warm-up: graphs compiled {warm_graphs}, "
        f"graph breaks {warm_breaks}"
    )
    out(
        f"losses: largest relative difference between the runs {_spread(losses):.1e} (the plain rows' float32 "
        "log-softmax against ours)"
    )
    return lines


def _spread(values: list[float]) -> float:
    return (max(values) - min(values)) / max(abs(v) for v in values)


_FIGURES = {
    "eager_x": r"eager ours over eager plain ([0-9.]+|nan|inf)x",
    "compiled_x": r"compiled ours over compiled plain ([0-9.]+|nan|inf)x",
    "vs_eager": r"compiled / eager ([0-9.]+|nan|inf) ",
    "timed_graphs": r"timed rounds: graphs compiled (\d+)",
    "timed_breaks": r"timed rounds: .*graph breaks (\d+) \|",
}


def figures(lines) -> dict:
    """{"eager_x", "compiled_x", "vs_eager", "timed_graphs", "timed_breaks"}, those found in ``run``'s lines
    (what ``scripts/dev gpu-check`` reads)."""
    return {k: float(m.group(1)) for line in lines for k, pat in _FIGURES.items() if (m := re.search(pat, line))}
