"""The registered engines (``parallel.engine.Engine``), in the order ``parallel.detect.detect`` asks them whether a
model is theirs: a DeepSpeed engine first (its ``module`` would look like a plain model), then FSDP2 (it may sit
under a DDP-looking wrapper's ``module``), then DDP, then one process, which takes every model. Adding an engine:
its module here and its class in ``ENGINES``, before ``Single``."""

from sharedprefix.parallel.engines.ddp import DDP
from sharedprefix.parallel.engines.deepspeed import DeepSpeed
from sharedprefix.parallel.engines.fsdp2 import FSDP2
from sharedprefix.parallel.engines.single import Single

ENGINES = (DeepSpeed, FSDP2, DDP, Single)

__all__ = ["ENGINES"]
