"""The benchmark plots of ``docs/benchmarks.md``, drawn from the result files in ``benchmarks/`` (``sharedprefix bench
--plot``), so that a figure can never disagree with the numbers it shows.

Each ``read_*`` parses one result file as the benchmark prints it and raises ``ValueError`` naming the file and
the line it expected when the format changed; ``draw`` writes the PNGs. Figures:

- ``speedup_gpu.png``: the H200 grid (``benchmarks/gpu_nvidia_h200.txt``), speed-up over the plain run against
  prompt length P and group size G, next to the FLOP ratio (the limit at equal kernel efficiency);
- ``memory_cpu.png``: peak memory against group size G for the plain run, sharing inside a pass only, and the
  schedule's three modes (``benchmarks/memory_cpu.txt``);
- ``tree_memory_cpu.png``: peak memory against the number of prompts sharing one system prompt, under a budget
  (``benchmarks/tree_memory_cpu.txt``).
"""

from __future__ import annotations

import os
import re

FIGURES = ("speedup_gpu.png", "memory_cpu.png", "tree_memory_cpu.png")
_NUM = r"[0-9.]+"


def _lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def read_gpu_grid(path: str) -> list[dict]:
    """Rows of the GPU grid: P, T, G, speedup (x plain), flop (FLOP ratio), mem_plain, mem_ours (MiB)."""
    row = re.compile(
        rf"^\s*(\d+)\s+(\d+)\s+(\d+) \|\s+{_NUM}\s+{_NUM}\s+{_NUM} "
        rf"\|\s+({_NUM})x\s+{_NUM}x\s+({_NUM})x.*\|\s+(\d+)\s+\d+\s+(\d+)\s"
    )
    out = []
    for line in _lines(path):
        m = row.match(line)
        if m:
            P, T, G, x, flop, mp, mo = m.groups()
            out.append(
                {
                    "P": int(P),
                    "T": int(T),
                    "G": int(G),
                    "speedup": float(x),
                    "flop": float(flop),
                    "mem_plain": int(mp),
                    "mem_ours": int(mo),
                }
            )
    if not out:
        raise ValueError(
            f"{path}: no row of the GPU grid ('P T G | plain s PG s ours s | x plain x PG FLOP x ...') found."
        )
    return out


def read_memory(path: str) -> dict[str, list[tuple[int, float]]]:
    """config -> [(G, peak MiB)] from the schedule memory benchmark's table."""
    row = re.compile(rf"^\s*(\d+) (\w+)\s+\d+\s+{_NUM}\s+{_NUM}\s+({_NUM})\s*$")
    return _series(path, row, "G config tokens time s ms/compl.tok peak MiB")


def read_tree_memory(path: str) -> dict[str, list[tuple[int, float]]]:
    """mode -> [(prompts sharing the system prompt, peak MiB)] from the tree memory benchmark's table."""
    row = re.compile(rf"^\s*(\d+)\s+(keep|offload|recompute)\s+\d+\s+\d+\s+{_NUM}\s+({_NUM})\s*$")
    return _series(path, row, "prompts mode tokens passes time s peak MiB")


def _series(path: str, row: re.Pattern, header: str) -> dict[str, list[tuple[int, float]]]:
    """name -> [(x, peak MiB)] from the lines of ``path`` that ``row`` matches (groups: x, name, peak)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for line in _lines(path):
        m = row.match(line)
        if m:
            out.setdefault(m.group(2), []).append((int(m.group(1)), float(m.group(3))))
    if not out:
        raise ValueError(f"{path}: no row '{header}' found.")
    return out


def draw(results: str = "benchmarks", out: str = "docs/img") -> list[str]:
    """Draw every figure from the result files in ``results`` into ``out``; returns the paths written."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("sharedprefix bench --plot needs matplotlib: pip install 'sharedprefix[plot]'.") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out, exist_ok=True)
    paths = []

    grid = read_gpu_grid(os.path.join(results, "gpu_nvidia_h200.txt"))
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"P={r['P']}\nT={r['T']}\nG={r['G']}" for r in grid]
    xs = range(len(grid))
    ax.bar([x - 0.2 for x in xs], [r["speedup"] for r in grid], 0.4, label="measured speed-up over plain")
    ax.bar([x + 0.2 for x in xs], [r["flop"] for r in grid], 0.4, label="FLOP ratio (the limit)", alpha=0.5)
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("x plain")
    ax.set_title("H200, Qwen3-4B layer shapes, bf16, forward+backward")
    ax.legend(fontsize=8)
    paths.append(_save(fig, plt, os.path.join(out, FIGURES[0])))

    mem = read_memory(os.path.join(results, "memory_cpu.txt"))
    paths.append(
        _log2_lines(
            plt,
            mem,
            "group size G (plain: whole rows microbatched under the budget)",
            "prompt 4096, completions 256, budget 6144 (CPU)",
            os.path.join(out, FIGURES[1]),
        )
    )
    tree = read_tree_memory(os.path.join(results, "tree_memory_cpu.txt"))
    paths.append(
        _log2_lines(
            plt,
            tree,
            "prompts sharing one 4096-token system prompt",
            "prefix tree under a budget of 8192 tokens (CPU)",
            os.path.join(out, FIGURES[2]),
        )
    )
    return paths


def _save(fig, plt, path: str) -> str:
    fig.tight_layout()
    # no version stamp, so a redraw of the same data is the same file
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path


def _log2_lines(plt, series: dict, xlabel: str, title: str, path: str) -> str:
    """One line of (x, peak MiB) points per series, x on a base-2 log axis labelled with its values; saved."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in series.items():
        ax.plot([x for x, _ in pts], [m for _, m in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ticks = sorted({x for pts in series.values() for x, _ in pts})
    ax.set_xticks(ticks, [str(x) for x in ticks])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("peak MiB")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, plt, path)
