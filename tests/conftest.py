import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
# two threads in one process; under pytest-xdist (scripts/dev test runs the suite on as many workers as cores) the
# cores are shared among the workers, so that they do not oversubscribe the machine
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _workers)))

from transformers.utils import logging  # noqa: E402

logging.set_verbosity_error()


import pytest  # noqa: E402


@pytest.fixture(params=["cpu", "reference"])
def kernel_path(request, monkeypatch):
    """Both CPU implementations of the attention primitive: torch's CPU flash kernel and the float64 reference."""
    from sharedprefix.attention import interface

    monkeypatch.setattr(interface.PassState, "backend", request.param)
    return request.param


# -- test tiers ----------------------------------------------------------------------------------------------------
# `scripts/dev test -m "not slow"` is the inner loop; CI runs everything. A slow test carries the `slow` mark, the one
# way to mark it: `@pytest.mark.slow` on the test, `pytestmark = pytest.mark.slow` on a whole file, or
# `pytest.param(..., marks=pytest.mark.slow)` on one parameter set. Each slow case has a lighter sibling left in the
# inner loop.


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, the modules of ``tests/parallel`` (each test a torchrun launch of several processes, the
    longest tests of the suite) go first: xdist hands tests out in collection order, and long tests collected last
    left one worker running them alone at the end. Modules stay whole (their fixtures are built once)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    parallel = os.path.join(os.path.dirname(__file__), "parallel") + os.sep
    items.sort(key=lambda item: not str(item.path).startswith(parallel))  # stable: the order within each part kept
