"""The registered engines (``parallel.engine.Engine``), in the order ``parallel.detect.detect`` asks them whether a
model is theirs: FSDP2 first (it may sit under a DDP-looking wrapper's ``module``), then DDP, then one process, which
takes every model. Adding an engine: its module here and its class in ``ENGINES``, before ``Single``."""

from sharedprefix.parallel.engines.ddp import DDP
from sharedprefix.parallel.engines.fsdp2 import FSDP2
from sharedprefix.parallel.engines.single import Single

ENGINES = (FSDP2, DDP, Single)

__all__ = ["ENGINES"]
