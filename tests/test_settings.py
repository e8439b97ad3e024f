"""Environment settings are read when used, a bad value is refused at that use naming the variable, and the
self-check runs however the public functions were imported."""

import os
import subprocess
import sys

import pytest

import sharedprefix as sp
from helpers import random_groups, tiny_model
from sharedprefix import settings
from sharedprefix.attention.kernels import dense

GROUPS = random_groups(3, 1, [6], [[3, 2]])


@pytest.mark.parametrize(
    "name, value, allowed",
    [("SHAREDPREFIX_DENSE", "off", r"\['0', '1'\]"), ("SHAREDPREFIX_KEEP_LOGITS", "sometimes", r"\['auto'")],
)
def test_a_bad_value_is_refused_at_the_first_call(monkeypatch, name, value, allowed):
    model = tiny_model("qwen3")
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=rf"{name}='{value}' in the environment; expected one of {allowed}"):
        sp.backward(model, GROUPS, lambda b: b.logprobs.sum())


def test_read_when_used_not_at_import(monkeypatch):
    monkeypatch.delenv("SHAREDPREFIX_DENSE", raising=False)
    assert dense.dense_enabled()
    monkeypatch.setenv("SHAREDPREFIX_DENSE", "0")  # after every import: still takes effect
    assert not dense.dense_enabled()
    with dense.dense_dispatch(True):  # the context manager overrides the environment inside its block
        assert dense.dense_enabled()
    assert not dense.dense_enabled()
    assert settings.read("SHAREDPREFIX_KEEP_LOGITS") == "auto"


SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from helpers import random_groups, tiny_model
{imports}
model = tiny_model("qwen3")
with torch.no_grad():
    {call}(model, random_groups(3, 1, [6], [[3, 2]]))
verify = sys.modules.get("sharedprefix.tools.verify")
print("not loaded" if verify is None else "checked" if model in verify._CHECKED else "loaded")
"""


@pytest.mark.parametrize(
    "imports, call",
    [("import sharedprefix as sp", "sp.logprobs"), ("from sharedprefix.api import logprobs", "logprobs")],
)
def test_the_self_check_runs_however_logprobs_was_imported(imports, call):
    tests = os.path.dirname(os.path.abspath(__file__))
    code = SCRIPT.format(tests=tests, imports=imports, call=call)
    for value, want in (("1", "checked"), ("0", "not loaded")):  # one way in: the setting's plugin, by the call
        env = {**os.environ, "SHAREDPREFIX_SELF_CHECK": value, "OMP_NUM_THREADS": "1"}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == want, (value, out.stdout)


def test_every_setting_is_documented():
    docs = open(os.path.join(os.path.dirname(__file__), "..", "docs", "concepts.md")).read()
    for name in settings.SETTINGS:
        assert f"| `{name}` |" in docs, name
