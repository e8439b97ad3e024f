"""Every Python example runs as written (in this process, on its tiny model) and prints what it promises.

``examples/trl_grpo.py`` is run by ``tests/parallel/test_trl_accelerate.py`` under accelerate's two processes;
``examples/verl_grpo.sh`` needs verl's Ray trainer and a GPU rollout engine, so only its shell syntax is checked.
"""

import os
import re
import runpy
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def run_example(name, monkeypatch, capsys, *argv):
    monkeypatch.setattr(sys, "argv", [name, *argv])
    runpy.run_path(os.path.join(EXAMPLES, name), run_name="__main__")
    return capsys.readouterr().out


def test_core_api_verifies_the_model_and_computes_fewer_tokens_than_plain(monkeypatch, capsys):
    out = run_example("core_api.py", monkeypatch, capsys)
    assert "-> exact by the 2x rule" in out, out
    computed, plain = map(int, re.search(r"(\d+) tokens computed, a plain run computes (\d+)", out).groups())
    assert computed < plain, out


def test_agentic_tree_matches_plain_rows_and_splits_the_tree(monkeypatch, capsys):
    out = run_example("agentic_tree.py", monkeypatch, capsys)
    assert "log-probs of 8 rows equal to the plain per-row forward" in out, out
    passes, computed, plain = map(
        int, re.search(r"in (\d+) passes: (\d+) tokens computed, a plain run computes (\d+)", out).groups()
    )
    assert passes > 1 and computed < plain, out


def test_readme_quickstart_is_valid_python_and_makes_the_calls_of_core_api():
    with open(os.path.join(EXAMPLES, "..", "README.md"), encoding="utf-8") as f:
        readme = f.read()
    code = re.search(r"## Quickstart\n\n```python\n(.*?)```", readme, re.S).group(1)
    compile(code, "README quickstart", "exec")
    with open(os.path.join(EXAMPLES, "core_api.py"), encoding="utf-8") as f:
        example = f.read()
    calls = [
        line.split("  #")[0].strip()
        for line in code.splitlines()
        if re.match(r"\s*(\w+ = )?(sp|torch\.optim)\.|\s*(old|advantages|norm|res|loss, _) = |\s*optimizer\.step", line)
    ]
    assert len(calls) >= 8, calls
    missing = [c for c in calls if c not in example]
    assert not missing, f"README quickstart lines not in examples/core_api.py: {missing}"


@pytest.mark.skipif(not os.path.exists("/bin/bash"), reason="needs bash")
def test_verl_example_is_valid_shell_and_sets_the_engine():
    path = os.path.join(EXAMPLES, "verl_grpo.sh")
    subprocess.run(["/bin/bash", "-n", path], check=True)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert "VERL_USE_EXTERNAL_MODULES=sharedprefix.integrations.verl" in text
    assert "actor_rollout_ref.actor.strategy=fsdp2" in text


def test_readme_stays_short_and_keeps_its_two_commands():
    """A README for a user (at most 200 lines: detail lives in docs/ and links from one line), with the two commands
    that set up and run everything on a fresh machine."""
    with open(os.path.join(EXAMPLES, "..", "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert len(readme.splitlines()) <= 200, len(readme.splitlines())
    assert "scripts/dev run" in readme and "scripts/dev test" in readme
