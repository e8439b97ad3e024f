"""Differential fuzzing: random layouts, options, models and model states (``support.fuzz``), each against one plain
float64 forward and backward per row. A failure prints the whole case (``Case.describe()``); rebuild it with
``support.fuzz.draw(seed)`` or paste the printed fields into ``support.fuzz.Case``.

More seeds by hand: ``cd tests && PYTHONPATH=../src python -m support.fuzz 0 1000``.
"""

import pytest
import torch

from support import fuzz

FAST = [*range(0, 24), 38]  # 38: a cache-path hybrid (Zaya)
SLOW = range(100, 185)  # 85 seeds in CI (as long as 120 were before the plan, float32-parts, cache-path and
# token-stream draws); more by hand, see above


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: each case's tensors are a few hundred numbers, where a second thread only costs the
    pool's synchronisation (several times the work on a loaded machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("seed", FAST)
def test_fuzz_case_matches_plain_rows(seed):
    result = fuzz.check(fuzz.draw(seed))
    assert result == "exact" or result.startswith("refused: ")


@pytest.mark.slow
@pytest.mark.parametrize("seed", SLOW)
def test_fuzz_case_matches_plain_rows_slow(seed):
    result = fuzz.check(fuzz.draw(seed))
    assert result == "exact" or result.startswith("refused: ")


def test_every_model_of_the_fuzzer_is_drawn():
    """The fast seeds reach several architectures, both APIs, trees and groups, and split budgets, a reused
    ``sp.plan_call``, a model with float32 parts, a cache-path hybrid and a model with several token streams."""
    cases = [fuzz.draw(s) for s in FAST]
    assert len({c.model for c in cases}) >= 6
    assert {c.api for c in cases} == {"logprobs", "backward"}
    assert {c.tree for c in cases} == {True, False}
    assert any(c.max_tokens is not None for c in cases) and any(c.checkpointing for c in cases)
    assert any(c.plan for c in cases)
    for kind in (fuzz.FLOAT32_PARTS, fuzz.CACHE_PATH, fuzz.STREAMS):
        assert any(c.model in kind for c in cases), sorted(kind)
