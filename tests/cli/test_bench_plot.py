"""``sharedprefix bench --plot`` draws the docs' figures from the result files in benchmarks/, measuring nothing."""

import os
import shutil

import pytest

from sharedprefix.cli.main import main
from sharedprefix.tools import plots

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_plot_draws_every_figure_from_the_result_files(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    shutil.copytree(os.path.join(ROOT, "benchmarks"), tmp_path / "benchmarks")
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--plot"]) == 0
    out = capsys.readouterr().out
    for name in plots.FIGURES:
        assert f"wrote {os.path.join('docs', 'img', name)}" in out, out
        assert (tmp_path / "docs" / "img" / name).stat().st_size > 1000


def test_readers_parse_every_row_of_the_committed_results():
    bench = os.path.join(ROOT, "benchmarks")
    grid = plots.read_gpu_grid(os.path.join(bench, "gpu_nvidia_h200.txt"))
    assert sorted((r["P"], r["T"], r["G"]) for r in grid) == [
        (P, T, G) for P in (4096, 8192) for T in (512, 1024) for G in (8, 16)
    ]
    assert all(0 < r["speedup"] <= r["flop"] for r in grid)  # measured below the FLOP limit, as the page says
    mem = plots.read_memory(os.path.join(bench, "memory_cpu.txt"))
    assert set(mem) == {"plain", "in_pass", "keep", "offload", "recompute"} and all(len(v) == 4 for v in mem.values())
    tree = plots.read_tree_memory(os.path.join(bench, "tree_memory_cpu.txt"))
    assert set(tree) == {"keep", "recompute"} and [n for n, _ in tree["keep"]] == [2, 4, 8, 16, 32]


def test_a_result_file_in_another_format_is_refused_with_its_name(tmp_path):
    bad = tmp_path / "gpu_nvidia_h200.txt"
    bad.write_text("model: something else\n")
    with pytest.raises(ValueError, match=r"gpu_nvidia_h200.txt: no row of the GPU grid"):
        plots.read_gpu_grid(str(bad))
