"""Parallelism: the engine a call runs under (``engine``; one process, DDP, FSDP2 in ``engines``, chosen by
``detect``), tensor and sequence parallelism composed with it (``tensor``, ``sequence``), and whole groups per rank
(``sharding``)."""

from sharedprefix.parallel.sharding import shard_groups

__all__ = ["shard_groups"]
