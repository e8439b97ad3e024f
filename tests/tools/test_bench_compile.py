"""``sharedprefix bench --compile`` (``tools/bench_compile.py``) on a tiny shape: the CLI prints its four runs and the
lines ``scripts/dev gpu-check`` reads, and the timed rounds compile no graph and break none. Not timed: the layers
compile with dynamo's "eager" backend (the same traces and counts as inductor, without its code generation)."""

import math

import pytest

from sharedprefix.cli.main import main as cli_main
from sharedprefix.tools import bench_compile


@pytest.mark.slow  # about 9 CPU seconds (dynamo traces two layers); test_gpu_check.py parses recorded lines
def test_bench_compile_prints_its_runs_and_figures(monkeypatch, capsys):
    monkeypatch.setattr(bench_compile, "BACKEND", "eager")
    args = ["bench", "--compile", "--prompt", "24", "--completion", "4", "--G", "2", "--layers", "1"]
    assert cli_main([*args, "--repeats", "1", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("model: ") and "prompt 24, G=2 completions of 4" in lines[0]
    rows = {line.split("|")[0].strip(): line.split("|")[1:] for line in lines if line.count("|") == 3}
    assert set(rows) == {"run", *bench_compile.RUNS}
    assert all(float(rows[n][0]) > 0 for n in bench_compile.RUNS)
    assert rows["eager plain"][1].strip() == "-" and math.isfinite(float(rows["compiled ours"][1]))  # compile s
    fig = bench_compile.figures(lines)
    assert set(fig) == {"eager_x", "compiled_x", "vs_eager", "timed_graphs", "timed_breaks"}
    assert math.isclose(fig["vs_eager"], fig["compiled_x"] / fig["eager_x"], rel_tol=0.02)
    assert fig["timed_graphs"] == 0 and fig["timed_breaks"] == 0  # the warm-up compiled everything, without a break
    assert "warm-up: graphs compiled 2, graph breaks 0" in "\n".join(lines)  # one graph per compiled run
    spread = next(line for line in lines if line.startswith("losses:"))
    assert float(spread.split("runs ")[1].split()[0]) <= 1e-5  # the four runs compute the same loss
