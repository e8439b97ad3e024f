"""The command line answers --help without importing torch or transformers, and long work shows progress on stderr
only when stderr is a terminal."""

import io
import subprocess
import sys

import pytest

import sharedprefix as sp
from sharedprefix.cli.main import main
from sharedprefix.tools import bench
from tests.cli.runs import train_args

HELP_CHECK = """
import sys
from sharedprefix.cli.main import main
for argv in (["--help"], ["train", "--help"], ["verify", "--help"], ["bench", "--help"], ["plan", "--help"], []):
    try:
        main(argv)
    except SystemExit as e:
        assert e.code == 0, (argv, e.code)
print("HEAVY", sorted(m for m in ("torch", "transformers", "peft", "matplotlib") if m in sys.modules))
from sharedprefix.cli import train
train.run  # a command's module is light; its work imports the heavy modules
import sharedprefix.recipes.grpo.run
print("AFTER A COMMAND'S IMPORTS", "torch" in sys.modules, "transformers" in sys.modules)
"""


def test_help_imports_neither_torch_nor_transformers():
    proc = subprocess.run([sys.executable, "-c", HELP_CHECK], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "HEAVY []" in proc.stdout
    assert "AFTER A COMMAND'S IMPORTS True True" in proc.stdout  # the same check sees them once they are imported
    for text in (
        "usage: sharedprefix [-h] {train,verify,bench,plan}",
        "--lora-r",
        "--checkpoint-every",
        "--memory",
        "--no-speed",
        "--max-tokens",
    ):
        assert text in proc.stdout


def test_package_names_load_on_first_use():
    assert callable(sp.backward) and sp.Group.__name__ == "Group"
    assert sp.schedule.__name__ == "sharedprefix.schedule"  # a subpackage, imported on first access
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        sp.no_such_name  # noqa: B018


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self):
        return True


def test_verify_shows_progress_on_a_terminal(monkeypatch, capsys):
    tty = Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    assert main(["verify", "--no-speed"]) == 0
    assert "verify: budget=20 prefix=recompute" in tty.getvalue()
    out = capsys.readouterr().out
    assert "-> OK" in out and "verify:" not in out


def test_train_progress_on_a_terminal_only(tmp_path, monkeypatch, capsys):
    args = train_args(2, "--checkpoint-every", "1")
    assert main([*args, "--output", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "warm-up" not in err and "GRPO" not in err and "it/s" not in err and "\r" not in err
    tty = Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    assert main([*args, "--steps", "3", "--output", str(tmp_path / "a")]) == 0  # resumes: loads a checkpoint
    assert main([*args, "--output", str(tmp_path / "b")]) == 0
    shown = tty.getvalue()
    assert "warm-up" in shown and "GRPO" in shown and "Loading weights" in shown and "Writing model shards" in shown


def _fake_measure(capsys, printed_before):
    def measure(kind, spec):
        printed_before.append(capsys.readouterr().out)  # what was on stdout when this configuration started
        return {"tokens": 10 * spec["G"], "time_s": 0.5, "peak_bytes": 3 * 2**20}

    return measure


def test_memory_benchmark_prints_each_configuration_as_it_finishes(monkeypatch, capsys):
    printed_before = []
    monkeypatch.setattr(bench, "measure_in_subprocess", _fake_measure(capsys, printed_before))
    tty = Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    assert main(["bench", "--memory", "--G", "2", "4", "--modes", "keep", "plain", "--device", "cpu"]) == 0
    printed = printed_before + [capsys.readouterr().out]
    rows = [
        [line.split()[:2] for line in chunk.splitlines() if line.split()[:1] in (["2"], ["4"])] for chunk in printed
    ]
    # before the i-th configuration started, exactly the rows of the i before it had been printed
    assert rows == [[], [["2", "keep"]], [["2", "plain"]], [["4", "keep"]], [["4", "plain"]]]
    assert "bench --memory: G=4 plain (subprocess)" in tty.getvalue()


def test_speed_benchmark_shows_its_runs_on_a_terminal(monkeypatch, capsys):
    monkeypatch.setattr(bench, "measure_in_subprocess", _fake_measure(capsys, []))
    tty = Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    assert (
        main(
            [
                "bench",
                "--prompt",
                "24",
                "--completion",
                "4",
                "--G",
                "2",
                "--layers",
                "1",
                "--repeats",
                "1",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    shown = tty.getvalue()
    for stage in (
        "bench: plain run",
        "bench: sharedprefix",
        "bench: prompt K/V repeated per completion",
        "bench: peak memory of sharedprefix (subprocess)",
    ):
        assert stage in shown
    assert "speed-up" in capsys.readouterr().out
