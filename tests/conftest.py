import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

from transformers.utils import logging  # noqa: E402

logging.set_verbosity_error()


import pytest  # noqa: E402


@pytest.fixture(params=[True, False], ids=["merged", "masked"])
def kernel_path(request, monkeypatch):
    """Both CPU kernels for blocks with ancestors: log-sum-exp merged flash calls, and one masked SDPA call."""
    from sharedprefix.attention import interface

    monkeypatch.setattr(interface, "MERGE_ON_CPU", request.param)
    return request.param
