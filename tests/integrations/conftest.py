"""Fixtures the verl test files share."""

import tempfile

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def process_group():
    """A one-process gloo group for a module's in-process verl engines (FSDP2 needs one), destroyed after it."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
