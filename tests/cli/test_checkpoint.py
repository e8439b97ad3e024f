"""Checkpoints of `sharedprefix train`: a whole one exists at every moment once one was written; a kill at any
step of a write (simulated, and one real kill -9) followed by a resume loses no step and gives the same weights
as an uninterrupted run; the trainer state is read with weights_only=True; checkpoints a run cannot continue
are refused."""

import os
import signal
import subprocess
import sys

import pytest
import torch

from sharedprefix.cli.main import main
from sharedprefix.recipes.grpo import checkpoint
from sharedprefix.recipes.grpo.loop import read_metrics
from tests.cli.runs import train_args
from tests.cli.weights import assert_same_weights

PRIMITIVES = ["_write", "_mark_whole", "_rename", "_unmark", "_rmtree"]
RUN = train_args(2, "--checkpoint-every", "1")


class Killed(BaseException):
    """Stands for a kill: not an Exception, so nothing on the way catches it."""


def instrument(monkeypatch, kill_at=None, before=None):
    """Wrap the replacement's primitive steps: ``before(name, args)`` runs before each, and the step numbered
    ``kill_at`` (from 0) raises Killed instead of running. Returns the list of (name, first argument) run."""
    calls = []

    def wrap(name, run):
        def step(*args):
            if before is not None:
                before(name, args)
            if len(calls) == kill_at:
                raise Killed(f"{name}{args[:1]}")
            calls.append((name, os.path.basename(str(args[0]))))
            return run(*args)

        return step

    for name in PRIMITIVES:
        monkeypatch.setattr(checkpoint, name, wrap(name, getattr(checkpoint, name)))
    return calls


# -- the replacement alone -------------------------------------------------------------------------------------
def _writer(version):
    def write(path):
        for name in ("a.txt", "b.txt"):
            with open(os.path.join(path, name), "w") as f:
                f.write(version)

    return write


def _content(path):
    """The version a whole copy holds (both files agree)."""
    a, b = (open(os.path.join(path, n)).read() for n in ("a.txt", "b.txt"))
    assert a == b
    return a


def test_replace_leaves_one_whole_folder(tmp_path):
    folder = str(tmp_path / "ck")
    assert checkpoint.latest(folder) is None
    for v in ("v1", "v2"):
        checkpoint.replace(folder, _writer(v))
        assert checkpoint.latest(folder) == folder and _content(folder) == v
        assert sorted(os.listdir(tmp_path)) == ["ck"]


REPLACE_STEPS = 6  # write, mark whole, rename old aside, rename new in, unmark old, delete old


@pytest.mark.parametrize("kill_at", range(REPLACE_STEPS + 1))
def test_kill_at_each_step_of_a_replacement(tmp_path, monkeypatch, kill_at):
    folder = str(tmp_path / "ck")
    checkpoint.replace(folder, _writer("v1"))

    def a_whole_copy_exists(name, args):
        found = checkpoint.latest(folder)
        assert found is not None, f"no whole copy before {name}{args[:1]}"
        assert _content(found) in ("v1", "v2", "v3")

    with monkeypatch.context() as m:
        calls = instrument(m, kill_at=kill_at, before=a_whole_copy_exists)
        if kill_at < REPLACE_STEPS:
            with pytest.raises(Killed):
                checkpoint.replace(folder, _writer("v2"))
        else:
            checkpoint.replace(folder, _writer("v2"))
            assert [c[0] for c in calls] == ["_write", "_mark_whole", "_rename", "_rename", "_unmark", "_rmtree"]
    found = checkpoint.latest(folder)
    # once the new copy is marked whole, the newest whole copy is the new one, even while it is still ck.tmp
    assert _content(found) == ("v1" if kill_at < 2 else "v2")
    if kill_at == 2:
        assert found == folder + ".tmp" and not os.path.exists(folder + ".old")
    if kill_at == 3:
        assert found == folder + ".tmp" and not os.path.exists(folder) and checkpoint.whole(folder + ".old")
    # the next replacement finishes or discards what the kill left, with a whole copy at every step
    with monkeypatch.context() as m:
        instrument(m, before=a_whole_copy_exists)
        checkpoint.replace(folder, _writer("v3"))
    assert sorted(os.listdir(tmp_path)) == ["ck"] and _content(folder) == "v3"


def test_kill_in_the_middle_of_writing_the_new_copy(tmp_path):
    folder = str(tmp_path / "ck")
    checkpoint.replace(folder, _writer("v1"))

    def half(path):
        with open(os.path.join(path, "a.txt"), "w") as f:
            f.write("v2")
        raise Killed

    with pytest.raises(Killed):
        checkpoint.replace(folder, half)
    assert checkpoint.latest(folder) == folder and _content(folder) == "v1"  # the half-written ck.tmp is not whole
    checkpoint.replace(folder, _writer("v3"))
    assert sorted(os.listdir(tmp_path)) == ["ck"] and _content(folder) == "v3"


def test_first_write_killed_after_it_was_marked_whole(tmp_path, monkeypatch):
    folder = str(tmp_path / "ck")
    with monkeypatch.context() as m:
        instrument(m, kill_at=2)  # write, mark whole, then killed before the rename
        with pytest.raises(Killed):
            checkpoint.replace(folder, _writer("v1"))
    assert checkpoint.latest(folder) == folder + ".tmp" and _content(folder + ".tmp") == "v1"
    with monkeypatch.context() as m:
        instrument(m, before=lambda name, args: _content(checkpoint.latest(folder)))
        checkpoint.replace(folder, _writer("v2"))
    assert sorted(os.listdir(tmp_path)) == ["ck"] and _content(folder) == "v2"


# -- sharedprefix train ----------------------------------------------------------------------------------------
def _same_run(a, b):
    """Same metrics (no step lost or repeated), same final model and checkpoint weights, nothing left over."""
    ra, rb = read_metrics(a / "metrics.jsonl"), read_metrics(b / "metrics.jsonl")
    assert [r["step"] for r in rb] == [r["step"] for r in ra] == [0, 1]
    assert [r["reward"] for r in rb] == [r["reward"] for r in ra]
    assert_same_weights(a / "model", b / "model")
    assert_same_weights(a / "checkpoint" / "model", b / "checkpoint" / "model")
    assert torch.load(b / "checkpoint" / "trainer_state.pt", weights_only=True)["step"] == 2
    assert sorted(os.listdir(b)) == ["checkpoint", "metrics.jsonl", "model", "reward.png"]


@pytest.mark.slow  # sharedprefix train, killed and resumed at every step
def test_train_killed_at_every_step_of_every_write_resumes_to_the_same_weights(tmp_path, monkeypatch):
    with monkeypatch.context() as m:
        calls = instrument(m)
        assert main([*RUN, "--output", str(tmp_path / "ref")]) == 0
    # two checkpoints (the first replaces nothing, the second replaces the first) and the final model
    assert [c[0] for c in calls] == [
        "_write",
        "_mark_whole",
        "_rename",
        "_write",
        "_mark_whole",
        "_rename",
        "_rename",
        "_unmark",
        "_rmtree",
        "_write",
        "_mark_whole",
        "_rename",
    ]
    for k in range(len(calls)):
        out = tmp_path / f"killed{k}"
        with monkeypatch.context() as m:
            instrument(m, kill_at=k)
            with pytest.raises(Killed):
                main([*RUN, "--output", str(out)])
        assert main([*RUN, "--output", str(out)]) == 0, f"resume after a kill at step {k} ({calls[k]})"
        _same_run(tmp_path / "ref", out)


@pytest.mark.slow  # sharedprefix train in a subprocess, killed with SIGKILL
def test_train_kill_9_between_the_renames(tmp_path):
    """A real SIGKILL right after the old checkpoint was renamed aside: only checkpoint.tmp and checkpoint.old
    exist, and the resume takes checkpoint.tmp."""
    assert main([*RUN, "--output", str(tmp_path / "ref")]) == 0
    out = tmp_path / "killed"
    code = (
        "import os, signal, sys\n"
        "from sharedprefix.recipes.grpo import checkpoint\n"
        "from sharedprefix.cli.main import main\n"
        "rename = checkpoint._rename\n"
        "def rename_then_die(src, dst):\n"
        "    rename(src, dst)\n"
        "    if dst.endswith('checkpoint.old'):\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "checkpoint._rename = rename_then_die\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *RUN, "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    ck = str(out / "checkpoint")
    assert not os.path.exists(ck) and checkpoint.whole(ck + ".tmp") and checkpoint.whole(ck + ".old")
    assert checkpoint.latest(ck) == ck + ".tmp"
    assert main([*RUN, "--output", str(out)]) == 0
    _same_run(tmp_path / "ref", out)


class _RunsCode:
    """Unpickling this calls os.mkdir(path): what a malicious trainer_state.pt could do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def test_trainer_state_is_read_with_weights_only(tmp_path, capsys):
    out = tmp_path / "r"
    assert main([*RUN, "--output", str(out)]) == 0
    state_file = out / "checkpoint" / "trainer_state.pt"
    state = torch.load(state_file, weights_only=True)
    torch.save({**state, "optimizer": _RunsCode(str(tmp_path / "pwned"))}, state_file)
    assert main([*RUN, "--steps", "3", "--output", str(out)]) == 2
    assert not (tmp_path / "pwned").exists()
    err = capsys.readouterr().err
    assert "cannot be read with torch.load(weights_only=True)" in err and "--no-resume" in err


def test_checkpoint_of_another_model_or_adapter_is_refused(tmp_path, capsys):
    out = tmp_path / "r"
    assert main([*RUN, "--steps", "1", "--output", str(out)]) == 0
    assert main([*RUN, "--lora-r", "4", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "this run has lora_r=4 but the checkpoint in" in err and "was written with lora_r=None" in err
    assert "--no-resume" in err
    assert main([*RUN, "--lora-r", "4", "--no-resume", "--steps", "1", "--output", str(out)]) == 0
    assert main([*RUN, "--lora-r", "4", "--seed", "1", "--output", str(out)]) == 2
    assert "this run has seed=1" in capsys.readouterr().err  # the embedded default's base weights come from seed


def test_folder_without_a_whole_checkpoint_is_refused(tmp_path, capsys):
    out = tmp_path / "r"
    (out / "checkpoint").mkdir(parents=True)
    torch.save({"step": 3}, out / "checkpoint" / "state.pt")  # an earlier version's checkpoint
    assert main([*RUN, "--output", str(out)]) == 2
    assert "holds no whole checkpoint" in capsys.readouterr().err
    assert main([*RUN, "--no-resume", "--output", str(out)]) == 0
    assert sorted(os.listdir(out / "checkpoint")) == [".complete", "model", "trainer_state.pt"]
